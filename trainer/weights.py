"""What a weight sync sends, as one learner rank sees it: the policy's tensors, whole.

The learner's only part in a weight sync is to export tensors; how they travel (a collective,
Ray's object store, CUDA IPC) and who receives them is the weight sync's business
(`rl/wire/`). Under ZeRO-3 a parameter is whole only while gathered, and gathering is
collective, so every rank iterates `buckets()` in step (the others get the same buckets and
ignore them). With LoRA only the adapters travel, under their wire names (`rl/wire/lora.py`).

Tensors travel in the model's checkpoint layout, the one vLLM loads from disk. For most models
that is the layout in memory; transformers 5 fuses some on load (a MoE's experts become one
`experts.gate_up_proj` tensor [experts, 2 x inner, hidden]) and `checkpoint_layout` undoes it
with transformers' own reverse conversion, one parameter at a time (so a bucket's sources are
copied once, never the whole model).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterator

import torch

from rl.wire import format as wire
from rl.wire.format import WeightMeta


Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def checkpoint_layout(model) -> Convert | None:
    """transformers' reverse of the conversions `model` went through on load (None when there
    are none): a function from in-memory tensors to the tensors its checkpoint would hold."""
    from transformers.core_model_loading import revert_weight_conversion

    probe = {n: torch.empty(tuple(getattr(p, "ds_shape", p.shape)), device="meta") for n, p in model.named_parameters()}
    if revert_weight_conversion(model, dict(probe)).keys() == probe.keys():
        return None
    return lambda tensors: revert_weight_conversion(model, tensors)


class WeightExport:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], rank: int, zero_stage: int,
                 resident: Callable[[], AbstractContextManager] = nullcontext, convert: Convert | None = None):
        """`named`: (name, parameter) in the order every sync sends them; `resident`: a context
        in which the rank's weights are on its device (hybrid placement offloads them);
        `convert`: in-memory to checkpoint layout (`checkpoint_layout`), None where they agree."""
        self.named, self.rank, self.zero_stage, self.resident = named, rank, zero_stage, resident
        self.convert = convert
        # What each parameter is sent as: (wire meta, index of its parameter), in sending order.
        self._wire: list[tuple[WeightMeta, int]] = []
        for i, (name, p) in enumerate(named):
            shape, dtype = tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch.")
            outs = {name: torch.empty(shape, device="meta")} if convert is None else \
                convert({name: torch.empty(shape, device="meta")})
            self._wire += [(WeightMeta(n, tuple(t.shape), dtype), i) for n, t in outs.items()]
        if convert is not None:
            self._check_per_parameter(named)

    def _check_per_parameter(self, named) -> None:
        """Converting parameter by parameter must give what converting them together gives: a
        conversion that joins several parameters into one checkpoint tensor is not supported."""
        whole = self.convert({n: torch.empty(tuple(getattr(p, "ds_shape", p.shape)), device="meta")
                              for n, p in named})
        apart = {m.name: m.shape for m, _ in self._wire}
        if {n: tuple(t.shape) for n, t in whole.items()} != apart:
            joined = sorted(set(whole) - set(apart))[:3]
            raise ValueError(f"this model's checkpoint layout joins several in-memory parameters into one "
                             f"tensor ({', '.join(joined)}); the weight sync exports one parameter at a time "
                             "and does not support it: use model.lora, or a model without this conversion")

    def metas(self) -> list[WeightMeta]:
        """Names, whole shapes and dtypes in checkpoint layout: what receivers preallocate and check against."""
        return [meta for meta, _ in self._wire]

    def _tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter `i` (whole: inside `_gathered`) in checkpoint layout."""
        name, p = self.named[i]
        return {name: p.data} if self.convert is None else self.convert({name: p.data})

    def nbytes(self) -> float:
        return float(sum(m.nbytes for m in self.metas()))

    def _gathered(self, indices: list[int]):
        """Context in which the listed parameters are whole (ZeRO-3 gathers them; others: no-op)."""
        if self.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([self.named[i][1] for i in indices], modifier_rank=None)

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Whole tensors bucket by bucket (`rl.wire.format.buckets` of `metas()`); every rank
        iterates. A parameter that converts to several tensors may span buckets (gathered in each)."""
        for bucket in wire.buckets(self.metas()):
            sources = sorted({self._wire[j][1] for j in bucket})
            with self._gathered(sources):
                tensors: dict[str, torch.Tensor] = {}
                for i in sources:
                    tensors.update(self._tensors(i))
                yield [(self._wire[j][0].name, tensors[self._wire[j][0].name]) for j in bucket]

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """Whole weights copied to CPU at rank 0 (None elsewhere); every rank calls it."""
        out: dict[str, torch.Tensor] = {}
        with self.resident():
            for bucket in self.buckets():
                if self.rank == 0:
                    out.update((name, t.detach().cpu().clone()) for name, t in bucket)
        return out if self.rank == 0 else None
