"""The driver's side of the object-store transport (`trainer.weight_sync=object_store`): learner
rank 0's whole weights go into its node's object store and every rollout worker reads them from
there (Ray resolves the reference in the worker), so the driver never holds them. Its two ends
are in rl/wire/object_store.py.
"""

from __future__ import annotations

from rl.wire.object_store import StateSender
from trainer.sync.base import Pushed, WeightSync


class ObjectStoreSync(WeightSync):
    sender = StateSender

    def push(self, version: int, full: bool = False) -> Pushed:
        states = [w.sender_call.remote("state") for w in self.learner.handles]  # rank 0's ref goes to the workers
        out = self.rollout.gather({i: w.load_weights_from_object.remote(states[0], version)
                                   for i, w in enumerate(self.rollout.handles)}, "weight sync", propagate_raised=True)
        self.on_learner(states[1:], "weight sync")
        return Pushed(self.bytes_per_sync, out.results, out.failed)
