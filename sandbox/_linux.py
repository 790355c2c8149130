"""Linux calls the standard library lacks, through libc: mount(2)/umount2(2) for the per-box
tmpfs (no `mount` process per box) and prctl(2) to become a child subreaper."""

from __future__ import annotations

import ctypes
import os

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MNT_DETACH = 0x2
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount_tmpfs(source: str, target: str, options: str, remount: bool = False) -> None:
    flags = MS_NOSUID | MS_NODEV | (MS_REMOUNT if remount else 0)
    _check(_libc.mount(source.encode(), target.encode(), b"tmpfs", flags, options.encode()),
           f"mount tmpfs {target} ({options})")


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
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
