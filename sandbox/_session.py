"""A box's sandbox, kept for all of the box's commands: one bubblewrap per box, not per command.

Why: starting bubblewrap (new user/pid/net/ipc/mount namespaces, a fresh mount tree, its
teardown) costs ~4-5 ms of CPU and latency per command, as much as a test run itself; a job is
a compile, a few test runs and a benchmark run in one box. So a box starts one sandbox (the
same bubblewrap command line, as the slot uid, with the box's seccomp filter) whose PID 1 is
the helper's supervisor (sandbox._helper), and hands it each command over a socket.

What a command gets is what a fresh sandbox per command gave it:
- its own cgroups, created by the host per command; the supervisor's child joins them before
  it execs, the host enforces and reads the limits, and when the command is over the host kills
  every task in them until none is left (they cannot leave them), so nothing it started lives on
  into the next command (the supervisor, not in them, reaps the corpses as PID 1);
- its own rlimits, set by the child before it execs; stdin/stdout/stderr pipes of the host;
- an empty /tmp and /dev/shm: when a command leaves anything there (or changes their mode), the
  supervisor says so and the box starts a fresh sandbox for its next command; the rest of the
  sandbox is read-only but the work dir, which persists across a box's commands anyway;
- no System V IPC or POSIX message queues (denied by seccomp: the IPC namespace is per box).
The supervisor is out of the commands' reach: PID 1 of their pid namespace (they cannot signal
it), not dumpable (its /proc entries are closed to them), ptrace denied by seccomp, and the
fds it holds (this socket, the cgroup files) are close-on-exec.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import time

from sandbox import _bwrap, _helper, _seccomp
from sandbox._exec import Rlimit, spawn
from sandbox.backend import SandboxError

_REPLY_WAIT_S = 5.0      # after the host killed a command: how long its status may take
_CLOSE_WAIT_S = 5.0


class BoxSession:
    """The sandbox of one box: bubblewrap (as slot uid `uid`, seeing `workdir` at /box) running
    the supervisor. `run` one command at a time; `close` ends it all."""

    def __init__(self, bwrap: str, workdir: str, uid: int, tmp_bytes: int) -> None:
        helper = _helper.path()
        if helper is None:
            raise SandboxError("the sandbox helper is not available")
        self._sock, box_end = socket.socketpair(socket.AF_UNIX,
                                                socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        helper_fd = os.open(helper, os.O_RDONLY | os.O_CLOEXEC)
        sfd = _seccomp.filter_fd()
        self._info, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            # The slot uid cannot reach the helper's directory: it execs it through the fd.
            command = [f"/proc/self/fd/{helper_fd}", "supervise", str(box_end.fileno()),
                       str(helper_fd)]
            cmd = _bwrap.argv(bwrap, workdir, command, seccomp_fd=sfd, info_fd=info_w,
                              tmp_bytes=tmp_bytes, as_pid_1=True)
            self._bwrap = spawn(cmd, rlimits=[(resource.RLIMIT_CORE, 0, 0)], env=_bwrap.ENV,
                                cwd="/", uid=uid,
                                pass_fds=(sfd, helper_fd, box_end.fileno(), info_w))
        except BaseException:
            self._sock.close()
            os.close(self._info)
            raise
        finally:
            box_end.close()
            os.close(helper_fd)
            os.close(sfd)
            os.close(info_w)
        self._bwrap.close_stdin()
        self._supervisor: int | None = None
        self._uid = uid
        self.broken = False      # failed: end it (SandboxError for the command that saw it)
        self.spent = False       # a command left files in /tmp or /dev/shm: end it

    def usable(self) -> bool:
        """Neither failed nor spent, and still running: bubblewrap dies with the thread that
        started it (--die-with-parent), which may end before the box does."""
        return not (self.broken or self.spent) and self._bwrap.poll() is None

    def pids(self) -> list[int]:
        """Host pids of bubblewrap and (once known) the supervisor."""
        return [self._bwrap.pid] + ([] if self._supervisor_pid() is None else [self._supervisor])

    def _supervisor_pid(self) -> int | None:
        """The supervisor's host pid, from bubblewrap's --info-fd (once it has written it)."""
        if self._supervisor is None:
            try:
                self._supervisor = int(json.loads(os.read(self._info, 4096))["child-pid"])
            except (BlockingIOError, ValueError, KeyError):
                pass
        return self._supervisor

    def run(self, argv: list[str], rlimits: list[Rlimit], join: list[str]) -> "SessionCommand":
        """Start argv (in the work dir) after its child joined the cgroups whose `tasks` files
        are in `join` and set `rlimits`."""
        ours: list[int] = []
        theirs: list[int] = []
        try:
            for i in range(3):                     # stdin, stdout, stderr
                r, w = os.pipe2(os.O_CLOEXEC)
                ours.append(w if i == 0 else r)    # we write its stdin, read its output
                theirs.append(r if i == 0 else w)
            for path in join:
                theirs.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            message = _helper.command_message(argv, rlimits, len(theirs))
            socket.send_fds(self._sock, [message], theirs)
        except BaseException as e:
            for fd in ours:
                os.close(fd)
            if isinstance(e, OSError):
                raise self._fail(f"cannot send the command: {e}") from e
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return SessionCommand(self, argv, *ours)

    def _fail(self, why: str) -> SandboxError:
        """The session is unusable: say why (with what bubblewrap said, if it exited)."""
        self.broken = True
        detail = ""
        if self._bwrap.poll() is not None:
            try:
                os.set_blocking(self._bwrap.stderr, False)
                detail = os.read(self._bwrap.stderr, 4096).decode(errors="replace").strip()
            except (BlockingIOError, OSError):
                pass
            detail = detail or self._bwrap.close()
        return SandboxError(f"box sandbox failed: {why}" + (f" ({detail})" if detail else ""))

    def reply(self, timeout: float) -> tuple[int, int, str] | None:
        """The supervisor's reply (kind, status, message), or None if none came in `timeout`
        seconds (0: do not wait)."""
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        try:
            data = self._sock.recv(_helper.REPLY.size)
        except OSError as e:
            raise self._fail(f"cannot read the supervisor's reply: {e}") from e
        if len(data) != _helper.REPLY.size:
            raise self._fail("the supervisor is gone")
        kind, status, message = _helper.REPLY.unpack(data)
        return kind, status, message.rstrip(b"\0").decode(errors="replace")

    def finish(self) -> None:
        """After the host killed what a command left: wait until the supervisor has reaped it
        all (so no zombie of the slot uid is left either). If the command left anything in
        /tmp or /dev/shm, the session is spent: the box starts a fresh one for its next command."""
        got = self.reply(_REPLY_WAIT_S)
        if got is None or got[0] != _helper.REPLY_CLEAN:
            raise self._fail("the supervisor did not finish the command")
        if not got[1]:
            self.spent = True

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        """End the sandbox: the supervisor exits when its socket closes, then bubblewrap. If it
        does not, kill it (its pid namespace goes with it; bubblewrap, its parent, reaps it)."""
        self._sock.close()
        try:
            pid = self._supervisor_pid()
            if self._bwrap.wait(_CLOSE_WAIT_S) is None:
                if pid is not None and _parent(pid) == self._bwrap.pid:
                    os.kill(pid, signal.SIGKILL)
                if self._bwrap.wait(_CLOSE_WAIT_S) is None:
                    os.kill(self._bwrap.pid, signal.SIGKILL)
                    self._bwrap.wait()
            if pid is not None:           # bubblewrap died first (e.g. with its thread)
                reap_orphan(pid, self._uid)
        finally:
            self._bwrap.close()
            os.close(self._info)


class SessionCommand:
    """One command of a session, with the interface `sandbox._exec.supervise` drives."""

    cpu_s = 0.0        # the backend reads CPU from the command's cgroup

    def __init__(self, session: BoxSession, argv: list[str], stdin: int, stdout: int,
                 stderr: int) -> None:
        self.args = argv
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._session = session
        self.returncode: int | None = None
        self._error = ""

    def exit_fd(self) -> int:
        return self._session.fileno()

    def close_stdin(self) -> None:
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def close(self) -> str:
        self.close_stdin()
        for fd in (self.stdout, self.stderr):
            if fd >= 0:
                os.close(fd)
        self.stdout = self.stderr = -1
        return self._error

    def poll(self) -> int | None:
        return self.wait(0.0)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status, or None if still running after `timeout` seconds. Waiting forever
        is bounded: the host only waits without a timeout once it killed the command."""
        if self.returncode is None:
            got = self._session.reply(_REPLY_WAIT_S if timeout is None else timeout)
            if got is None and timeout is None:
                raise self._session._fail("no status from the supervisor")
            if got is not None:
                kind, status, message = got
                if kind == _helper.REPLY_STATUS:
                    self.returncode = os.waitstatus_to_exitcode(status)
                elif kind != _helper.REPLY_ERROR:
                    raise self._session._fail(f"unexpected reply {kind}")
                else:
                    self.returncode, self._error = 127, message or "unknown error"
                    self._session.broken = True      # start afresh rather than guess
        return self.returncode


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def reap_orphan(pid: int, uid: int, timeout: float = 5.0) -> None:
    """Reap `pid` if it is a process of `uid` orphaned to us (we are a child subreaper while a
    ProcessBackend is open): a sandbox's init whose bubblewrap exited first. Left alone it would
    linger as a zombie of the slot uid (counting against RLIMIT_NPROC)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            uid_now = os.stat(f"/proc/{pid}").st_uid
        except FileNotFoundError:
            return                        # already reaped
        if uid_now != uid or _parent(pid) != os.getpid():
            return                        # not (or no longer) our orphan: not ours to reap
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return                        # reaped elsewhere meanwhile
        if time.monotonic() > deadline:
            raise SandboxError(f"sandbox init {pid} of uid {uid} does not exit")
        time.sleep(0.001)

