"""The glibc settings that make a CPU learner's heap keep freed memory, and a bound on what it keeps.

CPU learner actors start with `KEEP_FREED_MEMORY` (launch/allocator.py says why): the next step's
large allocations reuse pages already touched instead of page-faulting through fresh mmaps. With
batches of another size every step the kept free blocks fragment, and the heap creeps upward
(SmolLM2-135M bf16, 30 GRPO updates of varying length: resident 4.8 -> 8.4 GB, still rising). So
after every update the rank compares its resident memory with what it held after its first one
and, past `factor` times that, hands the heap's free pages back (glibc's `malloc_trim(0)`, which
also releases free chunks inside the heap); the next update then touches them anew, once.
"""

from __future__ import annotations

import ctypes
import os

import psutil

KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_MAX_": "0",  # no mmap'd chunks: every allocation from the heap...
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # ...and the heap's free top never given back (1 TiB)
}
TRIM_FACTOR = 1.5


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


class HeapCap:
    """Trims the heap after an update that leaves the process over `factor` x its resident memory
    after the first update. Active only where freed memory is kept (this process started with
    `KEEP_FREED_MEMORY`'s `MALLOC_MMAP_MAX_`, as CPU learner actors do) and glibc's malloc_trim exists."""

    def __init__(self, factor: float = TRIM_FACTOR, active: bool | None = None):
        self.factor = factor
        self.trim = _malloc_trim()
        mmap_max = "MALLOC_MMAP_MAX_"
        kept = os.environ.get(mmap_max) == KEEP_FREED_MEMORY[mmap_max]
        self.active = (kept if active is None else active) and self.trim is not None
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
        self.trim(0)
        self.trims += 1
        return True
