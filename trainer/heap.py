"""The allocator settings that make a CPU learner keep freed memory, and a bound on what it keeps.

CPU learner actors start with jemalloc and `JEMALLOC_KEEP_FREED`, or glibc's malloc and
`KEEP_FREED_MEMORY` (launch/allocator.py says why): the next step's large allocations reuse pages
already touched instead of page-faulting through fresh ones. With batches of another size every
step the kept free blocks fragment, and the heap creeps upward (glibc, SmolLM2-135M bf16, 30 GRPO
updates of varying length: resident 4.8 -> 8.4 GB, still rising). So after every update the rank
compares its resident memory with what it held after its first one and, past `factor` times that,
hands the free pages back (glibc's `malloc_trim(0)`, which also releases free chunks inside the
heap; jemalloc's `arena.<all>.purge`); the next update then touches them anew, once.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import psutil

KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_MAX_": "0",  # no mmap'd chunks: every allocation from the heap...
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # ...and the heap's free top never given back (1 TiB)
}
# jemalloc: freed pages are never purged on their own (dirty, then muzzy, after -1 ms: never)
JEMALLOC_KEEP_FREED = {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
TRIM_FACTOR = 1.5
_ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL


def resident_bytes() -> int:
    """This process's resident set size."""
    return psutil.Process().memory_info().rss


def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def jemalloc_purge() -> Callable[[], int] | None:
    """A call that gives every free page of this process's jemalloc arenas back to the system, or
    None where malloc is not jemalloc's (`mallctl` is not in the process's global symbols)."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    name = f"arena.{_ALL_ARENAS}.purge".encode()
    return lambda: mallctl(name, None, None, None, 0)


class HeapCap:
    """Gives the kept free pages back after an update that leaves the process over `factor` x its
    resident memory after the first update. Active only where freed memory is kept: in a process
    running jemalloc (CPU learner actors by default) or one started with `KEEP_FREED_MEMORY`'s
    `MALLOC_MMAP_MAX_` where glibc's malloc_trim exists."""

    def __init__(self, factor: float = TRIM_FACTOR, active: bool | None = None):
        self.factor = factor
        purge = jemalloc_purge()
        trim = _malloc_trim()
        mmap_max = "MALLOC_MMAP_MAX_"
        self.allocator, self.release, kept = "", None, False
        if purge is not None:  # jemalloc keeps freed pages only as configured; a bound costs nothing
            self.allocator, self.release, kept = "jemalloc", purge, True
        elif trim is not None:
            self.allocator, self.release = "glibc", lambda: trim(0)
            kept = os.environ.get(mmap_max) == KEEP_FREED_MEMORY[mmap_max]
        self.active = (kept if active is None else active) and self.release is not None
        self.baseline = 0
        self.trims = 0

    def after_update(self) -> bool:
        """Called after each update; True when it trimmed."""
        if not self.active:
            return False
        rss = resident_bytes()
        if not self.baseline:
            self.baseline = rss
            return False
        if rss <= self.factor * self.baseline:
            return False
        self.release()
        self.trims += 1
        return True
