"""Weight sync over a collective (`trainer.weight_sync=collective`): NCCL between GPUs, gloo
otherwise (the wire format is `rl/wire/weight_sync.py`).

One process group joins learner rank 0 (group rank 0) and every rollout worker: each vLLM worker
of a tensor-parallel engine at its own rank. Rank 0 broadcasts the buckets as the learner
exports them (every learner rank iterates, as ZeRO-3 gathering is collective); each worker loads
them as they arrive. A replaced worker means a new group: `_join` aborts the old one on both
sides and makes another.
"""

from __future__ import annotations

from datetime import timedelta

import ray

from rl.plan.devices import collective_backend
from rl.wire import weight_sync
from trainer.sync.base import WeightSync


def sync_backend(devices: list[str]) -> str:
    """The group's backend from the devices its members were given (learner rank 0, then each
    rollout worker): NCCL when every one is on a GPU, else gloo (GPU members feed it host copies)."""
    return collective_backend("cuda" if devices and all(d == "cuda" for d in devices) else "cpu")


class CollectiveSender:
    """The learner side, in every learner rank: rank 0 is group rank 0 and broadcasts; the other
    ranks only take part in ZeRO-3's gathers. `delta_max_fraction` (`trainer.delta_sync`): send
    each bucket's change since the last sync (`rl.wire.weight_sync.DeltaSender`); None: whole."""

    def __init__(self, delta_max_fraction: float | None = None) -> None:
        self.group: weight_sync.SyncGroup | None = None
        self.on_host = False
        self.delta = None if delta_max_fraction is None else weight_sync.DeltaSender(delta_max_fraction)

    def bind(self, export, rank: int, device) -> None:
        self.export, self.rank, self.device = export, rank, device

    def address(self) -> tuple[str, int]:
        """An address on this rank's node with a free port (rank 0 hosts the rendezvous)."""
        return ray.util.get_node_ip_address(), weight_sync.free_port()

    def join(self, host: str, port: int, world_size: int, backend: str) -> None:
        weight_sync.close_group(self.group)  # the group of the fleet before a replacement
        self.group = weight_sync.init_group(host, port, 0, world_size, backend)
        self.on_host = backend == "gloo" and self.device.type == "cuda"  # gloo sends host tensors
        if self.delta is not None:
            self.delta.reset()  # new members hold nothing: the next sync goes whole

    def send(self, wait_s: float | None = None, full: bool = False) -> float:
        """Every rank; rank 0 broadcasts, waiting at most `wait_s` for each bucket to arrive (a
        stopped receiver: this raises); `full`: whole buckets even with delta syncs. Returns the
        bytes sent."""
        if self.rank == 0 and wait_s:
            self.group.wait_timeout = timedelta(seconds=wait_s)
        with self.export.resident():
            tensors = ([t.cpu() if self.on_host else t for _, t in bucket] for bucket in self.export.buckets())
            if self.rank != 0:
                for _ in tensors:  # ZeRO-3: every rank takes part in each gather
                    pass
                return 0.0
            if self.delta is not None:
                return float(self.delta.send(self.group, tensors, full)["bytes"])
            weight_sync.send(self.group, tensors)
        return self.export.nbytes()

    def close(self) -> None:
        weight_sync.close_group(self.group)
        self.group = None


class CollectiveSync(WeightSync):
    """`delta_max_fraction`: delta syncs (`trainer.delta_sync`), None: every sync whole."""

    sender = CollectiveSender

    def __init__(self, learner, fleet, deadlines=None, delta_max_fraction: float | None = None):
        super().__init__(learner, fleet, deadlines)
        self.delta_max_fraction = delta_max_fraction

    def make_sender(self) -> CollectiveSender:
        return CollectiveSender(self.delta_max_fraction)

    def _join(self) -> None:
        learner, fleet = self.learner, self.fleet
        while True:
            rank0 = learner.workers[0]
            host, port = learner.call([rank0.sender_call.remote("address")], "weight-sync join")[0]
            backend = sync_backend([learner.where[0].get("device", "cpu"),
                                    *(w.get("device", "cpu") for w in fleet.where)])
            tp = fleet.spec.rollout.tensor_parallel_size  # a TP engine's vLLM workers: ranks 1+i*TP .. (i+1)*TP
            world = 1 + tp * len(fleet.workers)
            mine = rank0.sender_call.remote("join", host, port, world, backend)
            _, failed = fleet.wait({i: w.join_weight_sync.remote(host, port, 1 + i * tp, world, backend,
                                                                 learner.metas, self.delta_max_fraction is not None)
                                    for i, w in enumerate(fleet.workers)}, "weight-sync join")
            if not failed:
                learner.call([mine], "weight-sync join")
                return
            fleet.replace(failed, "weight-sync join")  # raises once its replacements are used up

    def push(self, version: int, full: bool = False):
        learner, fleet = self.learner, self.fleet
        # Rank 0 waits for each broadcast at most half the sync's deadline: a stopped receiver
        # makes it raise (NCCL would otherwise only queue the broadcast and report it sent), by
        # the time the driver below has found the receiver silent and waits on rank 0.
        wait_s = self.deadlines.of("weight sync") / 2
        sends = [w.sender_call.remote("send", wait_s, full) for w in learner.workers]
        broken: dict[int, str] = {}
        reports, failed = fleet.wait({i: w.receive_weights.remote(version) for i, w in enumerate(fleet.workers)},
                                     "weight sync", errors=broken)
        # A stopped receiver holds rank 0's broadcast: end it (gloo then fails the broadcast at
        # once; NCCL at rank 0's wait), and the group is made again without it.
        for i in failed:
            ray.kill(fleet.workers[i], no_restart=True)
        sent = learner.call(sends, "weight sync", tolerate_errors=bool(failed or broken))
        return (sent[0] or 0.0), reports, failed, broken
