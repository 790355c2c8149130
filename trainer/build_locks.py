"""torch's extension build locks, found and cleared without importing torch (the checks before
Ray starts run it): a lock an interrupted build left would make every learner wait in silence.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from typing import Callable

# torch's JIT build of an extension (DeepSpeed's ops: its CPU shm op is ~40 s of g++ on 2 cores)
# takes a `lock` file in the op's build folder (`torch.utils.file_baton.FileBaton`, made with
# O_EXCL and held open by the building process until it removes it); any other process that
# builds or loads the op waits until the file is gone (`cpp_extension._jit_compile`:
# `baton.wait()`), without a word and without end. A build that was killed (Ctrl-C during a first
# run) leaves the file behind, and every later learner on the machine waited on it.
STALE_BUILD_LOCK_S = 600.0  # a lock no process here holds, this old: left by a build that was killed
QUIET_BUILD_S = 120.0  # ...or whose folder nothing was written to for this long (a build writes its objects)
BUILD_LOCK_REPORT_S = 10.0  # how often a wait on a lock says what it waits on


class BuildLockError(FileExistsError):
    """A torch extension build lock stops the start: the message names the lock, who holds it
    (if anyone) and how to clear it."""


@dataclass(frozen=True)
class BuildLock:
    """One `lock` file in torch's extension build folders, as found now."""

    path: str
    age_s: float  # since it was made
    quiet_s: float  # since anything in its build folder (the lock included) was last written
    holders: tuple[int, ...] | None  # processes on this machine that hold it open (None: cannot tell)

    @property
    def op(self) -> str:
        return os.path.basename(os.path.dirname(self.path))

    @property
    def stale(self) -> bool:
        """Left by a build that was interrupted: no process on this machine holds it, and nothing
        was written to its folder for QUIET_BUILD_S (a build on another machine that shares the
        folder writes its objects there meanwhile), or it is older than STALE_BUILD_LOCK_S."""
        return not self.holders and (self.quiet_s >= QUIET_BUILD_S or self.age_s >= STALE_BUILD_LOCK_S)

    def describe(self) -> str:
        what = f"torch's build lock {self.path} (of the extension {self.op}, e.g. a DeepSpeed op)"
        if self.holders:
            return (f"{what}: process {', '.join(map(str, self.holders))} on this machine is building it "
                    f"({self.age_s:.0f} s so far)")
        if self.holders is None:
            return f"{what}: made {self.age_s:.0f} s ago (who holds it cannot be told on this system)"
        return (f"{what}: no process on this machine holds it (made {self.age_s:.0f} s ago, nothing written in its "
                f"folder for {self.quiet_s:.0f} s): a build interrupted earlier left it, unless a build on another "
                "machine that shares this folder runs now")

    def removed(self) -> str:
        return (f"removed torch's build lock {self.path}: a build of {self.op} interrupted earlier left it (no "
                f"process on this machine held it; made {self.age_s:.0f} s ago, nothing written in its folder for "
                f"{self.quiet_s:.0f} s)")

    def fix(self) -> str:
        if self.holders:
            return (f"if that build is stuck, end process {', '.join(map(str, self.holders))}, or remove the lock: "
                    f"rm {self.path}")
        return f"remove it: rm {self.path}"


def extension_roots() -> list[str]:
    """The folders of torch's extension builds, one folder per extension in each, as
    `torch.utils.cpp_extension._get_build_directory` names them: TORCH_EXTENSIONS_DIR, or
    <user cache>/torch_extensions/py<ver>_<cpu|cuXY> (every Python and torch flavour there)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return [os.environ["TORCH_EXTENSIONS_DIR"]]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return sorted(glob.glob(os.path.join(cache, "torch_extensions", "py*")))


def _holders(path: str) -> tuple[int, ...] | None:
    """The processes on this machine that have `path` open (torch's builder keeps its lock open
    until it removes it); None where /proc cannot tell (not Linux)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, pids = os.path.realpath(path), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return tuple(pids)


