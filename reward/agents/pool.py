"""Agent episodes (`task.agent`) in worker processes that a deadline can really end.

The agent function `fn(base_url, row, **kwargs)` (reward.loader.load_agent_function) runs in up to
`workers` persistent processes, one episode at a time each. An agent that hangs, crashes, floods its
output or forks without end costs its own episode (an `AgentOutcome` whose `error` names the cause)
and its worker, which is replaced; the other episodes go on, and the driver never waits on an agent.

Processes: driver -> zygote -> workers. The driver (threads: Ray, uvicorn) must not fork, so the pool
starts one zygote with subprocess (vfork + exec); the zygote imports the agent function once
(`base_dir` first on sys.path) and forks the workers, which inherit it imported. Why not spawned or
forkserver workers that each import it: agent modules may pull in heavy libraries
(examples.calculator_agent imports torch through examples.calculator: 5-10 s, 440 MB), which every
replacement of a killed worker would pay again; a fork of the loaded zygote costs ~30 ms and shares
those pages copy-on-write. (A module that starts threads at import may leave a lock held in the
forks: such a worker hangs, and the deadline ends its episode.) The zygote reaps the workers and
reports each exit status; both are child subreapers, so what an agent orphans stays theirs to reap.
A worker runs one episode: when its result comes in, the monitor kills its tree (before the result
reaches the driver), so nothing an episode leaves (threads still calling, globals, cwd, environment,
children) is seen by another or outlives the episode; the next episode gets a fresh fork of the
loaded zygote (cost: ~5-10 ms an episode with cgroups, ~15-35 ms in the fallback, against
0.5-15 ms reused; printed by tests/test_agent_procs.py::test_each_episode_runs_in_a_fresh_process_and_its_cost).

Isolation where root can write the v1 `memory` and `pids` hierarchies (detected once per process,
logged): each worker joins cgroups of its own (sandbox._cgroup.RunCgroups) before its first episode:
memory (`memory_mb`, swap included where accounted; pages still shared with the zygote stay charged
to it, so the limit counts what the agent allocates) and pids (`max_processes`). A deadline, `cancel`
and `close` kill every task in them, whatever session it moved to; after each episode the worker and
what the agent left running are killed; a SIGKILL death with the memory cgroup's OOM/fail counters set is named as
the memory limit.
Fallback (no cgroups, e.g. non-root): each worker is a session leader with RLIMIT_AS (`memory_mb`
over the address space it inherits: an allocation past it raises MemoryError) and RLIMIT_NPROC
(`max_processes` over the user's current task count; root ignores it, so a fork bomb run as root is
bounded only by the deadline). Kills are killpg of the worker's group; descendants that left it are
killed as children of the worker after each episode, or of the zygote once the worker is dead: best
effort, one forking faster than the sweep can escape.
Not isolated in either: network and filesystem. The agent runs as the driver's user with its network
(it must reach base_url on loopback); it is trusted not to be malicious, only allowed to be buggy.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import faulthandler
import functools
import inspect
import itertools
import logging
import os
import pickle
import resource
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from reward.loader import RewardLoadError, load_agent_function
from sandbox import _cgroup
from sandbox.backend import SandboxError

log = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LOAD_TIMEOUT_S = 300.0  # the zygote's import of the agent module (torch-heavy ones take ~10 s)
_IO_TIMEOUT_S = 5.0      # one message to or from our own code in a worker or the zygote
_CLOSE_WAIT_S = 0.5
_CHUNK = 1 << 16
_ERROR_CHARS = 1000
_PR_SET_CHILD_SUBREAPER = 36
_names = itertools.count()
_SIGNAL_NAMES = {int(sig): sig.name for sig in signal.Signals}


@dataclass
class AgentLimits:
    """An episode's limits (the module docstring says how each is enforced, with cgroups or
    without: then `max_processes` is RLIMIT_NPROC, which root ignores)."""

    timeout_s: float              # wall clock, from when a worker gets the episode
    memory_mb: int = 2048         # the agent's process tree
    max_processes: int = 64       # tasks in the agent's process tree
    max_result_bytes: int = 1 << 20   # the pickled return value
    log_tail_bytes: int = 4096    # the end of its stdout+stderr, kept for error messages


@dataclass
class AgentOutcome:
    value: Any          # the return value (None when error is set)
    error: str | None   # why the episode failed, one line naming the cause
    log_tail: str       # the end of what it printed (stdout+stderr)
    seconds: float      # wall time of the episode


@dataclass(eq=False)
class _Job:
    id: Hashable
    payload: bytes      # pickled (base_url, row)
    started: float      # when queued, then when a worker got it
    cancelled: bool = False


@dataclass(eq=False)
class _Worker:
    """A worker as the driver sees it: pending until the zygote reports its pid, then idle or
    running `job`; `doomed` once killed, until the zygote reports its exit."""

    sock: socket.socket
    log_fd: int                   # the read end of its stdout+stderr
    pid: int | None = None
    cg: _cgroup.RunCgroups | None = None
    job: _Job | None = None
    doomed: bool = False
    tail: bytes = b""
    inbox: bytearray = field(default_factory=bytearray)  # its reply so far


class AgentPool:
    """Runs `fn(base_url, row, **kwargs)` episodes in worker processes under `limits`; outcomes come
    back through `results`. Job ids must be unique among the jobs not yet reported."""

    def __init__(self, spec: str, base_dir: str, workers: int, limits: AgentLimits,
                 kwargs: dict | None = None, name: str = "task.agent", python: str | None = None):
        """Waits (up to _LOAD_TIMEOUT_S) for the zygote to load the function, so a bad spec or
        signature raises RewardLoadError here, before any episode. `python`: the interpreter the
        zygote (so every episode) runs in, e.g. another virtual environment's, for agent code whose
        packages conflict with ours (None: this one); it imports only this module's standard-library
        closure of ours (reward.agents.pool, reward.loader, sandbox._cgroup), from this checkout."""
        self.size, self.limits, self.name = workers, limits, name
        self._cgroups = _cgroups_usable()
        config = dict(spec=spec, base_dir=base_dir, kwargs=dict(kwargs or {}), name=name, limits=limits,
                      fallback=not self._cgroups)
        self._zygote, self._ctrl = _start_zygote(config, python or sys.executable)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[Hashable, _Job] = {}
        self._workers: list[_Worker] = []
        self._done: list[tuple[Hashable, AgentOutcome]] = []
        self._broken: str | None = None
        self._closed = False
        # called with a job's id as it finishes (the monitor's thread, before `results` has it): the
        # agent server ends the episode there, so no call of its agent lands after (issue 47)
        self.on_end: Callable[[Hashable], None] | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._sel.register(self._ctrl, selectors.EVENT_READ, self._on_zygote)
        self._thread = threading.Thread(target=self._monitor, name="agent-monitor", daemon=True)
        self._thread.start()

    # -- the public face: any thread --------------------------------------------------------
    def start(self, job_id: Hashable, base_url: str, row: dict) -> None:
        """Queue an episode; the monitor thread hands it to a worker when one is free. The row is
        pickled here, so one that cannot be raises here."""
        job = _Job(job_id, pickle.dumps((base_url, row), pickle.HIGHEST_PROTOCOL), time.monotonic())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: AgentPool.start after close")
            if self._broken:
                self._finish(job, error=self._broken)
                return
            self._jobs[job_id] = job
            self._queue.append(job)
        self._wake()

    def results(self, wait_s: float) -> list[tuple[Hashable, AgentOutcome]]:
        """The episodes finished since the last call, waiting up to `wait_s` for at least one."""
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout=wait_s)
            done, self._done = self._done, []
        return done

    def cancel(self, job_id: Hashable) -> None:
        """Drop a queued job, or have a running one's worker killed; no outcome either way."""
        with self._cond:
            job = None if self._closed else self._jobs.pop(job_id, None)
            if job is None:
                return
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
        self._wake()

    def running(self) -> int:
        with self._cond:
            return sum(1 for w in self._workers if w.job is not None and not w.job.cancelled)

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        """Kill every worker's tree and the zygote. Never waits on an agent: killing takes
        milliseconds; the waits below are for our own processes, bounded."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                self._kill(w)
        self._wake()
        self._thread.join(_CLOSE_WAIT_S)
        with suppress(OSError):  # EOF: the zygote kills and reaps what is left, and exits
            self._ctrl.shutdown(socket.SHUT_RDWR)
        try:
            self._zygote.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait(_CLOSE_WAIT_S)
        if not self._thread.is_alive():  # else it may still use the fds: the process exit closes them
            for w in list(self._workers):
                self._discard(w)
            self._sel.close()
            self._ctrl.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        with suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # -- the monitor thread -----------------------------------------------------------------
    def _monitor(self) -> None:
        """The one thread that talks to the zygote and the workers: it reads results and output as
        they come, hands queued jobs out, and kills what is past its deadline or cancelled."""
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    starts = [w.job.started for w in self._workers if w.job is not None]
                timeout = max(0.0, min(starts) + self.limits.timeout_s - time.monotonic()) if starts else None
                events = self._sel.select(timeout)
                with self._cond:
                    if self._closed:
                        return
                    for key, _ in events:
                        if self._sel.get_map().get(key.fd) is key:  # an earlier handler may have closed it
                            key.data()
                    self._kill_overdue()
                    self._dispatch()
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the jobs, not hang them
            log.exception("%s: agent pool monitor failed", self.name)
            with self._cond:
                self._break(f"pool failed: {type(exc).__name__}: {exc}")

    def _on_wake(self) -> None:
        with suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def _on_zygote(self) -> None:
        """The zygote's reports: "F pid" (forked), "E why" (could not fork), "X pid status" (exited)."""
        msg = self._ctrl.recv(4096)
        if not msg:
            self._break(f"could not run: its zygote process (pid {self._zygote.pid}) exited")
            return
        kind, _, rest = msg.decode().partition(" ")
        if kind == "F":
            self._forked(int(rest))
        elif kind == "E":
            self._discard(next(w for w in self._workers if w.pid is None))
            self._fail_queued(rest)
        else:
            pid, status = map(int, rest.split())
            self._exited(pid, status)

    def _spawn(self) -> None:
        """Ask the zygote for a worker, handing it the worker's end of a socket and of a pipe for
        its output; the zygote answers with its pid."""
        ours, theirs = socket.socketpair()
        log_r, log_w = os.pipe()
        try:
            socket.send_fds(self._ctrl, [b"F"], [theirs.fileno(), log_w])
        finally:
            theirs.close()
            os.close(log_w)
        os.set_blocking(log_r, False)
        ours.settimeout(_IO_TIMEOUT_S)
        w = _Worker(ours, log_r)
        self._workers.append(w)
        self._sel.register(ours, selectors.EVENT_READ, functools.partial(self._on_result, w))
        self._sel.register(log_r, selectors.EVENT_READ, functools.partial(self._read_output, w))

    def _forked(self, pid: int) -> None:
        """Put a new worker in its cgroups (by its pid, before it gets a job) and make it idle."""
        w = next(w for w in self._workers if w.pid is None)
        w.pid = pid
        if not self._cgroups:
            return
        try:
            w.cg = _cgroup.RunCgroups(f"{os.getpid()}-agent-{next(_names)}", pids_max=self.limits.max_processes,
                                      memory_bytes=self.limits.memory_mb << 20)
            for path in w.cg.paths.values():
                _cgroup._write(os.path.join(path, "cgroup.procs"), str(pid))
        except (OSError, SandboxError) as exc:
            self._kill(w)
            self._fail_queued(f"could not put a worker in its cgroups: {exc}")

    def _dispatch(self) -> None:
        """Hand queued jobs to idle workers; ask for more workers (up to `workers`) for the rest."""
        idle = [w for w in self._workers if w.pid is not None and w.job is None and not w.doomed]
        while self._queue and idle:
            w, job = idle.pop(), self._queue.popleft()
            job.started, w.job, w.tail = time.monotonic(), job, b""
            with suppress(OSError):  # it died meanwhile: its exit report ends the job
                _send_msg(w.sock, job.payload)
        live = [w for w in self._workers if not w.doomed]
        pending = sum(1 for w in live if w.pid is None)
        for _ in range(min(len(self._queue) - pending, self.size - len(live))):
            self._spawn()

    def _on_result(self, w: _Worker) -> None:
        """A worker's reply: b"V" + the pickled value, or b"E" + why the episode failed. Read as it
        comes, never waiting (the monitor holds the pool's lock here: issue 47); its size is checked
        from its header, so an oversized one is never allocated here."""
        if w.doomed:
            self._unregister(w.sock)
            return
        try:
            chunk = w.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # it is dying: its exit report says why
            self._unregister(w.sock)
            return
        w.inbox += chunk
        if len(w.inbox) < 8:
            return
        (size,) = struct.unpack("!Q", w.inbox[:8])
        limit = self.limits.max_result_bytes + 4 * _ERROR_CHARS
        if size > limit:  # the stream is unusable
            job = w.job
            self._kill(w)
            if job is not None:
                self._finish(job, error=f"sent an unreadable result (a {size}-byte message, over the {limit}-byte "
                                        "limit): killed")
            return
        if len(w.inbox) < 8 + size:
            return
        msg, w.inbox = bytes(w.inbox[8:8 + size]), bytearray()
        job = w.job
        if job is None:
            return
        self._kill(w)  # retired: the next episode gets a fresh fork of the zygote (issue 47)
        self._drain_output(w)
        value, error = None, None
        if msg[:1] == b"V":
            try:
                value = pickle.loads(msg[1:])
            except Exception as exc:  # noqa: BLE001 - e.g. a class the driver cannot import
                error = f"returned a value the driver cannot unpickle: {type(exc).__name__}: {exc}"
        else:
            error = msg[1:].decode("utf-8", "replace")
        self._finish(job, value, error, w.tail)

    def _read_output(self, w: _Worker) -> bool:
        """Keep the last log_tail_bytes of what the worker's tree prints: the pipe is read as it
        fills, so a flood costs the driver CPU time, not memory. False when nothing more is there."""
        try:
            data = os.read(w.log_fd, _CHUNK)
        except BlockingIOError:
            return False
        if not data:
            self._unregister(w.log_fd)
            return False
        keep = self.limits.log_tail_bytes
        w.tail = (w.tail + data)[-keep:] if keep else b""
        return True

    def _drain_output(self, w: _Worker) -> None:
        for _ in range(64):  # what is in the pipe now, bounded: a writer left alive may never stop
            if not self._read_output(w):
                return

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            job = w.job
            if job is None:
                continue
            if job.cancelled:
                self._kill(w)
            elif now - job.started >= self.limits.timeout_s:
                self._kill(w)
                self._drain_output(w)
                self._finish(job, error=f"did not return within {self.name}_timeout_s="
                                        f"{self.limits.timeout_s:g} s: killed", tail=w.tail)

    def _kill(self, w: _Worker) -> None:
        """SIGKILL the worker's tree now: its process group at once, then with cgroups every task in
        them, wherever it went. Its job, if any, is the caller's to report; the zygote reports its exit."""
        w.doomed, w.job = True, None
        if w.pid is not None:
            _kill(w.pid)
        if w.cg is not None:
            try:
                w.cg.kill_all()
            except SandboxError as exc:
                log.warning("%s: %s", self.name, exc)

    def _exited(self, pid: int, status: int) -> None:
        w = next((w for w in self._workers if w.pid == pid), None)
        if w is None:
            return
        if w.job is not None:  # died during its episode (a killed worker has no job any more)
            self._drain_output(w)
            self._finish(w.job, error=self._death(w, status), tail=w.tail)
        self._discard(w)

    def _death(self, w: _Worker, status: int) -> str:
        if os.WIFEXITED(status):
            return f"exited with code {os.WEXITSTATUS(status)} before returning"
        sig = os.WTERMSIG(status)
        if sig == signal.SIGKILL and w.cg is not None:
            usage = w.cg.usage()
            if usage.oom_kills or usage.memory_failcnt:
                return f"was killed at its memory limit, {self.name}_memory_mb={self.limits.memory_mb}"
        return f"was killed by signal {_SIGNAL_NAMES.get(sig, sig)}"

    def _discard(self, w: _Worker) -> None:
        """Forget an exited worker: its fds, and its cgroups with anything still in them."""
        self._unregister(w.sock)
        self._unregister(w.log_fd)
        w.sock.close()
        os.close(w.log_fd)
        if w.cg is not None:
            try:
                w.cg.kill_all()
                w.cg.remove()
            except SandboxError as exc:
                log.warning("%s: %s", self.name, exc)
        self._workers.remove(w)

    def _unregister(self, fileobj: Any) -> None:
        with suppress(KeyError, ValueError):
            self._sel.unregister(fileobj)

    def _fail_queued(self, why: str) -> None:
        """A worker could not be started: the job it was for fails, naming why (bounded: no retry loop)."""
        if self._queue:
            self._finish(self._queue.popleft(), error=why)

    def _break(self, reason: str) -> None:
        """No worker can be started any more: every job fails naming `reason`, and so will later ones."""
        self._broken = reason
        self._unregister(self._ctrl)
        for w in list(self._workers):
            job = w.job
            self._kill(w)
            if job is not None:
                self._finish(job, error=reason)
            self._discard(w)
        while self._queue:
            self._finish(self._queue.popleft(), error=reason)

    def _finish(self, job: _Job, value: Any = None, error: str | None = None, tail: bytes = b"") -> None:
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]
        if self.on_end is not None:
            try:
                self.on_end(job.id)
            except Exception:  # noqa: BLE001 - the outcome must still be reported
                log.exception("%s: ending episode %r failed", self.name, job.id)
        if job.cancelled:
            return
        self._done.append((job.id, AgentOutcome(value, None if error is None else f"{self.name} {error}",
                                                tail.decode("utf-8", "replace"), time.monotonic() - job.started)))
        self._cond.notify_all()


