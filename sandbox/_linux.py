"""Linux calls the standard library lacks, through libc, for the code sandbox and the agent
sandbox (reward/agents/jail.py) alike: unshare(2), mount(2)/umount2(2), prctl(2) and raw
syscalls, each raising OSError with the errno's text on failure."""

from __future__ import annotations

import ctypes
import os
import platform

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 22, 36, 38
_SYS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def prctl(option: int, *args: int, what: str = "") -> None:
    _check(_libc.prctl(option, *args, *[0] * (4 - len(args))), what or f"prctl({option}, {', '.join(map(str, args))})")


def syscall(name: str, *args) -> None:
    """A syscall libc has no wrapper for (`pivot_root`, `capset`), by number on this machine."""
    _check(_libc.syscall(_SYS[platform.machine()][name], *args), name)


def mount_tmpfs(source: str, target: str, options: str, remount: bool = False) -> None:
    flags = MS_NOSUID | MS_NODEV | (MS_REMOUNT if remount else 0)
    _check(_libc.mount(_b(source), _b(target), b"tmpfs", flags, _b(options)), f"mount tmpfs {target} ({options})")


def umount(target: str) -> None:
    """Unmount; lazily if something still holds it (it is unreachable either way)."""
    if _libc.umount2(target.encode(), 0) == 0:
        return
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def mounts_with_source(source_prefix: str) -> list[str]:
    """Mount points (from /proc/self/mountinfo) whose source starts with `source_prefix`."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if len(post_fields) >= 2 and post_fields[1].startswith(source_prefix):
                out.append(fields[4].replace("\\040", " "))
    return out


def set_child_subreaper(on: bool) -> None:
    """While on, orphaned descendants of this process are re-parented to it instead of the
    host's init."""
    prctl(PR_SET_CHILD_SUBREAPER, int(on), what="prctl(PR_SET_CHILD_SUBREAPER)")