def build_locks(root: str | None = None) -> list[BuildLock]:
    """The build locks in torch's extension folders now (`root`: else extension_roots())."""
    found = []
    paths = [p for r in ([root] if root else extension_roots()) for p in glob.glob(os.path.join(r, "*", "lock"))]
    for path in sorted(paths):
        try:
            made = os.path.getmtime(path)
            written = max([made] + [e.stat().st_mtime for e in os.scandir(os.path.dirname(path))])
        except FileNotFoundError:  # its build just finished
            continue
        holders = _holders(path)
        if not os.path.exists(path):
            continue
        now = time.time()
        found.append(BuildLock(path, max(0.0, now - made), max(0.0, now - written), holders))
    return found


def _still_unheld(lock: BuildLock, after_s: float = 0.2) -> bool:
    """`lock` is there and no one here holds it, `after_s` later too: a build that was releasing it
    (torch closes the file, then removes it) is not taken for one that left it."""
    time.sleep(after_s)
    return os.path.exists(lock.path) and not _holders(lock.path)


def _remove(lock: BuildLock) -> bool:
    if not _still_unheld(lock):
        return False
    try:
        os.remove(lock.path)
        return True
    except FileNotFoundError:  # another rank removed it, or its build just finished
        return False


def clear_stale_build_locks(root: str | None = None) -> list[str]:
    """Remove the stale build locks (`BuildLock.stale`) from torch's extension build folders
    (`root`: extension_roots()); returns them. A lock a live build holds, or one left so recently
    that a build elsewhere may still be writing, stays."""
    return [lock.path for lock in build_locks(root) if lock.stale and _remove(lock)]


def await_build_locks(say: Callable[[str], None] = print, deadline_s: float = STALE_BUILD_LOCK_S,
                      report_s: float | None = None, poll_s: float = 0.5, root: str | None = None) -> list[str]:
    """Before DeepSpeed builds or loads its ops (where torch would wait on a lock in silence and
    without end): until no build lock is left in torch's extension folders (`root`:
    extension_roots()). A stale one is removed (and said); one a process here holds, or one left
    moments ago, is waited for, saying every `report_s` (BUILD_LOCK_REPORT_S) what is waited on and
    how to clear it; past `deadline_s` a BuildLockError names it. Returns the locks removed."""
    report_s = BUILD_LOCK_REPORT_S if report_s is None else report_s
    removed: list[str] = []
    start, told = time.monotonic(), None
    while True:
        waiting = []
        for lock in build_locks(root):
            if lock.stale:
                if _remove(lock):
                    removed.append(lock.path)
                    say(lock.removed())
            else:
                waiting.append(lock)
        if not waiting:
            return removed
        waited = time.monotonic() - start
        if waited >= deadline_s:
            lock = waiting[0]
            raise BuildLockError(f"waited {waited:.0f} s for {lock.describe()}; {lock.fix()}")
        if told is None or time.monotonic() - told >= report_s:
            told = time.monotonic()
            for lock in waiting:
                later = ("" if lock.holders else
                         f" (it is removed once nothing was written there for {QUIET_BUILD_S:.0f} s)")
                say(f"waiting ({waited:.0f} s) for {lock.describe()}{later}; to go on now: {lock.fix()}")
        time.sleep(poll_s)


def require_no_stale_build_lock(say: Callable[[str], None] = print, root: str | None = None) -> None:
    """Before a run starts (launch/checks.py): a build lock no process on this machine holds
    stops it at once, naming the lock and the fix, unless it is stale (then it is removed and
    said); a lock that a build here holds is said (the learners wait for it)."""
    for lock in build_locks(root):
        if lock.stale:
            if _remove(lock):
                say(lock.removed())
        elif lock.holders or lock.holders is None:
            say(f"note: {lock.describe()}; the learners wait for it to finish")
        elif _still_unheld(lock):
            raise BuildLockError(f"{lock.describe()}. DeepSpeed's learners would wait on it; {lock.fix()} "
                                 "(unless that other machine's build is under way: then wait for it)")
