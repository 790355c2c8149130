"""The collective transport's two ends, side by side (`trainer.weight_sync=collective`): the
learner's `CollectiveSender` and the rollout side's `CollectiveReceiver`. One process group
(NCCL between GPUs, gloo otherwise; the wire format is `rl/wire/weight_sync.py`) joins learner
rank 0 (group rank 0) and every rollout process that holds weights: a rollout worker's engine in
its own process, or each tensor-parallel shard of a vLLM engine at its own rank. Every one of
those uses the same `CollectiveReceiver` (rollout/worker.py, rollout/vllm_worker.py); the driver's
side, which makes the group and drives a sync, is trainer/sync/collective.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch

from rl.wire import weight_sync
from rl.wire.weight_sync import WeightMeta


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

    def free_port(self) -> int:
        """A free port on this rank's node (rank 0 hosts the group's rendezvous)."""
        return weight_sync.free_port()

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


class CollectiveReceiver:
    """A rollout process's end: joins the group at its rank and loads each broadcast bucket by
    bucket as it arrives (two bucket buffers, never a second copy of the model). `merger`
    (`rl.wire.lora.AdapterMerger`, with `model.lora`): syncs carry adapters, merged into the base
    weights it keeps."""

    def __init__(self) -> None:
        self.group: weight_sync.SyncGroup | None = None
        self.backend, self.metas = "gloo", []
        self.delta: weight_sync.DeltaReceiver | None = None
        self.merger = None

    @property
    def joined(self) -> bool:
        return self.group is not None

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, metas: list[WeightMeta],
             delta: bool = False, merger: Any = None) -> None:
        """Join at `rank` (a group of the fleet before a replacement is closed first). `delta`:
        syncs send changes, applied to a copy of the weights kept here."""
        self.close()
        self.group = weight_sync.init_group(host, port, rank, world_size, backend)
        self.backend, self.metas, self.merger = backend, metas, merger
        self.delta = weight_sync.DeltaReceiver() if delta else None

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], None], device) -> dict[str, float]:
        """Take rank 0's broadcast, handing (name, tensor) pairs to `load` as they arrive (merged
        with LoRA) on `device` (host memory with gloo). Returns receive_s (in the broadcasts),
        bytes, total_s and, with delta syncs, delta_mismatch (buckets whose checksum disagreed)."""
        if self.group is None:
            raise RuntimeError("a weight sync before joining its group: the fleet was not connected")
        started = time.perf_counter()
        stats: dict[str, float] = {"receive_s": 0.0, "bytes": 0.0}
        receive = weight_sync.receive if self.delta is None else self.delta.receive
        tensors = receive(self.group, self.metas, device if self.backend == "nccl" else "cpu", stats=stats)
        try:
            load(tensors if self.merger is None else self.merger.merged(tensors))
        finally:
            # A load that failed part-way still takes the remaining buckets, so rank 0's broadcast
            # completes (and the group stays usable) instead of waiting out its timeout.
            for _ in tensors:
                pass
        stats["total_s"] = time.perf_counter() - started
        return stats

    def close(self) -> None:
        weight_sync.close_group(self.group)
        self.group = None
