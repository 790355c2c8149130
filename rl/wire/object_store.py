"""The object-store transport's two ends, side by side (`trainer.weight_sync=object_store`):
learner rank 0 puts its whole weights in its node's object store as a CPU state dict
(`StateSender`), and every rollout worker loads them from the reference Ray resolves in it
(`StateReceiver`). The driver's side is trainer/sync/object_store.py. Needs nothing joined; it
copies the model once more than a collective.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


class StateSender:
    """The learner side: the whole weights as a CPU state dict at rank 0 (every rank calls it:
    ZeRO-3 gathering is collective)."""

    def bind(self, export, rank: int, device) -> None:
        self.export = export

    def state(self) -> dict[str, torch.Tensor]:
        return self.export.state_dict()

    def close(self) -> None:
        pass


class StateReceiver:
    """A rollout worker's end: hands the state dict's (name, tensor) pairs to `load` (merged into
    the kept base weights with LoRA: `merger`, an `rl.wire.lora.AdapterMerger`)."""

    @staticmethod
    def receive(state: dict[str, torch.Tensor], load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                merger: Any = None) -> dict[str, float]:
        load(state.items() if merger is None else merger.merged(state.items()))
        return {"bytes": float(sum(t.numel() * t.element_size() for t in state.values()))}
