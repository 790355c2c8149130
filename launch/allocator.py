"""glibc malloc settings of CPU learner processes: freed memory is kept for reuse.

glibc serves every allocation over 32 MiB (its largest mmap threshold) with a fresh `mmap` and
unmaps it again when it is freed, so an allocation of the same size in the next step takes a page
fault on each of its 4 KiB pages while it is first written. A CPU learner step makes several such
allocations: ZeRO's fp32 copy of the flat gradient (4 bytes x every parameter: 538 MB on
SmolLM2-135M, 0.8 s to fill through page faults against 0.03 s into memory already touched),
the embedding's gradient, the LM head's [1024 tokens x vocab] logit chunks. With mmap switched off
(`MALLOC_MMAP_MAX_=0`) every allocation comes from the heap, and with the trim threshold out of
reach freed memory stays mapped, so the next step reuses pages it already touched. What the kept
heap may hold is bounded by the learner (trainer/heap.py: past 1.5x its size after the first
update it is trimmed). (`MALLOC_ARENA_MAX=1` on top, one heap for every thread, measured slower on
the recipe: train phase 5.36 and 6.31 s against 5.21 and 4.24 s, runs in turn; it is not set.)

Measured by `bench.allocator` (bench/results/allocator.json; a 2-core host, SmolLM2-135M, one GRPO
update of 8 chat prompts x 4 samples, shared-prefix layout, the median step of two processes per
setting taking turns): bf16 train step 4.63 -> 2.83 s (1.63x), fp32 8.13 -> 5.74 s (1.42x); peak
RSS 5.44 -> 5.99 GiB (bf16) and 6.48 -> 8.01 GiB (fp32): the heap's fragments are held, not returned.
A rollout step (vLLM-CPU, its KV cache allocated once) changed within noise when tried, so rollout
actors keep glibc's defaults and no kept heap grows there. A GPU process keeps its large tensors
on the device, so its actors are left as they are. A value the user set in the environment wins
(`os.environ` is read first). The settings themselves are `trainer.heap.KEEP_FREED_MEMORY`, beside
the bound that reads them.
"""

from __future__ import annotations

import os

from trainer.heap import KEEP_FREED_MEMORY


def malloc_env(gpu: bool) -> dict[str, str]:
    """The malloc settings a CPU learner actor starts with (none on a GPU actor), each unless the
    driver's environment sets it."""
    if gpu:
        return {}
    return {key: os.environ.get(key, value) for key, value in KEEP_FREED_MEMORY.items()}
