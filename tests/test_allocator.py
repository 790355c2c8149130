"""The malloc CPU learner actors start with (launch/allocator.py): named in their environment, and
in effect in a process started with it (a freed large block is reused without page faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.allocator import jemalloc_library, malloc_env
from launch.console import actor_env, rollout_env
from trainer.heap import JEMALLOC_KEEP_FREED, KEEP_FREED_MEMORY

SETTINGS = (*KEEP_FREED_MEMORY, *JEMALLOC_KEEP_FREED, "LD_PRELOAD")

# A process allocates 256 MiB, writes it, frees it, allocates and writes it again, and reports the
# minor page faults of the second round: under glibc's default the block was unmapped at `free`,
# so each of its 65,536 pages faults again; with freed memory kept, none (or a handful) do. The
# process's own malloc is called (the global symbol: jemalloc's where it is preloaded).
_REUSE = r"""
import ctypes, json, resource
lib = ctypes.CDLL(None)
lib.malloc.restype = ctypes.c_void_p
size = 256 << 20
p = lib.malloc(size); ctypes.memset(p, 1, size); lib.free(ctypes.c_void_p(p))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = lib.malloc(size); ctypes.memset(p, 2, size)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "jemalloc": "libjemalloc" in open("/proc/self/maps").read()}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SETTINGS}


def _second_round(extra_env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _REUSE], env={**_clean_env(), **extra_env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


needs_jemalloc = pytest.mark.skipif(jemalloc_library() is None, reason="this Ray build ships no libjemalloc.so")


@needs_jemalloc
def test_cpu_learners_start_with_jemalloc_cpu_rollout_with_glibc_s_kept_heap(monkeypatch):
    for key in SETTINGS:
        monkeypatch.delenv(key, raising=False)
    library = jemalloc_library()
    assert library.endswith("ray/core/libjemalloc.so") and os.path.isfile(library)
    glibc = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
    jemalloc = {"LD_PRELOAD": library, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1", **glibc}
    assert malloc_env(False) == malloc_env(False, "jemalloc") == jemalloc
    assert malloc_env(False, "glibc") == glibc
    assert malloc_env(True) == malloc_env(True, "glibc") == {}
    assert actor_env(2, False, "jemalloc")["LD_PRELOAD"] == library          # a CPU learner
    assert actor_env(2, False, "glibc")["MALLOC_MMAP_MAX_"] == "0"           # ...told to use glibc's heap
    assert not set(SETTINGS) & set(actor_env(2, True, "jemalloc"))         # a GPU learner
    assert {k: rollout_env(2, False)[k] for k in glibc} == glibc and "LD_PRELOAD" not in rollout_env(2, False)
    assert not set(SETTINGS) & set(rollout_env(2, True))                   # a GPU rollout actor
    with pytest.raises(ValueError, match="trainer.cpu_allocator='tcmalloc'"):
        malloc_env(False, "tcmalloc")


def test_a_value_the_user_set_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert actor_env(1, False, "glibc")["MALLOC_MMAP_MAX_"] == "65536"
    assert actor_env(1, False, "glibc")["MALLOC_TRIM_THRESHOLD_"] == str(2**40)
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:1000")
    if jemalloc_library():
        assert actor_env(1, False, "jemalloc")["MALLOC_CONF"] == "dirty_decay_ms:1000"
    # a preload of the user's own: no jemalloc of ours on top, glibc's settings instead
    monkeypatch.setenv("LD_PRELOAD", "/opt/my/libtcmalloc.so")
    env = actor_env(1, False, "jemalloc")
    assert "LD_PRELOAD" not in env and env["MALLOC_MMAP_MAX_"] == "65536"


@needs_jemalloc
def test_a_preload_missing_on_the_node_falls_back_to_glibc_s_kept_heap(monkeypatch):
    """The jemalloc path is the driver's: where an actor's node lacks it, the loader skips the
    preload and the glibc settings sent beside it keep freed memory all the same. The learner's
    own settings, with only the library's path moved away."""
    for key in SETTINGS:
        monkeypatch.delenv(key, raising=False)
    env = {**malloc_env(False, "jemalloc"), "LD_PRELOAD": "/nonexistent/ray/core/libjemalloc.so"}
    out = _second_round(env)
    assert not out["jemalloc"] and out["faults"] < 0.01 * ((256 << 20) // os.sysconf("SC_PAGE_SIZE")), out


@pytest.mark.parametrize("allocator", [pytest.param("jemalloc", marks=needs_jemalloc), "glibc"])
def test_the_settings_reuse_a_freed_large_block_without_page_faults(allocator):
    default = _second_round({})
    kept = _second_round(malloc_env(False, allocator))
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert default["faults"] > 0.9 * pages and not default["jemalloc"], default  # unmapped at free
    assert kept["faults"] < 0.01 * pages, kept       # the same pages, already mapped
    assert kept["jemalloc"] == (allocator == "jemalloc"), kept


# ---- trainer/heap.py: the bound on what the kept heap holds ------------------------------------

def test_heap_cap_trims_only_past_its_factor_of_the_first_update(monkeypatch):
    import trainer.heap as heap

    calls = []
    sizes = iter([100, 140, 150, 151, 90])  # resident bytes after each update
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(sizes))
    cap = heap.HeapCap(factor=1.5, active=True)
    cap.release = lambda: calls.append(0)
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
lib = ctypes.CDLL(None); lib.malloc.restype = ctypes.c_void_p
cap = HeapCap(factor=1.5)
cap.after_update()                                      # the first update: the baseline
blocks = [lib.malloc(64 << 20) for _ in range(8)]       # 512 MiB, kept when freed...
for b in blocks: ctypes.memset(b, 1, 64 << 20)
for b in blocks[:-1]: lib.free(ctypes.c_void_p(b))      # ...freed under a live block: kept resident
held = resident_bytes()
trimmed = cap.after_update()
print(json.dumps({"active": cap.active, "allocator": cap.allocator, "trimmed": trimmed, "held": held,
                  "after": resident_bytes(), "baseline": cap.baseline}))
"""


@pytest.mark.parametrize("allocator", [pytest.param("jemalloc", marks=needs_jemalloc), "glibc"])
def test_a_trim_gives_the_kept_free_blocks_back_to_the_system(allocator):
    """glibc's malloc_trim(0) or jemalloc's purge of every arena, whichever malloc the process runs."""
    env = {**_clean_env(), **malloc_env(False, allocator), "PYTHONPATH": os.getcwd()}
    out = json.loads(subprocess.run([sys.executable, "-c", _TRIM], env=env, capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["active"] and out["trimmed"] and out["allocator"] == allocator, out
    assert out["held"] > out["baseline"] + (400 << 20), out     # the freed 448 MiB stayed resident
    assert out["after"] < out["held"] - (400 << 20), out        # the release gave it back
