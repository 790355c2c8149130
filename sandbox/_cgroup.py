"""Per-run cgroups: the memory (swap included) and task caps, CPU accounting and the final kill.

This host runs cgroups in hybrid mode: the v1 hierarchies `memory`, `pids` and `cpuacct` carry
the limits and the accounting, while the v2 hierarchy (`unified`) has no controllers but offers
`cgroup.kill`, which ends every task of a cgroup in one atomic step (used when present; the
fallback kills the v1 `pids` cgroup's tasks until none is left). Each run gets fresh cgroups,
so peak usage and failure counters describe that run alone.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from sandbox.backend import SandboxError

ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("memory", "pids", "cpuacct")
UNIFIED = "unified"
PARENT = "rlpost-sandbox"        # every run's cgroups live in <hierarchy>/rlpost-sandbox/<name>
_EMPTY_WAIT_S = 5.0


@dataclass
class Usage:
    """What a run's cgroups recorded."""

    cpu_s: float
    oom_kills: int
    memory_failcnt: int
    pids_max_hits: int


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def has_swap_accounting(root: str = ROOT) -> bool:
    return os.path.exists(os.path.join(root, "memory", "memory.memsw.limit_in_bytes"))


def has_kill(root: str = ROOT) -> bool:
    """v2 `cgroup.kill` exists in non-root cgroups only: look in (or create) our parent there."""
    unified = os.path.join(root, UNIFIED)
    if not os.path.isfile(os.path.join(unified, "cgroup.procs")):
        return False
    parent = os.path.join(unified, PARENT)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError:
        return False
    return os.path.exists(os.path.join(parent, "cgroup.kill"))


class RunCgroups:
    """The cgroups of one command. Create, let the child join them (`join_fds` are opened here,
    close-on-exec, and written by the child before it execs), then `kill_all` and `remove`."""

    def __init__(self, name: str, *, memory_bytes: int, pids_max: int, root: str = ROOT,
                 use_kill: bool = True) -> None:
        self.paths: dict[str, str] = {}
        self.join_fds: list[int] = []
        self._swap = has_swap_accounting(root)
        controllers = list(V1_CONTROLLERS)
        if use_kill:                     # the caller checked has_kill() once
            controllers.append(UNIFIED)
        try:
            for ctl in controllers:
                parent = os.path.join(root, ctl, PARENT)
                os.makedirs(parent, exist_ok=True)
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.paths[ctl] = path
            mem = self.paths["memory"]
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
            if self._swap:
                _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
            _write(os.path.join(self.paths["pids"], "pids.max"), str(pids_max))
            for path in self.paths.values():
                self.join_fds.append(os.open(os.path.join(path, "cgroup.procs"),
                                             os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            self.remove()
            raise

    def close_join_fds(self) -> None:
        for fd in self.join_fds:
            os.close(fd)
        self.join_fds = []

    def cpu_s(self) -> float:
        return int(_read(os.path.join(self.paths["cpuacct"], "cpuacct.usage"))) / 1e9

    def pids_max_hits(self) -> int:
        """How often a fork/clone failed on pids.max."""
        text = _read(os.path.join(self.paths["pids"], "pids.events"))
        return int(dict(line.split() for line in text.splitlines()).get("max", "0"))

    def pids(self) -> list[int]:
        """Tasks (thread-group leaders) in the run's pids cgroup."""
        text = _read(os.path.join(self.paths["pids"], "cgroup.procs"))
        return [int(p) for p in text.split()]

    def usage(self) -> Usage:
        mem = self.paths["memory"]
        pre = "memory.memsw." if self._swap else "memory."
        oom = dict(line.split() for line in _read(os.path.join(mem, "memory.oom_control")).splitlines())
        return Usage(
            cpu_s=self.cpu_s(),
            oom_kills=int(oom.get("oom_kill", "0")),
            memory_failcnt=int(_read(os.path.join(mem, pre + "failcnt"))),
            pids_max_hits=self.pids_max_hits(),
        )

    def kill_except(self, keep: int) -> None:
        """SIGKILL every task but `keep` (the supervisor's direct child, which then exits on its
        own once its children are gone, so nothing is orphaned to the host's init)."""
        for pid in self.pids():
            if pid != keep:
                _kill(pid)

    def kill_all(self) -> None:
        """End every task in the cgroups and wait until they are gone."""
        deadline = time.monotonic() + _EMPTY_WAIT_S
        if UNIFIED in self.paths:
            _write(os.path.join(self.paths[UNIFIED], "cgroup.kill"), "1")
        while True:
            left = self.pids()
            if not left:
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"tasks {left} of cgroup {self.paths['pids']} survive SIGKILL")
            for pid in left:
                _kill(pid)
            time.sleep(0.005)

    def remove(self) -> None:
        """Remove the cgroups (retrying while just-killed tasks finish leaving them)."""
        self.close_join_fds()
        deadline = time.monotonic() + _EMPTY_WAIT_S
        for ctl, path in list(self.paths.items()):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove cgroup {path}: {e}") from e
                    time.sleep(0.005)
            del self.paths[ctl]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass          # exited between listing and kill: nothing to do


def remove_stale(root: str = ROOT) -> list[str]:
    """Kill the tasks of, and remove, run cgroups (`<pid>-...`) whose creating process no longer
    exists (e.g. it crashed). Returns what was removed."""
    removed = []
    for ctl in V1_CONTROLLERS + (UNIFIED,):
        parent = os.path.join(root, ctl, PARENT)
        if not os.path.isdir(parent):
            continue
        for name in os.listdir(parent):
            pid = name.split("-", 1)[0]
            path = os.path.join(parent, name)
            if not (pid.isdigit() and os.path.isdir(path)) or os.path.exists(f"/proc/{pid}"):
                continue
            deadline = time.monotonic() + _EMPTY_WAIT_S
            while left := _read(os.path.join(path, "cgroup.procs")).split():
                if time.monotonic() > deadline:
                    raise SandboxError(f"tasks {left} of stale cgroup {path} survive SIGKILL")
                for task in left:
                    _kill(int(task))
                time.sleep(0.005)
            os.rmdir(path)
            removed.append(path)
    return removed