@functools.lru_cache(maxsize=None)
def _cgroups_usable() -> bool:
    """Whether workers get cgroups of their own (root, writable v1 memory and pids hierarchies):
    decided once per process and logged, since the two regimes isolate differently."""
    try:
        _cgroup.remove_stale()  # those of crashed drivers
    except (OSError, SandboxError) as exc:
        log.warning("agent workers: could not clean up stale cgroups: %s", exc)
    try:
        _cgroup.RunCgroups(f"{os.getpid()}-agent-probe-{next(_names)}", memory_bytes=1 << 30, pids_max=1).remove()
    except (OSError, SandboxError) as exc:
        log.warning("agent workers: no cgroups (%s): process-group kills and rlimits instead "
                    "(reward/agents/pool.py says what that does not cover)", exc)
        return False
    log.info("agent workers: each in memory and pids cgroups of its own")
    return True


def _start_zygote(config: dict, python: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start the zygote (subprocess: vfork + exec of `python`, safe in a threaded driver) and wait,
    bounded, until it has loaded the agent function."""
    field = f"{config['name']}={config['spec']!r}"
    data = pickle.dumps(config)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (f"import sys; sys.path.insert(0, {_ROOT!r}); from reward.agents.pool import _zygote_main; "
            f"_zygote_main({theirs.fileno()})")
    try:
        proc = subprocess.Popen([python, "-c", code], stdin=subprocess.PIPE, pass_fds=[theirs.fileno()],
                                start_new_session=True)
    except OSError as err:
        ours.close()
        theirs.close()
        raise RewardLoadError(f"{field}: its interpreter {python!r} does not start ({err})") from None
    theirs.close()
    with suppress(BrokenPipeError), proc.stdin:
        proc.stdin.write(data)
    ours.settimeout(_LOAD_TIMEOUT_S)
    try:
        reply = ours.recv(1 << 16)
    except TimeoutError:
        reply = f"E{field}: loading it took over {_LOAD_TIMEOUT_S:g} s".encode()
    if reply == b"ready":
        ours.settimeout(_IO_TIMEOUT_S)
        return proc, ours
    proc.kill()
    proc.wait()
    ours.close()
    if reply:
        raise RewardLoadError(reply[1:].decode())
    where = "" if python == sys.executable else f" ({python})"
    raise RewardLoadError(f"{field}: the process loading it{where} exited with code {proc.returncode} "
                          "(its output is above)")


# -- the zygote and the workers (separate processes) --------------------------------------------
def _zygote_main(ctrl_fd: int) -> None:
    """Load the agent function once, then fork a worker per request and report each worker's exit.
    On EOF from the driver (close, or its death) kill everything and exit."""
    ctrl = socket.socket(fileno=ctrl_fd)
    cfg = pickle.load(sys.stdin.buffer)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.path.insert(0, os.path.abspath(cfg["base_dir"] or "."))
    try:
        fn = load_agent_function(cfg["spec"], cfg["base_dir"], cfg["kwargs"], field=cfg["name"])
    except RewardLoadError as exc:
        ctrl.send(b"E" + str(exc).encode())
        return
    _become_subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ctrl.send(b"ready")
    workers: set[int] = set()
    try:
        with suppress(BrokenPipeError, ConnectionResetError):  # the driver closed: end quietly
            _zygote_loop(ctrl, wake_r, wake_w, fn, cfg, workers)
    finally:
        for pid in workers:
            _kill(pid)
        _kill_children()


def _zygote_loop(ctrl: socket.socket, wake_r: int, wake_w: int, fn: Callable[..., Any], cfg: dict,
                 workers: set[int]) -> None:
    """Fork a worker per request, report each worker's exit, until the driver's EOF."""
    while True:
        ready = select.select([ctrl, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            for pid, status in _reap():
                if pid in workers:
                    workers.discard(pid)
                    ctrl.send(b"X %d %d" % (pid, status))
                    if cfg["fallback"]:
                        _kill_children(keep=workers)  # what the dead worker orphaned
        if ctrl in ready:
            msg, fds, _, _ = socket.recv_fds(ctrl, 16, 2)
            if not msg:
                return
            _flush_stdio()  # else each worker would print the zygote's buffered output again
            try:
                pid = os.fork()
            except OSError as exc:
                ctrl.send(f"E could not start a worker: fork failed: {exc}".encode())
                pid = -1
            if pid == 0:
                for f in (ctrl.detach(), wake_r, wake_w):
                    os.close(f)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _worker_main(*fds, fn, cfg)
            for f in fds:
                os.close(f)
            if pid > 0:
                workers.add(pid)
                ctrl.send(b"F %d" % pid)


def _worker_main(sock_fd: int, log_fd: int, fn: Callable[..., Any], cfg: dict) -> None:
    """A worker: a session of its own, its output to the driver's pipe, rlimits in the fallback;
    then one episode per message until the driver closes the socket. Never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        faulthandler.enable()  # a crash in C leaves the Python stack in the log tail
        _become_subreaper()
        sock = socket.socket(fileno=sock_fd)
        sock.set_inheritable(False)
        me, limits = os.getpid(), cfg["limits"]
        if cfg["fallback"]:
            _set_rlimits(limits)
        while True:
            try:
                base_url, row = pickle.loads(_recv_msg(sock, None))
            except EOFError:
                code = 0
                return
            for _ in _reap():  # what the driver killed after the last episode
                pass
            reply = _episode(fn, base_url, row, cfg["kwargs"], limits.max_result_bytes)
            if os.getpid() != me:  # a process the agent forked returned from it: only the worker replies
                os._exit(0)
            _flush_stdio()  # all it printed is in the pipe before its result is sent
            if cfg["fallback"]:
                _kill_children()
            _send_msg(sock, reply)
    except BaseException:  # noqa: BLE001 - our own set-up or I/O failed: say so in the log tail
        traceback.print_exc()
    finally:
        os._exit(code)


def _episode(fn: Callable[..., Any], base_url: str, row: dict, kwargs: dict, max_bytes: int) -> bytes:
    """b"V" + the pickled return value, or b"E" + why the episode failed. The size is checked
    here, so an oversized value never crosses the socket."""
    try:
        value = fn(base_url, row, **kwargs)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
    except SystemExit as exc:
        return _failure(f"called sys.exit({exc.code!r})")
    except BaseException as exc:  # noqa: BLE001 - the user's code: whatever it raises is the episode's
        traceback.print_exc()
        at = traceback.extract_tb(exc.__traceback__)[-1]
        return _failure(f"raised {type(exc).__name__}: {exc} (at {os.path.basename(at.filename)}:{at.lineno} "
                        f"in {at.name})")
    try:
        data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001
        return _failure(f"returned a {type(value).__name__} that cannot be pickled: {type(exc).__name__}: {exc}")
    if len(data) > max_bytes:
        return _failure(f"returned {len(data) / 2**20:.1f} MiB pickled, over the {max_bytes / 2**20:.1f} MiB limit")
    return b"V" + data


def _flush_stdio() -> None:
    with suppress(OSError, ValueError, AttributeError):  # closed, or None in a process started without them
        sys.stdout.flush()
        sys.stderr.flush()


def _failure(why: str) -> bytes:
    return b"E" + " ".join(why.split())[:_ERROR_CHARS].encode("utf-8", "replace")


def _send_msg(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)))
    sock.sendall(data)


