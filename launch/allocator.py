"""The malloc of CPU learner processes: jemalloc (Ray's own copy) or glibc's, freed memory kept.

glibc serves every allocation over 32 MiB (its largest mmap threshold) with a fresh `mmap` and
unmaps it again when it is freed, so an allocation of the same size in the next step takes a page
fault on each of its 4 KiB pages while it is first written. A CPU learner step makes several such
allocations: the activations a backward keeps, the embedding's gradient, the LM head's
[1024 tokens x vocab] logit chunks (ZeRO's fp32 gradient copy, 538 MB on SmolLM2-135M, now has a
buffer of its own: trainer/zero_grads.py). Two ways to keep freed memory for the next step,
`trainer.cpu_allocator`:

- `jemalloc` (the default where it exists): the learner actor starts with `LD_PRELOAD` of the
  jemalloc library every Ray wheel ships (`ray/core/libjemalloc.so`, jemalloc 5.3; Ray preloads
  it into its own processes to profile them) and `MALLOC_CONF` that never purges freed pages.
  jemalloc's size classes reuse a freed block for the next step's block of a different size
  where glibc's single heap fragments: on `bench.vs_trl`'s SmolLM2 8x4x96 case the train phase
  took 4.20 s a step against 4.90 with glibc's kept heap in bf16 (1.17x), 7.38 against 7.81 s in
  fp32 (1.06x) (`bench.allocator --recipe`, two rounds taking turns); in one pair of 12-step bf16
  runs the learner's peak RSS was 7.7 against 8.3 GB. Where the library is absent (a Ray build
  without it) the glibc settings below are used instead.
- `glibc`: mmap off (`MALLOC_MMAP_MAX_=0`: every allocation from the heap) and the trim threshold
  out of reach, so freed memory stays mapped and the next step reuses pages it already touched.
  (`MALLOC_ARENA_MAX=1` on top, one heap for every thread, measured slower on the recipe: train
  phase 5.36 and 6.31 s against 5.21 and 4.24 s, runs in turn; it is not set.)

Either way what the process keeps is bounded by the learner (trainer/heap.py: past 1.5x its size
after the first update, the free pages go back to the system). A CPU rollout actor gets glibc's
kept heap too: a rollout step (vLLM-CPU, its KV cache allocated once) changed within noise, but
every weight sync re-materialises each layer and re-packs its GEMM weights in fresh memory, 55k
page faults a SmolLM2 sync (fp32), none with the kept heap: a sync into vLLM took 0.71-0.77 s
against 0.98-1.04 s with glibc's defaults (plain processes, runs in turn). What it keeps is the
sync's own peak, reused by the next one. A GPU process keeps its large tensors on the device, so
its actors are left as they are. A value
the user set in the environment wins (`os.environ` is read first; an `LD_PRELOAD` of their own
means no jemalloc of ours, and glibc's settings apply). The library's path is the driver's; on a
node where it does not exist the preload is skipped and glibc's settings, sent beside it, apply.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Mapping

from trainer.heap import JEMALLOC_KEEP_FREED, KEEP_FREED_MEMORY

ALLOCATORS = ("jemalloc", "glibc")


def jemalloc_library() -> str | None:
    """The jemalloc shared library of the installed Ray wheel, or None where it has none."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "core" / "libjemalloc.so"
    return str(path) if path.is_file() else None


def malloc_env(gpu: bool, allocator: str = "jemalloc", environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The malloc settings a CPU learner actor starts with (none on a GPU actor), each unless the
    driver's environment (`environ`, default `os.environ`) sets it. `allocator`: `trainer.cpu_allocator`."""
    if gpu:
        return {}
    if allocator not in ALLOCATORS:
        raise ValueError(f"trainer.cpu_allocator={allocator!r}: expected one of {', '.join(ALLOCATORS)}")
    environ = os.environ if environ is None else environ

    def unless_set(settings: Mapping[str, str]) -> dict[str, str]:
        return {key: environ.get(key, value) for key, value in settings.items()}

    library = jemalloc_library() if allocator == "jemalloc" and not environ.get("LD_PRELOAD") else None
    if library is None:
        return unless_set(KEEP_FREED_MEMORY)
    # glibc's settings ride along: jemalloc ignores them, and where the path (this driver's Ray
    # wheel) does not exist on an actor's node, the loader skips the preload with a warning and
    # glibc's heap keeps freed memory instead (`actors.json` says which malloc each learner runs)
    return {"LD_PRELOAD": library, **unless_set(JEMALLOC_KEEP_FREED), **unless_set(KEEP_FREED_MEMORY)}
