"""Weight sync through Ray's object store (`trainer.weight_sync=object_store`): learner rank 0
puts its whole weights in its node's object store and every rollout worker reads them from
there (Ray resolves the reference in the worker), so the driver never holds them. The simplest
transport and the one that needs nothing joined; it copies the model once more than a collective.
"""

from __future__ import annotations

from trainer.sync.base import WeightSync


class StateSender:
    """The learner side: the whole weights as a CPU state dict at rank 0 (every rank calls it:
    ZeRO-3 gathering is collective)."""

    def bind(self, export, rank: int, device) -> None:
        self.export = export

    def state(self):
        return self.export.state_dict()

    def close(self) -> None:
        pass


class ObjectStoreSync(WeightSync):
    sender = StateSender

    def push(self, version: int, full: bool = False):
        learner, fleet = self.learner, self.fleet
        states = [w.sender_call.remote("state") for w in learner.workers]  # rank 0's ref goes to the workers
        reports, failed = fleet.wait({i: w.load_weights_from_object.remote(states[0], version)
                                      for i, w in enumerate(fleet.workers)}, "weight sync")
        learner.call(states[1:], "weight sync")
        return self.bytes_per_sync, reports, failed, {}
