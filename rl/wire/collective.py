"""The collective transport (`trainer.weight_sync=collective`), all three sides: one process
group (NCCL between GPUs, gloo otherwise) joins learner rank 0 (group rank 0) and every rollout
process that holds weights: a rollout worker's engine in its own process, or each tensor-parallel
shard of a vLLM engine at its own rank.

- the group: `init_group` makes it from a TCP store of its own, without
  `torch.distributed.init_process_group`, so it does not touch the default group that DeepSpeed
  and vLLM each use in their own process; `send` broadcasts from rank 0 one bucket at a time, each
  as one flat tensor in the order of the `WeightMeta` list both sides agreed on when they joined
  (the wire format: rl/wire/format.py; with `trainer.delta_sync` only what changed:
  rl/wire/delta.py); `receive` is a generator over three bucket buffers used in turn, so a rollout
  engine loading from it never holds a second full copy of the weights
  (`tests/test_weight_sync.py` measures it);
- the learner's side: `CollectiveSender`, in every learner rank (rank 0 broadcasts; the others
  take part in ZeRO-3's gathers);
- the rollout side: `CollectiveReceiver`, the same in every receiving process
  (rollout/worker.py, rollout/vllm_worker.py);
- the driver's side: `CollectiveSync`, which makes the group and drives a sync. A replaced worker
  means a new group: `_join` makes another, and each end closes its old group first.

Plain torch: no Ray, DeepSpeed or vLLM here.
"""

from __future__ import annotations

import socket
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

import torch

from rl.wire.base import Exported, Pushed, SendOrder, WeightSync
from rl.wire.delta import DeltaReceiver, DeltaSender
from rl.wire.format import BUCKET_BYTES, WeightMeta, buckets, flat_bucket, kept_buffer


# ---- the group ----------------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on this node (a rendezvous: this group's, or a data-parallel one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class SyncGroup:
    """A weight-sync process group, and how long one broadcast may wait for its peers."""

    pg: Any  # torch's ProcessGroupGloo / ProcessGroupNCCL backend
    wait_timeout: timedelta

    def broadcast(self, flat: torch.Tensor) -> None:
        """Broadcast `flat` from rank 0 and return once it has happened here."""
        self.finish(self.start(flat), flat)

    def start(self, flat: torch.Tensor) -> Any:
        """Post the broadcast of `flat` from rank 0 and return at once (its work handle): the
        transfer proceeds in the backend's own thread (gloo) or stream (NCCL), ordered after
        every op already queued here, while this thread goes on."""
        return self.pg.broadcast(flat, root=0)

    def finish(self, work: Any, flat: torch.Tensor) -> None:
        """Wait for a posted broadcast. NCCL's plain `wait()` only orders the current CUDA stream
        after the broadcast: a peer that stopped would leave the caller reporting success while
        its stream hangs, and every later kernel (the next sync, a training step) queued behind
        it. With a timeout `wait` blocks this thread until the broadcast completes or raises at
        the timeout; the stream is then synchronized, so timings measure the transfer and a
        bucket buffer is reused only once sent."""
        work.wait(self.wait_timeout)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()

    def abort(self) -> None:
        """Tear the communicator down (NCCL: ncclCommAbort, which ends a broadcast stuck on a
        lost peer and frees its GPU memory) instead of leaving it to the garbage collector. A gloo
        member blocked in a broadcast is not released by this (measured): it fails at its timeout."""
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - already broken or closed: nothing more to free
            pass


def init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 600.0) -> SyncGroup:
    """Join the weight-sync group; every member calls this with the same host/port/size. Rank 0
    hosts the TCP store. A broadcast whose peer is gone or stuck raises after `timeout_s`; NCCL's
    own watchdog (which ends the process) is set to twice that, so the error comes first and the
    group can be aborted and made again."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"rlpost-weight-sync-{port}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = 2 * timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"weight-sync backend {backend!r}: choose gloo or nccl")
    return SyncGroup(pg, timeout)


def close_group(group: SyncGroup | None) -> None:
    """Abort a weight-sync group that is being replaced (None: there is none yet)."""
    if group is not None:
        group.abort()


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the group meets: what the driver hands learner rank 0's sender at a join."""

    host: str
    port: int
    world_size: int
    backend: str


def sync_backend(devices: list[str]) -> str:
    """The group's backend from the devices its members were given (learner rank 0, then each
    rollout worker): NCCL when every one is on a GPU, else gloo (GPU members feed it host copies)."""
    return "nccl" if devices and all(d == "cuda" for d in devices) else "gloo"


