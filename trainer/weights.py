"""What a weight sync sends, as one learner rank sees it: the policy's tensors, whole.

The learner's only part in a weight sync is to export tensors; how they travel (a collective,
Ray's object store, CUDA IPC) and who receives them is the weight sync's business
(`trainer/sync/`). Under ZeRO-3 a parameter is whole only while gathered, and gathering is
collective, so every rank iterates `buckets()` in step (the others get the same buckets and
ignore them). With LoRA only the adapters travel, under their wire names (`rl/wire/lora.py`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterator

import torch

from rl.wire import weight_sync
from rl.wire.weight_sync import WeightMeta


class WeightExport:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], rank: int, zero_stage: int,
                 resident: Callable[[], AbstractContextManager] = nullcontext):
        """`named`: (wire name, parameter) in the order every sync sends them; `resident`: a
        context in which the rank's weights are on its device (hybrid placement offloads them)."""
        self.named, self.rank, self.zero_stage, self.resident = named, rank, zero_stage, resident

    def metas(self) -> list[WeightMeta]:
        """Names, whole shapes and dtypes: what receivers preallocate and check against."""
        return [WeightMeta(name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."))
                for name, p in self.named]

    def nbytes(self) -> float:
        return float(sum(m.nbytes for m in self.metas()))

    def _gathered(self, indices: list[int]):
        """Context in which the listed parameters are whole (ZeRO-3 gathers them; others: no-op)."""
        if self.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([self.named[i][1] for i in indices], modifier_rank=None)

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Whole tensors bucket by bucket (`rl.wire.weight_sync.buckets`); every rank iterates."""
        for bucket in weight_sync.buckets(self.metas()):
            with self._gathered(bucket):
                yield [(self.named[i][0], self.named[i][1].data) for i in bucket]

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """Whole weights copied to CPU at rank 0 (None elsewhere); every rank calls it."""
        out: dict[str, torch.Tensor] = {}
        with self.resident():
            for bucket in self.buckets():
                if self.rank == 0:
                    out.update((name, t.detach().cpu().clone()) for name, t in bucket)
        return out if self.rank == 0 else None
