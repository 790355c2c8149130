"""Spawning and supervising one command: rlimits, capped output, wall/CPU deadlines.

Shared by the process backend (which wraps the command in bubblewrap inside per-run cgroups)
and the unsafe local backend (a bare subprocess): both differ only in how the child is set up,
how its CPU time is read and how everything it started is killed, which they pass in here.
`spawn` starts commands through the trusted launcher (sandbox._helper) so that `subprocess` can
vfork, however large the calling process; without it, through a `preexec_fn`.
"""

from __future__ import annotations

import math
import os
import resource
import select
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from sandbox import _helper
from sandbox.backend import SandboxError
from sandbox.job import ExecOutcome, Limits

Rlimit = tuple[int, int, int]   # (resource, soft, hard)

_CHUNK = 1 << 16
_MIB = 1 << 20
_TICK_S = 0.05          # how often deadlines and CPU usage are checked while nothing happens
_DRAIN_S = 0.5          # after the main process ended: how long to wait for its pipes' EOF
_KILL_GRACE_S = 2.0     # after a kill: how long to wait for pipe EOF once the main process is gone


def rlimits(limits: Limits, *, address_space: int, nproc: int | None) -> list[Rlimit]:
    """The rlimits every command runs under.

    CPU: soft < hard so the program first gets SIGXCPU (catchable, reported as a timeout), then
    SIGKILL. The limit is per process; the total over all processes is enforced by the
    supervisor's `cpu_used` callback. `address_space` is chosen by the backend (see there).
    NPROC counts tasks of the real uid; None leaves it as it is (e.g. for root, where it is not
    enforced anyway).
    """
    cpu = max(1, math.ceil(limits.cpu_s))
    out = [
        (resource.RLIMIT_AS, address_space, address_space),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if nproc is not None:
        out.append((resource.RLIMIT_NPROC, nproc, nproc))
    return out


def address_space(limits: Limits) -> int:
    """RLIMIT_AS: generous on purpose. The memory cgroup (process backend) is the real cap: it
    counts resident memory, swap included, of every process, and its kills are reported as
    memory_exceeded. AS only stops absurd reservations early: valgrind, glibc's per-thread
    malloc arenas and thread stacks reserve far more address space than they touch. So
    AS = 2 x memory + 1 GiB (1.5 GiB for the default 256 MB)."""
    return 2 * limits.memory_mb * _MIB + 1024 * _MIB


def spawn(argv: list[str], *, rlimits: Sequence[Rlimit], env: dict[str, str], cwd: str,
          uid: int | None = None, join: Sequence[str] = (), pass_fds: Sequence[int] = ()) -> "Child":
    """Start argv with stdin/stdout/stderr pipes in a new session, after (in this order) moving
    it into the v1 cgroups whose `tasks` files are in `join`, switching to `uid` (gid = uid, no
    supplementary groups) and setting `rlimits`. A set-up failure surfaces as a SandboxError
    from `supervise`."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                 cwd=cwd, start_new_session=True)
    try:
        if _helper.path() is not None:
            cmd = _helper.launch_argv(argv, error_fd=err_w, join=list(join), uid=uid,
                                      rlimits=list(rlimits))
            proc = subprocess.Popen(cmd, pass_fds=(*pass_fds, err_w), **pipes)
        else:
            ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
            fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in join]
            try:
                proc = subprocess.Popen(argv, pass_fds=pass_fds, **ids, **pipes,
                                        preexec_fn=child_setup(rlimits, fds))
            finally:
                for fd in fds:
                    os.close(fd)
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
    return Child(proc, err_r)


def child_setup(limits: Sequence[Rlimit], join_fds: Sequence[int] = ()) -> Callable[[], None]:
    """The preexec_fn `spawn` falls back to: join the cgroups whose `tasks` files the parent
    opened (writing "0" moves the writing thread, see sandbox._helper for why not
    `cgroup.procs`), then set the rlimits. Runs between fork and exec (after the uid switch),
    so it only makes plain system calls (no imports, no locks)."""
    lims = list(limits)
    fds = list(join_fds)

    def setup() -> None:
        for fd in fds:
            os.write(fd, b"0")
        for res, soft, hard in lims:
            resource.setrlimit(res, (soft, hard))

    return setup


class Child:
    """A command started by `spawn`. `supervise` drives anything with this interface (a box
    session's commands too, see sandbox._session): `args`; the host ends of the command's pipes
    as fds (`stdin`, `stdout`, `stderr`); `exit_fd()`, readable once the main process has ended;
    `poll`, `wait`, `returncode`; `cpu_s`; `close_stdin()`; and `close()`, which closes what it
    holds and says why the command could not be started ("" if it was).

    This one is reaped with wait4 so its rusage (CPU of it and of the children it waited for) is
    kept: the only CPU figure a backend without cgroups has. `error_fd`: the read end of the
    launcher's error pipe."""

    def __init__(self, proc: subprocess.Popen, error_fd: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.args = proc.args
        self.pid = proc.pid
        self.cpu_s = 0.0
        self.stdin, self.stdout, self.stderr = (proc.stdin.fileno(), proc.stdout.fileno(),
                                                proc.stderr.fileno())
        self._error_fd = error_fd
        self._pidfd = -1

    def exit_fd(self) -> int:
        if self._pidfd < 0:
            self._pidfd = os.pidfd_open(self.pid)
        return self._pidfd

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def close(self) -> str:
        """Close the pipes and the pidfd; what the launcher reported before it could exec the
        command ("" if it did; only meaningful once the command has been reaped)."""
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._error_fd < 0:
            return ""
        try:
            os.set_blocking(self._error_fd, False)
            try:
                return os.read(self._error_fd, 4096).decode(errors="replace").strip()
            except BlockingIOError:
                return ""
        finally:
            os.close(self._error_fd)
            self._error_fd = -1

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        if self.proc.returncode is None:
            pid, status, ru = os.wait4(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_s = ru.ru_utime + ru.ru_stime
        return self.proc.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status, or None if still running after `timeout` seconds (None: forever)."""
        if self.proc.returncode is None and timeout is None:
            _, status, ru = os.wait4(self.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_s = ru.ru_utime + ru.ru_stime
        if self.poll() is None and timeout:
            select.select([self.exit_fd()], [], [], timeout)
        return self.poll()


@dataclass
class Captured:
    """What the supervisor saw of one command (backends add their own accounting)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float = 0.0            # rusage of the main process and the children it waited for
    wall_timeout: bool = False
    cpu_timeout: bool = False
    output_exceeded: bool = False
    tasks_exceeded: bool = False


def supervise(child: "Child", stdin: bytes, limits: Limits, *,
              kill: Callable[[], None], cpu_used: Callable[[], float] | None = None,
              tasks_exceeded: Callable[[], bool] | None = None,
              started: float | None = None) -> Captured:
    """Feed stdin, collect stdout/stderr (each capped at limits.output_bytes) and enforce the
    wall and total-CPU limits until the command is over, then reap it.

    `kill` must end everything the command started; it is called at most once, as soon as a
    limit is exceeded, or when the main process has exited but something it left behind still
    holds its output pipes open (after _DRAIN_S). `cpu_used` (total CPU seconds so far) and
    `tasks_exceeded` (a fork failed on the task cap: a fork bomb spins until killed) are polled
    every _TICK_S. `child`: see Child; supervise closes it.
    """
    t0 = time.monotonic() if started is None else started
    deadline = t0 + limits.wall_s
    cap = limits.output_bytes
    in_fd, out_fd, err_fd = child.stdin, child.stdout, child.stderr
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    res = Captured(returncode=0, stdout=b"", stderr=b"", wall_s=0.0)
    killed_at: float | None = None
    exited_at: float | None = None
    checked_at = t0
    pending = memoryview(stdin)
    sel = selectors.DefaultSelector()
    try:
        exit_fd = child.exit_fd()         # readable once the main process has exited
        sel.register(exit_fd, selectors.EVENT_READ)
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            child.close_stdin()

        def stop() -> None:
            nonlocal killed_at
            if killed_at is None:
                killed_at = time.monotonic()
                kill()

        while sel.get_map():      # until the process has exited and its pipes are closed
            now = time.monotonic()
            if child.returncode is not None and exited_at is None:
                exited_at = now
            if killed_at is None:
                if now >= deadline:
                    res.wall_timeout = True
                    stop()
                elif now - checked_at >= _TICK_S and _over(cpu_used, tasks_exceeded, limits, res):
                    stop()
                elif exited_at is not None and now - exited_at > _DRAIN_S:
                    stop()    # a leftover process holds the pipes: end it
            elif now - killed_at > _KILL_GRACE_S:
                if child.poll() is None:
                    raise SandboxError(f"command {child.args!r} survived its kill")
                break         # something out of kill()'s reach holds a pipe (unsafe backend only)
            if now - checked_at >= _TICK_S:
                checked_at = now
            timeout = _TICK_S if killed_at is not None else min(_TICK_S, max(0.0, deadline - now))
            for key, _ in sel.select(timeout):
                fd = key.fd
                if fd == exit_fd:
                    if child.poll() is not None:
                        sel.unregister(fd)
                    continue
                if fd == in_fd:
                    try:
                        n = os.write(fd, pending[:_CHUNK])
                    except BrokenPipeError:
                        n = len(pending)       # the program stopped reading: drop the rest
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(fd)
                        child.close_stdin()
                    continue
                data = os.read(fd, _CHUNK)
                if not data:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                buf += data
                if len(buf) > cap:
                    del buf[cap:]
                    res.output_exceeded = True
                    stop()
    finally:
        sel.close()
        error = child.close()             # the command was reaped: its launcher is done
    if error:
        raise SandboxError(f"could not start the command: {error}")
    rc = child.wait()
    assert rc is not None
    res.returncode = rc
    res.wall_s = time.monotonic() - t0
    res.cpu_s = child.cpu_s
    res.stdout = bytes(bufs[out_fd])
    res.stderr = bytes(bufs[err_fd])
    return res


def _over(cpu_used: Callable[[], float] | None, tasks_exceeded: Callable[[], bool] | None,
          limits: Limits, res: Captured) -> bool:
    """Check the polled limits, recording which one was exceeded."""
    if cpu_used is not None and cpu_used() > limits.cpu_s:
        res.cpu_timeout = True
    elif tasks_exceeded is not None and tasks_exceeded():
        res.tasks_exceeded = True
    return res.cpu_timeout or res.tasks_exceeded


def path_parts(name: str) -> list[str]:
    """The components of a file name in a box: relative, no '.', '..' or empty parts (the
    trusted side never names anything outside the work dir)."""
    parts = name.split("/")
    if name.startswith("/") or not name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a plain relative path in the box: {name!r}")
    return parts


def file_limit_hit(workdir: str, file_bytes: int, since: float) -> bool:
    """Did the run hit the file-size limit or fill the work dir? A file changed since `since`
    (time.time()) reached file_bytes (a program ignoring SIGXFSZ, as Python does, only sees
    EFBIG), or no space or inodes are left. Walks without following symlinks."""
    st = os.statvfs(workdir)
    if st.f_bavail == 0 or st.f_favail == 0:
        return True
    stack = [workdir]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    s = entry.stat(follow_symlinks=False)
                    if s.st_size >= file_bytes and s.st_mtime >= since - 1:
                        return True
    return False


def outcome(cap: Captured, exit_code: int | None, sig: int | None, cpu_s: float, limits: Limits,
            workdir: str, started: float, *, memory_exceeded: bool = False,
            process_limit_hit: bool = False, violation: str = "") -> ExecOutcome:
    """The ExecOutcome of a supervised command, judged the same way by both backends: timed out
    when a deadline fired or the kernel ended it for CPU time (SIGXCPU at the soft limit, SIGKILL
    at the hard one, told from other kills by the CPU time used); output exceeded when the pipes
    were over the cap, on SIGXFSZ, or when file_limit_hit. The keyword fields are the ones only
    the backend can tell."""
    return ExecOutcome(
        exit_code=exit_code,
        signal=sig,
        stdout=cap.stdout,
        stderr=cap.stderr,
        wall_s=cap.wall_s,
        cpu_s=cpu_s,
        timed_out=(cap.wall_timeout or cap.cpu_timeout or sig == signal.SIGXCPU
                   or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s)),
        memory_exceeded=memory_exceeded,
        output_exceeded=(cap.output_exceeded or sig == signal.SIGXFSZ
                         or file_limit_hit(workdir, limits.file_bytes, started)),
        process_limit_hit=process_limit_hit,
        violation=violation,
    )