def _recv_msg(sock: socket.socket, limit: int | None) -> bytes:
    """One length-prefixed message; OSError before its body is read when it is over `limit`."""
    (size,) = struct.unpack("!Q", _recv_exact(sock, 8))
    if limit is not None and size > limit:
        raise OSError(f"a {size}-byte message, over the {limit}-byte limit")
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _reap():
    """(pid, wait status) of each exited child, without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _kill(pid: int) -> None:
    """SIGKILL `pid` and, when it leads one, its process group (all of a fork bomb in it at once)."""
    for kill in (os.killpg, os.kill):
        with suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _kill_children(keep: set[int] | frozenset[int] = frozenset()) -> None:
    """SIGKILL this process's children but `keep`, and reap them, until none is left (a second at
    most). As a subreaper this process inherits what they orphan, so this ends the whole tree."""
    deadline = time.monotonic() + 1.0
    while (kids := [pid for pid in _children() if pid not in keep]) and time.monotonic() < deadline:
        for pid in kids:
            _kill(pid)
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)


def _become_subreaper() -> None:
    """Orphaned descendants reparent to this process instead of init: it can reap them and, without
    cgroups, find them to kill."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _set_rlimits(limits: AgentLimits) -> None:
    """The fallback's caps: address space past what the worker inherits from the zygote, and tasks
    past what its user runs already (RLIMIT_NPROC counts all the user's tasks; root ignores it)."""
    vm = int(_status("self").get("VmSize", "0 kB").split()[0]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + (limits.memory_mb << 20),) * 2)
    uid = str(os.getuid())
    tasks = sum(int(s.get("Threads", "1")) for s in map(_status, _pids()) if s.get("Uid", "").split()[:1] == [uid])
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks + limits.max_processes,) * 2)


def _children() -> list[int]:
    me, kids = str(os.getpid()).encode(), []
    for pid in _pids():
        with suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[1] == me:  # after "pid (comm)": state, ppid
                kids.append(int(pid))
    return kids


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def _status(pid: str) -> dict[str, str]:
    """/proc/PID/status as a dict ({} once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
