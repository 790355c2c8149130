"""The unsafe local backend: a plain subprocess in a temp dir, with NO isolation.

For users who explicitly opt in (code they trust, hosts without bubblewrap/cgroups/root), and as
the bare-subprocess peer when benchmarking the process backend. It starts commands the same way
(sandbox._exec.spawn, through the launcher), applies the same rlimits, wall/CPU limits and
output caps, and kills the command's process group at the end, but the program runs as this
user, sees the whole file system and network, and a process that leaves its process group
(setsid) survives the run. Memory is capped by RLIMIT_AS only
(so memory_exceeded is never reported), tasks are not capped (RLIMIT_NPROC would count every
process of this user) and cpu_s is the rusage of the main process and the children it waited for.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import tempfile
import threading
import time

from sandbox import _exec, _helper
from sandbox.backend import Closing, SandboxError, SandboxUnavailable
from sandbox.job import ExecOutcome, Limits

_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


class LocalBackend:
    """Boxes without isolation; refuses to exist unless the caller says it knows."""

    name = "unsafe_local"

    def __init__(self, i_understand_this_is_unsafe: bool = False) -> None:
        if not i_understand_this_is_unsafe:
            raise SandboxUnavailable(
                "the unsafe_local backend runs untrusted code as this user with no isolation "
                "(it can read and write your files, use the network and outlive the run); "
                "pass i_understand_this_is_unsafe=True (sandbox.backend=unsafe_local) only for "
                "code you trust, otherwise use sandbox.backend=process or docker")
        _helper.path()          # build it now rather than in the first command

    def box(self) -> "LocalBox":
        return LocalBox()

    def close(self) -> None:
        """Nothing long-lived to release."""


class LocalBox(Closing):
    """A temp dir on the host; commands run as this user with the dir as cwd, one at a time."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="rlpost-local-")
        self._lock = threading.Lock()
        self._closed = False

    def _file(self, name: str) -> str:
        return os.path.join(self.path, *_exec.path_parts(name))

    def write(self, name: str, data: bytes, executable: bool = False) -> None:
        path = self._file(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755 if executable else 0o644)

    def read(self, name: str, max_bytes: int = 1 << 20) -> bytes | None:
        path = self._file(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None               # a symlink: not a file the program left
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return f.read(max_bytes)

    def run(self, argv: list[str], stdin: bytes = b"", limits: Limits = Limits()) -> ExecOutcome:
        with self._lock:
            if self._closed:
                raise SandboxError("box is closed")
            rl = _exec.rlimits(limits, address_space=_exec.address_space(limits), nproc=None)
            started = time.time()
            t0 = time.monotonic()
            child = _exec.spawn(argv, rlimits=rl, cwd=self.path,
                                env={**_ENV, "HOME": self.path, "TMPDIR": self.path})

            def kill() -> None:
                _killpg(child.pid)

            try:
                cap = _exec.supervise(child, stdin, limits, kill=kill, started=t0)
            finally:
                _killpg(child.pid)       # leftovers in the process group
                child.wait()
        rc = cap.returncode
        sig = -rc if rc < 0 else None
        return _exec.outcome(cap, None if sig else rc, sig, cap.cpu_s, limits, self.path, started)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                shutil.rmtree(self.path)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass          # the group is empty already
