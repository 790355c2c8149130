"""The malloc settings CPU learner actors start with (launch/allocator.py): named in their environment, and
in effect in a process started with them (a freed large block is reused without page faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch.allocator import KEEP_FREED_MEMORY, malloc_env
from launch.console import actor_env, rollout_env

# A process allocates 256 MiB, writes it, frees it, allocates and writes it again, and reports the
# minor page faults of the second round: under glibc's default the block was unmapped at `free`,
# so each of its 65,536 pages faults again; with freed memory kept, none (or a handful) do.
_REUSE = r"""
import ctypes, json, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 256 << 20
p = libc.malloc(size); ctypes.memset(p, 1, size); libc.free(ctypes.c_void_p(p))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(size); ctypes.memset(p, 2, size)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _second_round_faults(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY}
    out = subprocess.run([sys.executable, "-c", _REUSE], env={**env, **extra_env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)["faults"]


def test_cpu_learners_start_with_freed_memory_kept_and_other_actors_do_not(monkeypatch):
    for key in KEEP_FREED_MEMORY:
        monkeypatch.delenv(key, raising=False)
    assert malloc_env(False) == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
    assert malloc_env(True) == {}
    assert actor_env(2, False, keep_freed=True)["MALLOC_MMAP_MAX_"] == "0"  # a CPU learner
    assert "MALLOC_MMAP_MAX_" not in actor_env(2, True, keep_freed=True)    # a GPU learner
    assert "MALLOC_MMAP_MAX_" not in rollout_env(2, False)                  # rollout: glibc's defaults


def test_a_value_the_user_set_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert actor_env(1, False, keep_freed=True)["MALLOC_MMAP_MAX_"] == "65536"
    assert actor_env(1, False, keep_freed=True)["MALLOC_TRIM_THRESHOLD_"] == str(2**40)


def test_the_settings_make_glibc_reuse_a_freed_large_block_without_page_faults():
    default = _second_round_faults({})
    kept = _second_round_faults(malloc_env(False))
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert default > 0.9 * pages, default  # unmapped at free: every page faults again
    assert kept < 0.01 * pages, kept       # the same pages, already mapped


# ---- trainer/heap.py: the bound on what the kept heap holds ------------------------------------

def test_heap_cap_trims_only_past_its_factor_of_the_first_update(monkeypatch):
    import trainer.heap as heap

    calls = []
    sizes = iter([100, 140, 150, 151, 90])  # resident bytes after each update
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(sizes))
    cap = heap.HeapCap(factor=1.5, active=True)
    cap.trim = calls.append
    assert [cap.after_update() for _ in range(5)] == [False, False, False, True, False]
    assert cap.baseline == 100 and cap.trims == 1 and calls == [0]


def test_heap_cap_is_off_where_the_heap_gives_memory_back(monkeypatch):
    import trainer.heap as heap

    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    assert not heap.HeapCap().active  # glibc's default: nothing is kept, nothing to bound
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert heap.HeapCap().active
    assert not heap.HeapCap(active=False).active  # a GPU rank


_TRIM = r"""
import ctypes, json, os
from trainer.heap import HeapCap, resident_bytes
libc = ctypes.CDLL("libc.so.6"); libc.malloc.restype = ctypes.c_void_p
cap = HeapCap(factor=1.5)
cap.after_update()                                      # the first update: the baseline
blocks = [libc.malloc(64 << 20) for _ in range(8)]      # 512 MiB from the heap (mmap is off)...
for b in blocks: ctypes.memset(b, 1, 64 << 20)
for b in blocks[:-1]: libc.free(ctypes.c_void_p(b))     # ...freed under a live block: kept resident
held = resident_bytes()
trimmed = cap.after_update()
print(json.dumps({"active": cap.active, "trimmed": trimmed, "held": held, "after": resident_bytes(),
                  "baseline": cap.baseline}))
"""


def test_a_trim_gives_the_kept_free_blocks_back_to_the_system():
    env = {**os.environ, **malloc_env(False), "PYTHONPATH": os.getcwd()}
    out = json.loads(subprocess.run([sys.executable, "-c", _TRIM], env=env, capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["active"] and out["trimmed"], out
    assert out["held"] > out["baseline"] + (400 << 20), out     # the freed 448 MiB stayed resident
    assert out["after"] < out["held"] - (400 << 20), out        # malloc_trim(0) released it
