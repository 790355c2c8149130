"""The driver's side of the collective transport (`trainer.weight_sync=collective`): NCCL between
GPUs, gloo otherwise. Its two ends are `rl.wire.collective.CollectiveSender` (in every learner
rank) and `CollectiveReceiver` (in every rollout process that holds weights: each vLLM worker of
a tensor-parallel engine at its own rank). Rank 0 broadcasts the buckets as the learner exports
them (every learner rank iterates, as ZeRO-3 gathering is collective); each worker loads them as
they arrive. A replaced worker means a new group: `_join` makes another, and each end closes its
old group first.
"""

from __future__ import annotations

from rl.plan.devices import collective_backend
from rl.wire.collective import CollectiveSender
from trainer.sync.base import Pushed, WeightSync


def sync_backend(devices: list[str]) -> str:
    """The group's backend from the devices its members were given (learner rank 0, then each
    rollout worker): NCCL when every one is on a GPU, else gloo (GPU members feed it host copies)."""
    return collective_backend("cuda" if devices and all(d == "cuda" for d in devices) else "cpu")


class CollectiveSync(WeightSync):
    """`delta_max_fraction`: delta syncs (`trainer.delta_sync`), None: every sync whole."""

    sender = CollectiveSender

    def __init__(self, learner, metas, rollout, ranks_per_engine=1, deadlines=None,
                 delta_max_fraction: float | None = None):
        super().__init__(learner, metas, rollout, ranks_per_engine, deadlines)
        self.delta_max_fraction = delta_max_fraction

    def make_sender(self) -> CollectiveSender:
        return CollectiveSender(self.delta_max_fraction)

    def _join(self) -> dict[int, str]:
        learner, rollout, tp = self.learner, self.rollout, self.ranks_per_engine
        rank0 = learner.handles[0]
        host = learner.where[0]["ip"]  # rank 0's node hosts the rendezvous
        port = self.on_learner([rank0.sender_call.remote("free_port")], "weight-sync join")[0]
        backend = sync_backend([learner.where[0].get("device", "cpu"), *(w.get("device", "cpu") for w in rollout.where)])
        world = 1 + tp * len(rollout.handles)  # a TP engine's vLLM workers: ranks 1+i*TP .. (i+1)*TP
        mine = rank0.sender_call.remote("join", host, port, world, backend)
        delta = self.delta_max_fraction is not None
        out = rollout.gather({i: w.join_weight_sync.remote(host, port, 1 + i * tp, world, backend, self.metas, delta)
                              for i, w in enumerate(rollout.handles)}, "weight-sync join", propagate_raised=True)
        if out.failed:
            return out.failed  # rank 0's join times out on its own; the next join closes its group
        self.on_learner([mine], "weight-sync join")
        return {}

    def push(self, version: int, full: bool = False) -> Pushed:
        learner, rollout = self.learner, self.rollout
        # Rank 0 waits for each broadcast at most half the sync's deadline: a stopped receiver
        # makes it raise (NCCL would otherwise only queue the broadcast and report it sent), by
        # the time the driver below has found the receiver silent and waits on rank 0.
        wait_s = self.deadlines.of("weight sync") / 2
        sends = [w.sender_call.remote("send", wait_s, full) for w in learner.handles]
        out = rollout.gather({i: w.receive_weights.remote(version) for i, w in enumerate(rollout.handles)},
                             "weight sync")
        # A stopped receiver holds rank 0's broadcast: end it (gloo then fails the broadcast at
        # once; NCCL at rank 0's wait), and the group is made again without it.
        for i in out.failed:
            rollout.kill(i)
        sent = self.on_learner(sends, "weight sync", tolerate_errors=bool(out.failed or out.raised))
        return Pushed(sent[0] or 0.0, out.results, out.failed, out.raised)
