"""The default sandbox backend: bubblewrap + per-run cgroups + rlimits + seccomp, no daemon.

Layers, outermost first, for every command a box runs:
- a slot uid (uid_base + n, used by nothing else: no passwd entry, no process, and an flock held
  by the owning backend) that the trusted launcher (sandbox._helper) switches to before
  exec'ing bwrap, so nothing the program does is done as root, and files it writes belong to
  that uid;
- fresh cgroups per command: v1 `memory` (+ swap) caps memory, `pids` caps tasks, `cpuacct`
  measures CPU of everything the command ran; killing what `pids` lists ends it all at the end;
- rlimits (CPU with soft < hard, FSIZE, NOFILE, NPROC, CORE=0 and a generous AS, see
  `sandbox._exec.address_space`);
- bubblewrap: new user/pid/net/ipc/uts/cgroup namespaces, all capabilities dropped, only /usr and
  the box's tmpfs work dir visible (see sandbox._bwrap); kill(-1, ...) inside reaches nothing
  outside it;
- a seccomp filter (sandbox._seccomp): no sockets but AF_UNIX, no ptrace/mount/unshare/bpf/...

One bubblewrap serves all the commands of a box (sandbox._session): its PID 1 is the helper's
supervisor, which starts each command in that command's cgroups with its rlimits; the host
kills all that is left in them when the command is over, and a command that leaves files in
/tmp or /dev/shm gets the box a fresh sandbox. That saves a bubblewrap start and teardown per
command, as much CPU as a test run. Where the helper cannot be built (no gcc) or bwrap lacks
--as-pid-1, each command gets a bubblewrap of its own instead (bwrap's init reaps orphans, and
when the command exits the kernel kills whatever is left in the namespace).

The work dir is a size-capped tmpfs per box, owned by the slot uid: hard links to host files are
impossible across file systems, and its size cap and the memory cgroup bound what it can take.

Exit status: the supervisor reports the command's own wait status. With a bubblewrap per
command, bwrap reports a command killed by signal N as exit code 128 + N, so a program that
itself exits with 129..192 is reported as killed by that signal (as a shell would), and a
program that writes "bwrap: ..." to stderr and exits 1 is taken for a bwrap set-up failure
(SandboxError): it can only spoil its own result.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import pwd
import queue
import signal
import stat
import tempfile
import threading
import time

from sandbox import _bwrap, _cgroup, _exec, _helper, _linux, _seccomp, _session
from sandbox.backend import Closing, SandboxError
from sandbox.detect import probe_host, require_isolation
from sandbox.job import ExecOutcome, Limits

_MIB = 1 << 20
# Tasks bwrap itself keeps in the run's pids cgroup: the outer bwrap (monitor) and its
# pid-namespace init; the command is the third. Measured: pids.current == 3 while a
# single-threaded command runs.
BWRAP_TASKS = 2
# Tasks of a box's sandbox outside the command's cgroups but of the slot uid: bwrap and the
# supervisor (counted by RLIMIT_NPROC; the command's pids cgroup holds only the command).
SESSION_TASKS = 2
# Memory bwrap's two processes and the sandbox's tmpfs/proc bookkeeping take in the memory
# cgroup, on top of limits.memory_mb (measured peak 1.2 MiB with `sleep` as the command).
BWRAP_MEMORY = 8 * _MIB
_INODES_PER_MB = 64       # tmpfs inode cap: a program cannot fill the box with empty files
_LOCK_DIR = "/run/rlpost-sandbox"
_SOURCE = "rlpost-box"   # tmpfs source name; "<_SOURCE>-<pid>" marks this process's mounts
_UID_SEARCH = 1000        # how far past uid_base to look for free slot uids


def _uid_in_use(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid == uid:
                    return True
            except FileNotFoundError:
                continue     # exited while scanning
    return False


class _SlotLocks:
    """Slot uids claimed through flock files, so two backends (in one process or several
    workers) never share a uid."""

    def __init__(self, uid_base: int, slots: int) -> None:
        os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
        self.uids: list[int] = []
        self._fds: list[int] = []
        try:
            for uid in range(uid_base, uid_base + _UID_SEARCH):
                if len(self.uids) == slots:
                    break
                fd = os.open(os.path.join(_LOCK_DIR, f"uid-{uid}.lock"),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if _uid_in_use(uid):
                    os.close(fd)
                    continue
                self.uids.append(uid)
                self._fds.append(fd)
        except BaseException:
            self.release()
            raise
        if len(self.uids) < slots:
            self.release()
            raise SandboxError(f"found only {len(self.uids)} free slot uids in "
                               f"[{uid_base}, {uid_base + _UID_SEARCH}) for {slots} slots")

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self.uids = [], []


def cleanup_stale() -> None:
    """Remove cgroups and tmpfs mounts left by crashed processes (their pid is in the name)."""
    _cgroup.remove_stale()
    for target in _linux.mounts_with_source(_SOURCE + "-"):
        pid = os.path.basename(target).split("-")[2:3]     # rlpost-box-<pid>-<uid>-<random>
        if pid and pid[0].isdigit() and not os.path.exists(f"/proc/{pid[0]}"):
            _linux.umount(target)
            os.rmdir(target)


class _Subreaper:
    """This process is a child subreaper while any ProcessBackend is open (see
    ProcessBox._reap_ns_init). While it is, orphans of *any* subprocess tree of this process are
    re-parented here too; they stay zombies until the process exits, so it is switched off
    again when the last backend closes."""

    _lock = threading.Lock()
    _users = 0

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                _linux.set_child_subreaper(True)
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                _linux.set_child_subreaper(False)


class ProcessBackend(Closing):
    """Boxes isolated by bubblewrap, cgroups, rlimits and seccomp; `slots` boxes at a time (one
    slot uid each). Refuses to start (SandboxUnavailable) when the host lacks any of these.

    Run cgroups live under <hierarchy>/rlpost-sandbox/ at the root of each cgroup hierarchy (not
    nested in the caller's cgroup), work dirs under `workdir_parent` (default: the temp dir).
    While open, the backend makes this process a child subreaper (see _Subreaper).
    """

    name = "process"

    def __init__(self, slots: int = 2, uid_base: int = 60000, *, bwrap: str = "bwrap",
                 workdir_parent: str | None = None) -> None:
        support = probe_host(bwrap, uid_base)
        require_isolation(support)
        assert support.bwrap_path is not None
        self.bwrap = support.bwrap_path
        self.workdir_parent = workdir_parent or tempfile.gettempdir()
        # One sandbox per box where the helper can be built (else a bubblewrap per command).
        self.sessions = support.bwrap_as_pid_1 and _helper.path() is not None
        cleanup_stale()
        self._locks = _SlotLocks(uid_base, slots)
        self._uids = list(self._locks.uids)
        self._free: queue.Queue[int] = queue.Queue()
        for uid in self._uids:
            self._free.put(uid)
        self._state = threading.Lock()
        self._closed = False
        self._released = False
        _Subreaper.acquire()

    @property
    def uids(self) -> list[int]:
        """The slot uids this backend holds."""
        return list(self._uids)

    def box(self) -> "ProcessBox":
        """A fresh box; blocks until a slot is free."""
        if self._closed:
            raise SandboxError("backend is closed")
        uid = self._free.get()
        try:
            return ProcessBox(self, uid)
        except BaseException:
            self._release(uid)
            raise

    def _release(self, uid: int) -> None:
        self._free.put(uid)
        self._maybe_release_all()

    def _maybe_release_all(self) -> None:
        """Once closed and every box is back: give up the slot uids and the subreaper role."""
        with self._state:
            if self._closed and not self._released and self._free.qsize() == len(self._uids):
                self._released = True
                self._locks.release()
                _Subreaper.release()

    def close(self) -> None:
        """No new boxes; the slots are released when the open boxes close."""
        self._closed = True
        self._maybe_release_all()


_seq = itertools.count()


class ProcessBox(Closing):
    """One job's tmpfs work dir on the host, run by one slot uid; commands run one at a time."""

    def __init__(self, backend: ProcessBackend, uid: int, workdir_mb: int = Limits().workdir_mb) -> None:
        self._backend = backend
        self.uid = uid
        self._lock = threading.Lock()
        self._closed = False
        self._size_mb = 0
        self._tmp_bytes = workdir_mb * _MIB       # /tmp and /dev/shm of the box's sandbox
        self._session: _session.BoxSession | None = None
        self.source = f"{_SOURCE}-{os.getpid()}"
        self.path = tempfile.mkdtemp(prefix=f"{_SOURCE}-{os.getpid()}-{uid}-",
                                     dir=backend.workdir_parent)
        try:
            os.chmod(self.path, 0o711)      # bwrap (as the slot uid) must reach the mount point
            self._mount(workdir_mb)
            self._dirfd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self._unmount()
            raise

    # -- work dir -------------------------------------------------------------------------
    def _mount(self, size_mb: int, remount: bool = False) -> None:
        opts = f"size={size_mb}m,nr_inodes={max(256, size_mb * _INODES_PER_MB)}"
        if not remount:
            opts += f",mode=0700,uid={self.uid},gid={self.uid}"
        _linux.mount_tmpfs(self.source, self.path, opts, remount=remount)
        self._size_mb = size_mb

    def _resize(self, size_mb: int) -> None:
        """Give this run `size_mb` (never less than what the box already holds)."""
        st = os.statvfs(self.path)
        used_mb = -(-(st.f_blocks - st.f_bfree) * st.f_frsize // _MIB)
        size_mb = max(size_mb, used_mb)
        if size_mb != self._size_mb:
            self._mount(size_mb, remount=True)

    def _unmount(self) -> None:
        if os.path.ismount(self.path):
            _linux.umount(self.path)
        if os.path.isdir(self.path):
            os.rmdir(self.path)

    def _parent(self, name: str, create: bool) -> tuple[int, str]:
        """(dir fd, base name) for a relative `name`, walking it without following symlinks the
        program may have planted. The caller closes the fd."""
        parts = _exec.path_parts(name)
        fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._dirfd)
        try:
            for part in parts[:-1]:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        os.chown(part, self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass      # already there; the O_NOFOLLOW open below checks what it is
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def write(self, name: str, data: bytes, executable: bool = False) -> None:
        """Replace `name` with `data`, owned by the slot uid (whatever the program left there)."""
        self._check_open()
        fd, base = self._parent(name, create=True)
        try:
            try:
                os.unlink(base, dir_fd=fd)
            except FileNotFoundError:
                pass      # nothing to replace
            mode = 0o755 if executable else 0o644
            f = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        mode, dir_fd=fd)
            try:
                os.fchown(f, self.uid, self.uid)
                os.fchmod(f, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(f, view):]
            finally:
                os.close(f)
        finally:
            os.close(fd)

    def read(self, name: str, max_bytes: int = 1 << 20) -> bytes | None:
        """A regular file the program left (None if absent, or a symlink, dir, fifo...)."""
        self._check_open()
        try:
            fd, base = self._parent(name, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            f = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None
            raise
        finally:
            os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(f).st_mode):
                return None
            chunks, left = [], max_bytes
            while left > 0 and (chunk := os.read(f, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(f)

    # -- running --------------------------------------------------------------------------
    def run(self, argv: list[str], stdin: bytes = b"", limits: Limits = Limits()) -> ExecOutcome:
        """Run argv in the work dir (cwd, at _bwrap.WORKDIR inside) under `limits`: in the box's
        sandbox (see sandbox._session), or, without the helper, in a bubblewrap of its own."""
        with self._lock:
            self._check_open()
            self._resize(limits.workdir_mb)
            name = f"{os.getpid()}-{self.uid}-{next(_seq)}"
            in_session = self._backend.sessions
            cg = _cgroup.RunCgroups(name, memory_bytes=limits.memory_mb * _MIB + BWRAP_MEMORY,
                                    pids_max=limits.processes + (0 if in_session else BWRAP_TASKS))
            try:
                if in_session:
                    return self._run_in_session(cg, argv, stdin, limits)
                return self._run_in_bwrap(cg, argv, stdin, limits)
            finally:
                try:
                    cg.kill_all()
                finally:
                    cg.remove()

    def _run_in_session(self, cg: _cgroup.RunCgroups, argv: list[str], stdin: bytes,
                        limits: Limits) -> ExecOutcome:
        if self._session is not None and not self._session.usable():
            self._end_session()
        if self._session is None:
            self._session = _session.BoxSession(self._backend.bwrap, self.path, self.uid,
                                                self._tmp_bytes)
        rl = _exec.rlimits(limits, address_space=_exec.address_space(limits),
                           nproc=limits.processes + SESSION_TASKS + 1)
        started, t0 = time.time(), time.monotonic()
        try:
            command = self._session.run(argv, rl, cg.join_files)
            try:
                cap = _exec.supervise(command, stdin, limits, kill=cg.kill_all,
                                      cpu_used=cg.cpu_s, started=t0,
                                      tasks_exceeded=lambda: cg.pids_max_hits() > 0)
            finally:
                cg.kill_all()         # whatever the command left (it cannot leave its cgroups)
            self._session.finish()    # ... and the supervisor reaped it
        except BaseException:
            cg.kill_all()             # before ending the session, which waits for the supervisor
            self._end_session()
            raise
        return self._outcome(cap, cg.usage(), limits, started, from_bwrap=False)

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def sandbox_pids(self) -> list[int]:
        """The box's own processes while it is open (its bubblewrap and supervisor, if it has
        started them), so tests can tell them from leftovers of a command."""
        return [] if self._session is None else self._session.pids()

    def _run_in_bwrap(self, cg: _cgroup.RunCgroups, argv: list[str], stdin: bytes,
                      limits: Limits) -> ExecOutcome:
        sfd = _seccomp.filter_fd()
        info_r, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        started = time.time()
        try:
            cmd = _bwrap.argv(self._backend.bwrap, self.path, argv, seccomp_fd=sfd,
                              info_fd=info_w, tmp_bytes=limits.workdir_mb * _MIB)
            rl = _exec.rlimits(limits, address_space=_exec.address_space(limits),
                               nproc=limits.processes + BWRAP_TASKS + 1)
            t0 = time.monotonic()
            child = _exec.spawn(cmd, rlimits=rl, env=_bwrap.ENV, cwd="/", uid=self.uid,
                                join=cg.join_files, pass_fds=(sfd, info_w))
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(sfd)
            os.close(info_w)

        def kill() -> None:
            cg.kill_except(child.pid)     # the namespace init dies, so the namespace empties
            if child.wait(1.0) is None:
                cg.kill_all()

        try:
            try:
                cap = _exec.supervise(child, stdin, limits, kill=kill, cpu_used=cg.cpu_s,
                                      tasks_exceeded=lambda: cg.pids_max_hits() > 0, started=t0)
            finally:
                cg.kill_all()
                child.wait()
                self._reap_ns_init(info_r)
        finally:
            os.close(info_r)
        return self._outcome(cap, cg.usage(), limits, started, from_bwrap=True)

    def _reap_ns_init(self, info_fd: int) -> None:
        """bwrap exits as soon as its namespace init reports the command's status, orphaning the
        init. As child subreaper we inherit it: reap it now."""
        try:
            info = os.read(info_fd, 4096)
        except BlockingIOError:
            return                        # bwrap failed before starting a namespace
        if info:
            _session.reap_orphan(int(json.loads(info)["child-pid"]), self.uid)

    def _outcome(self, cap: _exec.Captured, usage: _cgroup.Usage, limits: Limits,
                 started: float, from_bwrap: bool) -> ExecOutcome:
        """`from_bwrap`: the status is bwrap's (signal deaths as 128 + N, its own failures as
        "bwrap: ..." and exit 1), not the command's own wait status as the supervisor reports."""
        rc = cap.returncode
        exit_code: int | None = rc
        sig: int | None = None
        if rc < 0:                        # killed by a signal (bwrap: the fallback kill)
            exit_code, sig = None, -rc
        elif not from_bwrap:
            pass
        elif 128 < rc <= 128 + 64:        # bwrap reports a signal death as 128 + signo
            exit_code, sig = None, rc - 128
        elif rc == 1 and cap.stderr.startswith(b"bwrap: "):
            line = cap.stderr.split(b"\n", 1)[0].decode(errors="replace")
            if "execvp" not in line:
                raise SandboxError(f"bubblewrap failed to set up the sandbox: {line}")
            exit_code = 127               # command not found, as a shell reports it
        failed = exit_code != 0
        return _exec.outcome(
            cap, exit_code, sig, usage.cpu_s, limits, self.path, started,
            memory_exceeded=usage.oom_kills > 0 or (failed and usage.memory_failcnt > 0),
            process_limit_hit=cap.tasks_exceeded or usage.pids_max_hits > 0,
            violation="seccomp" if sig == signal.SIGSYS else "")

    # -- lifetime -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("box is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                try:
                    self._end_session()
                finally:
                    os.close(self._dirfd)
                    self._unmount()
            finally:
                self._backend._release(self.uid)
