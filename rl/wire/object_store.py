"""The object-store transport (`trainer.weight_sync=object_store`), all three sides: learner rank
0 puts its whole weights in its node's object store as a CPU state dict (`StateSender`), every
rollout worker loads them from the reference Ray resolves in it (`StateReceiver`), and the
driver's `ObjectStoreSync` hands rank 0's reference to the workers, so the driver never holds
the weights. Needs nothing joined; it copies the model once more than a collective.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from rl.wire.base import Exported, Pushed, SendOrder, WeightSync


class StateSender:
    """The learner side: the whole weights as a CPU state dict at rank 0, None elsewhere (every
    rank sends: ZeRO-3 gathering is collective). A `WeightSender[None, dict | None]`."""

    def bind(self, export: Exported, rank: int, device: Any) -> None:
        self.export = export

    def join(self, link: None) -> None:
        """Nothing to join."""

    def send(self, order: SendOrder) -> dict[str, torch.Tensor] | None:
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


class ObjectStoreSync(WeightSync):
    """The driver's side: rank 0's reference goes to every worker (Ray resolves it there)."""

    def make_sender(self) -> StateSender:
        return StateSender()

    def push(self, version: int, full: bool = False) -> Pushed:
        states = [w.sync_send.remote(SendOrder(version)) for w in self.learner.handles]
        out = self.rollout.gather({i: w.load_weights_from_object.remote(states[0], version)
                                   for i, w in enumerate(self.rollout.handles)}, "weight sync", propagate_raised=True)
        self.on_learner(states[1:], "weight sync")
        return Pushed(self.bytes_per_sync, out.results, out.failed)
