"""Agent episodes (`task.agent`) in sandboxed processes that a deadline can really end: the
driver's side (the processes themselves: reward/agents/episode.py; the sandbox: jail.py).

The agent function `fn(base_url, row, **kwargs)` (reward.loader.load_agent_function) runs once per
episode, in a process of its own forked from a zygote that imported it once (so heavy imports
are paid once: a fork costs milliseconds, not the 5-10 s of torch). An agent that hangs, crashes,
floods its output, forks without end or attacks its host costs its own episode (an `AgentOutcome`
whose `error` names the cause); the other episodes go on, and the driver never waits on an agent.

Isolation (docs/environments-and-agents.md "Threat model" lists what an episode can and cannot
do, each line backed by a test): every episode has its own pid, mount, network, IPC and UTS
namespaces, a private /tmp, /dev/shm and /proc, a root file system with only the interpreter, its
packages and the agent's code, read-only (not the run directory, data, checkpoints or caches), an
unprivileged host uid of its own with no capabilities, and a seccomp filter against tracing,
namespaces and mounts. Its network is its own loopback, where its worker offers the endpoints it
may reach (the agent server, and `task.agent_endpoints`): the agent server accepts on its
listener there itself (handoff.py), the others are relayed to the pool's relay (relay.py); nothing
else on the host is reachable. Its result crosses as JSON, never as a pickle.

Limits, where root can write the v1 `memory` and `pids` cgroup hierarchies (detected once per
process, logged): each worker joins cgroups of its own (sandbox._cgroup.RunCgroups) before its
episode: memory (`memory_mb`) and pids (`max_processes`); a deadline, `cancel` and `close` kill
every task in them; a SIGKILL death with the memory cgroup's OOM counters set is named as the
memory limit. Without cgroups: RLIMIT_AS and RLIMIT_NPROC in the worker, kills by process group,
and the episode's pid namespace, which ends with its first process.

The pool survives anything an episode does: a handler that raises (anything, SystemExit
included) costs the worker it was for; a zygote that dies is started again (logged) up to
`zygote_restarts` times, its running episodes failing with the cause; past that every episode
fails naming why, which stops the run (rl/run/guards.py).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import math
import os
import pickle
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable

from reward.agents import relay
from reward.agents.episode import MAX_MESSAGE, _kill
from reward.loader import RewardLoadError
from sandbox import _cgroup
from sandbox.backend import SandboxError

log = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LOAD_TIMEOUT_S = 300.0  # the zygote's import of the agent module (torch-heavy ones take ~10 s)
_IO_TIMEOUT_S = 5.0      # one message to or from our own code in a worker or the zygote
_CLOSE_WAIT_S = 0.5
_CHUNK = 1 << 16
_ERROR_CHARS = 1000
_UID_BASE = 61000        # where the agents' host uids are looked for (the code sandbox's: 60000)
_names = itertools.count()
_SIGNAL_NAMES = {int(sig): sig.name for sig in signal.Signals}


@dataclass
class AgentLimits:
    """An episode's limits (the module docstring says how each is enforced, with cgroups or
    without: then `max_processes` is RLIMIT_NPROC)."""

    timeout_s: float              # wall clock, from when a worker gets the episode
    memory_mb: int = 2048         # the agent's process tree
    max_processes: int = 64       # tasks in the agent's process tree
    max_result_bytes: int = MAX_MESSAGE  # the JSON result
    log_tail_bytes: int = 4096    # the end of its stdout+stderr, kept for error messages
    tmp_mb: int = 256             # its private /tmp and /dev/shm (each), in memory


@dataclass
class AgentOutcome:
    value: float | None  # the episode's reward as the episode read it (None: none of its own, or error)
    error: str | None    # why the episode failed, one line naming the cause
    log_tail: str        # the end of what it printed (stdout+stderr)
    seconds: float       # wall time of the episode


@dataclass(eq=False)
class _Job:
    id: Hashable
    payload: bytes      # pickled (base_url, row): driver -> episode only
    started: float      # when queued, then when a worker got it
    cancelled: bool = False


@dataclass(eq=False)
class _Worker:
    """A worker as the driver sees it: pending until the zygote reports its pid (`zpid`, in the
    zygote's pid namespace) and it says hello (`pid`, its host pid, from the hello's credentials),
    then idle or running `job`; `doomed` once killed, until the zygote reports its exit."""

    sock: socket.socket
    log_fd: int                   # the read end of its stdout+stderr
    zpid: int | None = None
    pid: int | None = None
    cg: _cgroup.RunCgroups | None = None
    job: _Job | None = None
    doomed: bool = False
    tail: bytes = b""
    inbox: bytearray = field(default_factory=bytearray)  # its reply so far

    def hello(self) -> bool:
        """Its first byte, with the credentials the kernel attached: its host pid (it lives in the
        zygote's pid namespace). False for anything else."""
        data, anc, _, _ = self.sock.recvmsg(1, socket.CMSG_SPACE(struct.calcsize("3i")), socket.MSG_DONTWAIT)
        creds = [struct.unpack("3i", d[:12]) for lvl, kind, d in anc
                 if lvl == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
        if data != b"H" or not creds:
            return False
        self.pid = creds[0][0]
        return True

    def receive(self, limit: int) -> bytes | int | None:
        """Its length-prefixed reply as it comes, never waiting: the message once whole, None while
        it is not, b"" at the end of its stream, or the announced size when over `limit` (checked
        from the header: an oversized one is never allocated)."""
        try:
            chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:
            return b""
        self.inbox += chunk
        if len(self.inbox) < 8:
            return None
        (size,) = struct.unpack("!Q", self.inbox[:8])
        if size > limit:
            return size
        if len(self.inbox) < 8 + size:
            return None
        msg, self.inbox = bytes(self.inbox[8:8 + size]), bytearray()
        return msg

    def admit(self, limits: AgentLimits | None) -> str | None:
        """Into its cgroups (with `limits`; None: no cgroups), then told to go on: it makes its
        episode's sandbox and process, ready for a job. Why it could not be, else None."""
        if limits is not None:
            try:
                self.join_cgroups(limits)
            except (OSError, SandboxError) as exc:
                return f"could not put a worker in its cgroups: {exc}"
        with suppress(OSError):  # it died meanwhile: its exit report says so
            self.sock.sendall(b"G")
        return None

    def join_cgroups(self, limits: AgentLimits) -> None:
        """Its own memory and pids cgroups, by its host pid, before it gets a job."""
        self.cg = _cgroup.RunCgroups(f"{os.getpid()}-agent-{next(_names)}", pids_max=limits.max_processes,
                                     memory_bytes=limits.memory_mb << 20)
        for path in self.cg.paths.values():
            _cgroup._write(os.path.join(path, "cgroup.procs"), str(self.pid))

    def kill(self) -> _Job | None:
        """SIGKILL its tree now: its process group at once (its episode dies with it: a parent-death
        signal, and the end of its pid namespace), then with cgroups every task in them. Returns its
        job, if any, for the caller to report; the zygote reports its exit."""
        job, self.doomed, self.job = self.job, True, None
        if self.pid is not None:
            _kill(self.pid)
        if self.cg is not None:
            try:
                self.cg.kill_all()
            except SandboxError as exc:
                log.warning("agent worker %s: %s", self.pid, exc)
        return job

    def read_output(self, keep: int) -> bool | None:
        """Keep the last `keep` bytes of what its tree prints: the pipe is read as it fills, so a
        flood costs the driver CPU time, not memory. False when nothing more is there now, None at
        the end of its output."""
        try:
            data = os.read(self.log_fd, _CHUNK)
        except BlockingIOError:
            return False
        if not data:
            return None
        self.tail = (self.tail + data)[-keep:] if keep else b""
        return True

    def drain_output(self, keep: int) -> None:
        for _ in range(64):  # what is in the pipe now, bounded: a writer left alive may never stop
            if not self.read_output(keep):
                return

    def death(self, status: int, limits: AgentLimits, name: str) -> str:
        """Why it (or its episode) ended without a result, from a wait status."""
        if os.WIFEXITED(status):
            return f"exited with code {os.WEXITSTATUS(status)} before returning"
        sig = os.WTERMSIG(status)
        if sig == signal.SIGKILL and self.cg is not None:
            usage = self.cg.usage()
            if usage.oom_kills or usage.memory_failcnt:
                return f"was killed at its memory limit, {name}_memory_mb={limits.memory_mb}"
        return f"was killed by signal {_SIGNAL_NAMES.get(sig, sig)}"

    def close(self) -> None:
        """Its fds, and its cgroups with anything still in them."""
        self.sock.close()
        with suppress(OSError):
            os.close(self.log_fd)
        if self.cg is not None:
            try:
                self.cg.kill_all()
                self.cg.remove()
            except SandboxError as exc:
                log.warning("agent worker %s: %s", self.pid, exc)


class _Waker:
    """A pipe that wakes the monitor's select from another thread."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        with suppress(BlockingIOError, OSError):
            os.write(self.w, b"x")

    def drain(self) -> None:
        with suppress(BlockingIOError):
            os.read(self.r, 4096)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class _Sandbox:
    """What the pool keeps for its episodes' sandbox: the zygote's config, the relay from the
    episodes' endpoints to the real ones (and its socket folder), the two host uids claimed."""

    def __init__(self, spec: str, base_dir: str, workers: int, limits: AgentLimits, kwargs: dict, name: str,
                 endpoints: list[tuple], hidden: list[str], reward_bound: float, cgroups: bool):
        privileged = os.geteuid() == 0
        # (host, port) or (host, port, a Unix socket taking listeners: the agent server's, which then
        # accepts in each episode's network itself: reward/agents/handoff.py)
        addresses = [(e[0], _address(e[0], name), e[1]) for e in endpoints]
        direct = [e[2] if len(e) > 2 else None for e in endpoints]
        self.uids = None
        if privileged:
            from sandbox.process import _SlotLocks  # the code sandbox's allocator: no uid is shared

            self.uids = _SlotLocks(_UID_BASE, 2)
        self.relay_dir = tempfile.mkdtemp(prefix="rlpost-agents-relay-")
        os.chmod(self.relay_dir, 0o755)
        paths = [d or os.path.join(self.relay_dir, f"{i}.sock") for i, d in enumerate(direct)]
        self.relay = relay.Relay([(relay.unix_listener(path), relay.tcp_connector(ip, port))
                                  for path, d, (_, ip, port) in zip(paths, direct, addresses) if d is None],
                                 max_connections=(workers + 1) * relay.EPISODE_CONNECTIONS).start("agent-relay")
        code_dirs = [_ROOT, os.path.abspath(base_dir or ".")]
        file_part = spec.rpartition(":")[0]
        if file_part.endswith(".py"):
            code_dirs.append(os.path.dirname(os.path.abspath(os.path.join(base_dir or ".", file_part))))
        ids = self.uids.uids if self.uids else None
        self.config = dict(
            spec=spec, base_dir=base_dir, kwargs=dict(kwargs or {}), name=name, limits=asdict(limits),
            fallback=not cgroups, privileged=privileged, uids=ids, gids=ids, code_dirs=code_dirs,
            visible=[self.relay_dir, *{os.path.dirname(d) for d in direct if d}],
            hidden=[os.path.realpath(h) for h in hidden],
            endpoints=[(host, ip, port, path, d is not None) for (host, ip, port), path, d in zip(addresses, paths, direct)],
            seccomp=_seccomp_filter(), reward_bound=float(reward_bound))

    def release(self) -> None:
        self.relay.close()
        shutil.rmtree(self.relay_dir, ignore_errors=True)
        if self.uids is not None:
            self.uids.release()


class AgentPool:
    """Runs `fn(base_url, row, **kwargs)` episodes in sandboxed processes under `limits`; outcomes
    come back through `results`. Job ids must be unique among the jobs not yet reported."""

    def __init__(self, spec: str, base_dir: str, workers: int, limits: AgentLimits,
                 kwargs: dict | None = None, name: str = "task.agent", python: str | None = None,
                 endpoints: list[tuple] = (), hidden: list[str] = (), reward_bound: float = 1e6,
                 zygote_restarts: int = 3):
        """Waits (up to _LOAD_TIMEOUT_S) for the zygote to load the function: a bad spec or signature
        raises RewardLoadError here. `python`: the zygote's interpreter (None: this one; it imports
        only reward.agents.episode's standard-library closure of ours); `endpoints`: the (host,
        port[, the Unix socket taking a server's listeners: handoff.py]) addresses episodes may
        reach (names resolved here, once); `hidden`: folders kept out of sight among the agent's
        code (run.dir); `reward_bound`: task.agent_reward_bound."""
        self.size, self.limits, self.name = workers, limits, name
        self.zygote_restarts, self.restarts = zygote_restarts, 0
        self._python = python or sys.executable
        self._cgroups = _cgroups_usable()
        self._sandbox = _Sandbox(spec, base_dir, workers, limits, kwargs, name, endpoints, hidden, reward_bound,
                                 self._cgroups)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[Hashable, _Job] = {}
        self._workers: list[_Worker] = []
        self._done: list[tuple[Hashable, AgentOutcome]] = []
        self._out_of_service: str | None = None
        self._closed = False
        self._restart_why: str | None = None
        # on_end(job id, when its agent returned or None) as a job finishes, before `results` has it: the
        # agent server ends the episode there, so no call of its agent lands after (issues 47, 58)
        self.on_end: Callable[[Hashable, float | None], None] | None = None
        try:
            self._zygote = _Zygote.start(self._sandbox.config, self._python)
        except BaseException:
            self._sandbox.release()
            raise
        self._waker = _Waker()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._waker.r, selectors.EVENT_READ, self._waker.drain)
        self._sel.register(self._zygote.ctrl, selectors.EVENT_READ, self._on_zygote)
        self._thread = threading.Thread(target=self._monitor, name="agent-monitor", daemon=True)
        self._thread.start()

    # -- the public face: any thread --------------------------------------------------------
    def start(self, job_id: Hashable, base_url: str, row: dict) -> None:
        """Queue an episode; the monitor thread hands it to a worker when one is free. The row is
        pickled here (driver -> episode), so one that cannot be raises here."""
        job = _Job(job_id, pickle.dumps((base_url, row), pickle.HIGHEST_PROTOCOL), time.monotonic())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: AgentPool.start after close")
            if self._out_of_service:
                self._finish(job, error=self._out_of_service)
                return
            self._jobs[job_id] = job
            self._queue.append(job)
        self._waker.wake()

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
        self._waker.wake()

    def running(self) -> int:
        with self._cond:
            return sum(1 for w in self._workers if w.job is not None and not w.job.cancelled)

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def out_of_service(self) -> str | None:
        """Why no episode can run any more (None while they can)."""
        return self._out_of_service

    def close(self) -> None:
        """Kill every worker's tree and the zygote. Never waits on an agent: killing takes
        milliseconds; the waits below are for our own processes, bounded."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                w.kill()
        self._waker.wake()
        self._thread.join(_CLOSE_WAIT_S)
        self._zygote.stop()
        if not self._thread.is_alive():  # else it may still use the fds: the process exit closes them
            for w in list(self._workers):
                self._discard(w)
            self._sel.close()
            self._waker.close()
        self._sandbox.release()

    # -- the monitor thread -----------------------------------------------------------------
    def _monitor(self) -> None:
        """The one thread that talks to the zygote and the workers: it reads results and output as
        they come, hands queued jobs out, and kills what is past its deadline or cancelled. Nothing
        a handler raises ends it (issue 58: an episode's SystemExit once did, silently)."""
        failures = 0
        while True:
            try:
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
                            self._handle(key.data)
                    self._kill_overdue()
                    if self._restart_why is None:
                        self._dispatch()
                if self._restart_why is not None:
                    self._restart_zygote()
                failures = 0
            except BaseException as exc:  # noqa: BLE001 - a bug here must fail the jobs, not hang them
                failures += 1
                log.exception("%s: agent pool monitor failed (%d in a row)", self.name, failures)
                if failures >= 10:
                    with self._cond:
                        self._break(f"pool failed: {type(exc).__name__}: {exc}")
                    return

    def _handle(self, handler: Callable[[], Any]) -> None:
        """Run one event's handler; whatever it raises costs the worker it was for (its job fails
        naming the error), never the monitor."""
        try:
            handler()
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
            log.exception("%s: handling an event failed", self.name)
            w = handler.args[0] if isinstance(handler, functools.partial) and handler.args else None
            if isinstance(w, _Worker):
                if (job := w.kill()) is not None:
                    self._finish(job, error=f"its result could not be handled: {type(exc).__name__}: {exc}")

    def _on_zygote(self) -> None:
        """The zygote's reports: "F pid" (forked), "E why" (could not fork), "X pid status" (exited)."""
        try:
            msg = self._zygote.ctrl.recv(4096)
        except OSError:
            msg = b""
        if not msg:
            self._unregister(self._zygote.ctrl)
            self._restart_why = f"its zygote process exited (launcher pid {self._zygote.pid})"
            return
        kind, _, rest = msg.decode().partition(" ")
        if kind == "F":
            next(w for w in self._workers if w.zpid is None).zpid = int(rest)
        elif kind == "E":
            self._discard(next(w for w in self._workers if w.zpid is None))
            self._fail_queued(rest)
        else:
            pid, status = map(int, rest.split())
            self._exited(pid, status)

    def _restart_zygote(self) -> None:
        """The zygote died (its workers with it: they were in its pid namespace): their episodes fail
        naming it, and a new zygote starts (without the pool's lock: loading takes seconds), up to
        `zygote_restarts` times; after that the pool is out of service and every episode fails saying so."""
        why = self._restart_why
        with self._cond:
            self._end_workers(f"could not finish: {why}")
            if self.restarts >= self.zygote_restarts:
                self._break(f"could not run: {why}; it was started again {self.restarts} time(s), the most the pool "
                            "does")
                self._restart_why = None
                return
            self.restarts += 1
        log.warning("%s: %s; starting it again (%d of at most %d)", self.name, why, self.restarts, self.zygote_restarts)
        self._zygote.stop()
        try:
            zygote = _Zygote.start(self._sandbox.config, self._python)
        except BaseException as exc:  # noqa: BLE001
            with self._cond:
                self._break(f"could not run: {why}, and starting it again failed: {exc}")
                self._restart_why = None
            return
        with self._cond:
            self._zygote, self._restart_why = zygote, None
            self._sel.register(self._zygote.ctrl, selectors.EVENT_READ, self._on_zygote)

    def _spawn(self) -> None:
        """A new worker, pending: the zygote answers with its pid, the worker with a hello."""
        w = self._zygote.spawn()
        self._workers.append(w)
        self._sel.register(w.sock, selectors.EVENT_READ, functools.partial(self._on_result, w))
        self._sel.register(w.log_fd, selectors.EVENT_READ, functools.partial(self._read_output, w))

    def _hello(self, w: _Worker) -> None:
        """A new worker's first byte: its host pid from the credentials the kernel attached; then it
        goes in its cgroups and is told to go on (it forks its episode only then, so the episode is
        counted there from its first page), and is idle."""
        if not w.hello():
            w.kill()
        elif (why := w.admit(self.limits if self._cgroups else None)) is not None:
            w.kill()
            self._fail_queued(why)

    def _dispatch(self) -> None:
        """Hand queued jobs to idle workers; ask for more workers (up to `workers`) for the rest."""
        idle = [w for w in self._workers if w.pid is not None and w.job is None and not w.doomed]
        while self._queue and idle:
            w, job = idle.pop(), self._queue.popleft()
            job.started, w.job, w.tail = time.monotonic(), job, b""
            with suppress(OSError):  # it died meanwhile: its exit report ends the job
                w.sock.sendall(struct.pack("!Q", len(job.payload)) + job.payload)
        live = [w for w in self._workers if not w.doomed]
        pending = sum(1 for w in live if w.pid is None)
        for _ in range(min(len(self._queue) - pending, self.size - len(live))):
            self._spawn()

    def _on_result(self, w: _Worker) -> None:
        """A worker's hello, then its one reply: a length-prefixed JSON object, read as it comes,
        never waiting (the monitor holds the pool's lock here); its size is checked from its header,
        so an oversized one is never allocated. Parsed as data: nothing is unpickled."""
        if w.doomed:
            self._unregister(w.sock)
            return
        if w.pid is None:
            self._hello(w)
            return
        msg = w.receive(self.limits.max_result_bytes)
        if msg is None:  # not all there yet
            return
        if msg == b"":  # it is dying: its exit report says why
            self._unregister(w.sock)
            return
        if isinstance(msg, int):  # the stream is unusable
            if (job := w.kill()) is not None:
                self._finish(job, error=f"sent an unreadable result (a {msg}-byte message, over the "
                                        f"{self.limits.max_result_bytes}-byte limit): killed")
            return
        job = w.kill()  # retired: the next episode gets a fresh fork of the zygote
        if job is None:
            return
        w.drain_output(self.limits.log_tail_bytes)
        value, error, at = parse_reply(msg)
        if isinstance(error, int):  # its episode died without a result: this wait status
            error = w.death(error, self.limits, self.name)
        self._finish(job, value, error, w.tail, at)

    def _read_output(self, w: _Worker) -> None:
        if w.read_output(self.limits.log_tail_bytes) is None:
            self._unregister(w.log_fd)

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.job is not None and w.job.cancelled:
                w.kill()
            elif w.job is not None and now - w.job.started >= self.limits.timeout_s:
                job = w.kill()
                w.drain_output(self.limits.log_tail_bytes)
                self._finish(job, error=f"did not return within {self.name}_timeout_s="
                                        f"{self.limits.timeout_s:g} s: killed", tail=w.tail)

    def _exited(self, zpid: int, status: int) -> None:
        w = next((w for w in self._workers if w.zpid == zpid), None)
        if w is None:
            return
        for _ in range(4):  # a worker exits right after sending its result: read that before its exit
            if w.job is None or w.pid is None or w.doomed:
                break
            self._on_result(w)
        if w.job is not None:  # died during its episode (a killed worker has no job any more)
            w.drain_output(self.limits.log_tail_bytes)
            self._finish(w.job, error=w.death(status, self.limits, self.name), tail=w.tail)
        self._discard(w)

    def _discard(self, w: _Worker) -> None:
        """Forget an exited worker: its fds, and its cgroups with anything still in them."""
        self._unregister(w.sock)
        self._unregister(w.log_fd)
        w.close()
        if w in self._workers:
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
        self._out_of_service = reason
        log.error("%s: %s; every episode from now on fails", self.name, reason)
        self._unregister(self._zygote.ctrl)
        self._end_workers(reason)
        while self._queue:
            self._finish(self._queue.popleft(), error=reason)

    def _end_workers(self, error: str) -> None:
        """Kill and forget every worker; the jobs they ran fail with `error`."""
        for w in list(self._workers):
            if (job := w.kill()) is not None:
                self._finish(job, error=error)
            self._discard(w)

    def _finish(self, job: _Job, value: float | None = None, error: str | None = None, tail: bytes = b"",
                at: float | None = None) -> None:
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]
        if self.on_end is not None:
            try:
                self.on_end(job.id, at)
            except Exception:  # noqa: BLE001 - the outcome must still be reported
                log.exception("%s: ending episode %r failed", self.name, job.id)
        if job.cancelled:
            return
        self._done.append((job.id, AgentOutcome(value, None if error is None else f"{self.name} {error}",
                                                tail.decode("utf-8", "replace"), time.monotonic() - job.started)))
        self._cond.notify_all()


def parse_reply(msg: bytes) -> tuple[float | None, str | int | None, float | None]:
    """A worker's JSON reply as (reward, error, when the agent returned): {"reward": number or null,
    "at": t}, {"error": text, "at": t}, or {"died": wait status} (the error is then that int);
    anything else is the episode's error. Read as data: every field's type is checked."""
    try:
        reply = json.loads(msg)
    except (ValueError, UnicodeDecodeError):
        return None, "sent a result that is not JSON", None
    if not isinstance(reply, dict):
        return None, "sent a result of the wrong shape", None
    at = reply.pop("at", None)
    at = float(at) if type(at) in (int, float) and math.isfinite(at) else None
    if len(reply) == 1:
        (kind, value), = reply.items()
        if kind == "reward" and (value is None or (type(value) in (int, float) and math.isfinite(value))):
            return (None if value is None else float(value)), None, at
        if kind == "error" and isinstance(value, str):
            return None, value[:_ERROR_CHARS], at
        if kind == "died" and type(value) is int:
            return None, value, at
    return None, "sent a result of the wrong shape", at


def _address(host: str, field: str) -> str:
    """An endpoint's IPv4 address (a name resolved once, here; 0.0.0.0, a server on every interface,
    is reached at 127.0.0.1)."""
    if host in ("0.0.0.0", "localhost", ""):
        return "127.0.0.1"
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError as err:
        raise RewardLoadError(f"{field}: an endpoint's host {host!r} does not resolve to an IPv4 address ({err}); "
                              "check task.agent_endpoints / task.agent_host") from None


@functools.lru_cache(maxsize=None)
def _cgroups_usable() -> bool:
    """Whether workers get cgroups of their own (root, writable v1 memory and pids hierarchies):
    decided once per process and logged, since the two regimes limit differently."""
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


@functools.lru_cache(maxsize=1)
def _seccomp_filter() -> bytes | None:
    """The code sandbox's seccomp filter with network sockets allowed (an agent talks HTTP on its
    loopback); None, logged, where libseccomp is missing."""
    try:
        from sandbox._seccomp import filter_bpf
        return filter_bpf(unix_only=False)
    except (ImportError, OSError) as exc:
        log.warning("agent episodes: no seccomp filter (%s): namespaces and the dropped capabilities remain", exc)
        return None


@dataclass
class _Zygote:
    """The launcher process (whose child is the zygote: it dies with it) and the zygote's control
    socket: "F" asks it for a worker; it reports "F pid", "E why", "X pid status"."""

    proc: subprocess.Popen
    ctrl: socket.socket

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, config: dict, python: str) -> _Zygote:
        return cls(*_start_zygote(config, python))

    def spawn(self) -> _Worker:
        """Ask for a worker, handing the zygote the worker's end of a socket and of a pipe for its
        output; the worker as the driver sees it, pending."""
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the hello's credentials: its host pid
        log_r, log_w = os.pipe()
        try:
            socket.send_fds(self.ctrl, [b"F"], [theirs.fileno(), log_w])
        finally:
            theirs.close()
            os.close(log_w)
        os.set_blocking(log_r, False)
        ours.settimeout(_IO_TIMEOUT_S)
        return _Worker(ours, log_r)

    def stop(self) -> None:
        """EOF on its socket (the zygote kills what is left and exits; its pid namespace ends), then
        the launcher, waited for within bounds."""
        with suppress(OSError):
            self.ctrl.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(_CLOSE_WAIT_S)
        self.ctrl.close()


def _start_zygote(config: dict, python: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start the launcher (subprocess: vfork + exec of `python`, safe in a threaded driver), which
    starts the zygote in its sandbox; wait, bounded, until the zygote has loaded the agent function."""
    field = f"{config['name']}={config['spec']!r}"
    data = pickle.dumps(config)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (f"import sys; sys.path.insert(0, {_ROOT!r}); from reward.agents.episode import launcher_main; "
            f"launcher_main({theirs.fileno()})")
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
