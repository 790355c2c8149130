"""Per-run cgroups: the memory (swap included) and task caps, CPU accounting and the final kill.

This host runs cgroups in hybrid mode: the v1 hierarchies `memory`, `pids` and `cpuacct` carry
the limits and the accounting. Each run gets fresh cgroups, so peak usage and failure counters
describe that run alone. The command joins them through their `tasks` files (see
sandbox._helper for why not `cgroup.procs`).

The v2 hierarchy (`unified`) is not used for runs: joining a v2 cgroup costs an RCU grace
period per command (its `cgroup.procs` write takes the global threadgroup lock, and v2 has no
per-thread way into a domain cgroup), and its `cgroup.kill` is not needed: a run's tasks are
the outer bwrap and its pid namespace, which the kernel empties atomically once the namespace's
init dies, so killing the tasks the `pids` cgroup lists until none is left ends everything.
(`remove_stale` still cleans `unified` leftovers of older versions.)
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
_FIRST_PAUSE_S = 0.0002    # polling for killed tasks to leave: start short, back off
_MAX_PAUSE_S = 0.005


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


class RunCgroups:
    """The cgroups of one command. Create, let the command join them (before it execs, the
    process that becomes it writes "0" to each of `join_files`: the launcher, the fallback
    preexec_fn or the box supervisor's child), then `kill_all` and `remove`."""

    def __init__(self, name: str, *, memory_bytes: int, pids_max: int, root: str = ROOT) -> None:
        self.paths: dict[str, str] = {}
        self._swap = has_swap_accounting(root)
        try:
            for ctl in V1_CONTROLLERS:
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
        except BaseException:
            self.remove()
            raise
        self.join_files = [os.path.join(path, "tasks") for path in self.paths.values()]

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
        """SIGKILL every task in the cgroups, again and again (a task may fork between listing
        and kill, though never past pids.max), until none is left."""
        deadline = time.monotonic() + _EMPTY_WAIT_S
        pause = _FIRST_PAUSE_S
        while True:
            left = self.pids()
            if not left:
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"tasks {left} of cgroup {self.paths['pids']} survive SIGKILL")
            for pid in left:
                _kill(pid)
            time.sleep(pause)     # killed tasks take a moment to leave: usually well under 1 ms
            pause = min(2 * pause, _MAX_PAUSE_S)

    def remove(self) -> None:
        """Remove the cgroups (retrying while just-killed tasks finish leaving them)."""
        deadline = time.monotonic() + _EMPTY_WAIT_S
        for ctl, path in list(self.paths.items()):
            pause = _FIRST_PAUSE_S
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove cgroup {path}: {e}") from e
                    time.sleep(pause)
                    pause = min(2 * pause, _MAX_PAUSE_S)
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
