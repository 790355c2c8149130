"""A CPU ZeRO-1/2 optimizer step that flattens the gradients into one fp32 buffer kept for the run.

DeepSpeed's ZeRO-1/2 step (`DeepSpeedZeroOptimizer.step`, deepspeed==0.19.8) flattens the rank's
gradients into a new flat tensor and converts that to a new fp32 one, each the size of the rank's
whole partition (SmolLM2-135M in bf16: 269 MB, then 538 MB), every step, and frees both after the
update. On a CPU the learner's kept heap (trainer/heap.py) rarely has a free block that large left
in one piece once the next forward has carved up the last one, so the conversion touches fresh
pages: on the SmolLM2 recipe (2-core AMX host) it took 0.5-1.0 s of a 1.2-1.8 s step with 65-131k
page faults, against 0.08 s for the fused AdamW update itself. Here, for the length of `step`, the
optimizer's `flatten` writes the gradients straight into an fp32 buffer per partition size, made
on the first step and reused (one pass, no bf16 intermediate); DeepSpeed's `.to(fp32)` then
returns that buffer as it is, and the update is the same to the bit (tests/test_zero_grads.py).
The buffer stays resident between steps, as the memory plan has always counted the fp32 gradient
partition (rl/plan/memory_plan.py `_trainable_parts`).

Only a CPU optimizer without offload is changed: a GPU's caching allocator reuses freed blocks
without faults, and offload keeps its own fp32 gradient buffers already.
"""

from __future__ import annotations

from typing import Any

import torch


def _flat_into(kept: dict[int, torch.Tensor], dtype: torch.dtype, sizes: set[int], fallback):
    """A `flatten(tensors)` that writes a partition-sized gradient list into `kept`'s buffer of
    its size (made on first use); any other list goes to `fallback` (DeepSpeed's own)."""

    def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
        total = sum(t.numel() for t in tensors)
        if total not in sizes or not tensors or any(t.device.type != "cpu" for t in tensors):
            return fallback(tensors)
        buffer = kept.get(total)
        if buffer is None:
            buffer = kept[total] = torch.empty(total, dtype=dtype)
        return torch.cat([t.reshape(-1) for t in tensors], out=buffer)

    return flatten


def keep_fp32_gradients(optimizer: Any) -> bool:
    """Make `optimizer` (a DeepSpeed ZeRO-1/2 optimizer on the CPU, no offload) flatten each step's
    gradient partition into a kept fp32 buffer; True when installed. Anything else is left as it is."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    masters = optimizer.single_partition_of_fp32_groups
    if not masters or any(m.device.type != "cpu" for m in masters):
        return False
    dtypes = {m.dtype for m in masters}
    if len(dtypes) != 1:
        return False
    kept: dict[int, torch.Tensor] = {}
    sizes = {int(n) for n in optimizer.partition_size}
    step = optimizer.step
    original_flatten = optimizer.flatten
    into_kept = _flat_into(kept, dtypes.pop(), sizes, original_flatten)

    def step_with_kept_gradients(*args, **kwargs):
        optimizer.flatten = into_kept  # only while stepping: the reduction keeps DeepSpeed's own
        try:
            return step(*args, **kwargs)
        finally:
            optimizer.flatten = original_flatten

    optimizer.step = step_with_kept_gradients
    optimizer._rlpost_kept_gradients = kept  # for tests and the memory accounting
    return True


def kept_gradient_bytes(optimizer: Any) -> int:
    """Bytes of the fp32 gradient buffers `keep_fp32_gradients` keeps on `optimizer` (0: none)."""
    kept = getattr(optimizer, "_rlpost_kept_gradients", None) or {}
    return sum(t.numel() * t.element_size() for t in kept.values())