def send(group, tensors_by_bucket: Iterable[list[torch.Tensor]]) -> None:
    """Rank 0: broadcast each bucket as one flat tensor (`rl.wire.format.flat_bucket`)."""
    for tensors in tensors_by_bucket:
        flat = flat_bucket(tensors)
        group.broadcast(flat)
        del flat


def _rehome(refs: list[weakref.ref]) -> None:
    """Give each tensor still alive its own copy of its data (it was a view of a bucket buffer)."""
    for ref in refs:
        held = ref()
        if held is not None:
            held.data = held.clone()
        held = None


# Buffers a receiver fills in turn: the bucket the consumer loads, the next one arriving meanwhile,
# and the one before, whose tensors a loader may still hold (a layer not yet complete).
RECEIVE_SLOTS = 3


def receive(group, metas: list[WeightMeta], device: str | torch.device = "cpu", *, limit: int = BUCKET_BYTES,
            stats: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..N: yield (name, tensor) in `metas` order as the buckets arrive (`limit`: the
    sender's bucket size). A lazy generator for a consumer that loads tensor by tensor (vLLM's
    `reload_weights`). The next bucket's broadcast is in flight while the consumer loads this one
    (on 2 cores a full SmolLM2 sync into vLLM: 1.11 s, 0.87x a bare broadcast plus reload, against
    1.17 s and 0.67x receiving and loading in turn; `python -m bench.bounds --only sync`, fp32,
    docs/benchmarks.md). The tensors are views of `RECEIVE_SLOTS` kept
    buffers used in turn; before a buffer takes a new bucket, a tensor of its old one that the
    consumer still keeps (a layer spanning buckets, not yet loaded) is given a copy of its own.
    `stats` (optional) accumulates `receive_s` (seconds waiting for broadcasts) and `bytes`."""
    plan = buckets(metas, limit)
    handed_out: list[list[weakref.ref]] = [[] for _ in range(RECEIVE_SLOTS)]  # views of each buffer given out

    def post(k: int) -> tuple[torch.Tensor, Any]:
        slot, dtype = k % RECEIVE_SLOTS, metas[plan[k][0]].torch_dtype
        _rehome(handed_out[slot])
        handed_out[slot] = []
        total = sum(metas[i].numel for i in plan[k])
        flat = kept_buffer("receive", slot, max(total, limit // dtype.itemsize), dtype, device)[:total]
        return flat, group.start(flat)

    arriving = post(0) if plan else None
    for k, bucket in enumerate(plan):
        flat, work = arriving
        started = time.perf_counter()
        group.finish(work, flat)
        if stats is not None:
            stats["receive_s"] = stats.get("receive_s", 0.0) + time.perf_counter() - started
            stats["bytes"] = stats.get("bytes", 0.0) + flat.numel() * flat.element_size()
        arriving = post(k + 1) if k + 1 < len(plan) else None
        offset = 0
        for i in bucket:
            view = flat[offset : offset + metas[i].numel].view(metas[i].shape)
            offset += metas[i].numel
            handed_out[k % RECEIVE_SLOTS].append(weakref.ref(view))
            yield metas[i].name, view
            del view
        del flat


# ---- the learner's side --------------------------------------------------------------------------

class CollectiveSender:
    """The learner side, in every learner rank: rank 0 is group rank 0 and broadcasts; the other
    ranks only take part in ZeRO-3's gathers. `delta_max_fraction` (`trainer.delta_sync`): send
    each bucket's change since the last sync (`rl.wire.delta.DeltaSender`); None: whole. A
    `WeightSender[GroupAddress, float]`."""

    def __init__(self, delta_max_fraction: float | None = None) -> None:
        self.group: SyncGroup | None = None
        self.on_host = False
        self.delta = None if delta_max_fraction is None else DeltaSender(delta_max_fraction)

    def bind(self, export: Exported, rank: int, device: Any) -> None:
        self.export, self.rank, self.device = export, rank, device

    def join(self, link: GroupAddress) -> None:
        """Rank 0: make the group at `link` as its rank 0 (the group of the fleet before a
        replacement is closed first)."""
        close_group(self.group)
        self.group = init_group(link.host, link.port, 0, link.world_size, link.backend)
        self.on_host = link.backend == "gloo" and self.device.type == "cuda"  # gloo sends host tensors
        if self.delta is not None:
            self.delta.reset()  # new members hold nothing: the next sync goes whole

    def send(self, order: SendOrder) -> float:
        """Every rank; rank 0 broadcasts, waiting at most `order.wait_s` for each bucket to arrive
        (a stopped receiver: this raises); `order.full`: whole buckets even with delta syncs.
        Returns the bytes sent."""
        if self.rank == 0 and order.wait_s:
            self.group.wait_timeout = timedelta(seconds=order.wait_s)
        with self.export.resident():
            tensors = ([t.cpu() if self.on_host else t for _, t in bucket] for bucket in self.export.buckets())
            if self.rank != 0:
                for _ in tensors:  # ZeRO-3: every rank takes part in each gather
                    pass
                return 0.0
            if self.delta is not None:
                return float(self.delta.send(self.group, tensors, order.full)["bytes"])
            send(self.group, tensors)
        return self.export.nbytes()

    def close(self) -> None:
        close_group(self.group)
        self.group = None


# ---- the rollout side ----------------------------------------------------------------------------

class CollectiveReceiver:
    """A rollout process's end: joins the group at its rank and loads each broadcast bucket by
    bucket as it arrives (three bucket buffers, never a second copy of the model). `merger`
    (`rl.wire.lora.AdapterMerger`, with `model.lora`): syncs carry adapters, merged into the base
    weights it keeps."""

    def __init__(self) -> None:
        self.group: SyncGroup | None = None
        self.backend, self.metas = "gloo", []
        self.delta: DeltaReceiver | None = None
        self.merger = None

    @property
    def joined(self) -> bool:
        return self.group is not None

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, metas: list[WeightMeta],
             delta: bool = False, merger: Any = None) -> None:
        """Join at `rank` (a group of the fleet before a replacement is closed first). `delta`:
        syncs send changes, applied to a copy of the weights kept here."""
        self.close()
        self.group = init_group(host, port, rank, world_size, backend)
        self.backend, self.metas, self.merger = backend, metas, merger
        self.delta = DeltaReceiver() if delta else None

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], None], device) -> dict[str, float]:
        """Take rank 0's broadcast, handing (name, tensor) pairs to `load` as they arrive (merged
        with LoRA) on `device` (host memory with gloo). Returns receive_s (in the broadcasts),
        bytes, total_s and, with delta syncs, delta_mismatch (buckets whose checksum disagreed)."""
        if self.group is None:
            raise RuntimeError("a weight sync before joining its group: the fleet was not connected")
        started = time.perf_counter()
        stats: dict[str, float] = {"receive_s": 0.0, "bytes": 0.0}
        take = receive if self.delta is None else self.delta.receive
        tensors = take(self.group, self.metas, device if self.backend == "nccl" else "cpu", stats=stats)
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
        close_group(self.group)
        self.group = None


# ---- the driver's side ---------------------------------------------------------------------------

class CollectiveSync(WeightSync):
    """Rank 0 broadcasts the buckets as the learner exports them (every learner rank iterates, as
    ZeRO-3 gathering is collective); each worker loads them as they arrive.
    `delta_max_fraction`: delta syncs (`trainer.delta_sync`), None: every sync whole."""

    def __init__(self, learner, metas, rollout, ranks_per_engine=1, deadlines=None,
                 delta_max_fraction: float | None = None):
        super().__init__(learner, metas, rollout, ranks_per_engine, deadlines)
        self.delta_max_fraction = delta_max_fraction

    def make_sender(self) -> CollectiveSender:
        return CollectiveSender(self.delta_max_fraction)

    def _join(self) -> dict[int, str]:
        learner, rollout, tp = self.learner, self.rollout, self.ranks_per_engine
        rank0 = learner.handles[0]
        host, port = self.on_learner([rank0.node_address.remote()], "weight-sync join")[0]  # rank 0's node hosts it
        backend = sync_backend([learner.where[0].get("device", "cpu"), *(w.get("device", "cpu") for w in rollout.where)])
        world = 1 + tp * len(rollout.handles)  # a TP engine's vLLM workers: ranks 1+i*TP .. (i+1)*TP
        mine = rank0.sync_join.remote(GroupAddress(host, port, world, backend))
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
        order = SendOrder(version, wait_s=self.deadlines.of("weight sync") / 2, full=full)
        sends = [w.sync_send.remote(order) for w in learner.handles]
        out = rollout.gather({i: w.receive_weights.remote(version) for i, w in enumerate(rollout.handles)},
                             "weight sync")
        # A stopped receiver holds rank 0's broadcast: end it (gloo then fails the broadcast at
        # once; NCCL at rank 0's wait), and the group is made again without it.
        for i in out.failed:
            rollout.kill(i)
        sent = self.on_learner(sends, "weight sync", tolerate_errors=bool(out.failed or out.raised))
        return Pushed(sent[0] or 0.0, out.results, out.failed, out.raised)
