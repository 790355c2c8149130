"""The weight-sync wire protocol between the learner and the rollout engines (both sides import it).

A dedicated process group (gloo on CPU, NCCL on GPU) joins learner rank 0 (group rank 0) and
every rollout worker (ranks 1..N). It is made from a TCP store of its own, without
`torch.distributed.init_process_group`, so it does not touch the default group that DeepSpeed
and vLLM each use in their own process. Rank 0 broadcasts tensors one bucket at a time, each
bucket as one flat tensor, in the order of a `WeightMeta` list that both sides agreed on when the
group was made, so receivers can preallocate.

Neither side holds a second copy of the weights. The sender broadcasts a bucket straight from its
parameters where they lie end to end in memory (DeepSpeed ZeRO-1/2 keeps every parameter as a
view of one flat buffer), else it concatenates one bucket at a time. A receiver streams: `receive`
is a generator over two bucket buffers used in turn, so a rollout engine loading from it never
holds a second full copy of the weights (`tests/test_weight_sync.py` measures it). Buffers are
kept between buckets and syncs: fresh memory costs a page fault per 4 KiB, which on a loaded
machine took longer than the broadcast itself (`python -m bench.weight_sync`). Plain torch: no
Ray, DeepSpeed or vLLM here.
"""

from __future__ import annotations

import socket
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch

# Parameters are sent in buckets of at most this many bytes (consecutive tensors of one dtype; a
# larger tensor is a bucket of its own), one broadcast each: large enough that a broadcast's fixed
# cost (~0.4 ms with gloo on one machine) is a few percent of its transfer, small enough that the
# two buckets a receiver holds (and the one ZeRO-3 gathers on the learner) stay far below a model.
BUCKET_BYTES = 16 * 1024 * 1024
# CUDA IPC sync (trainer/sync/ipc.py): the staging buffer each learner rank copies a chunk of
# weights into. vLLM's default is 1 GiB; on a GPU shared with an engine a quarter does (a tensor
# larger than this gets a buffer of its own size: a chunk holds at least one tensor).
IPC_BUFFER_BYTES = 256 * 2**20


@dataclass(frozen=True)
class WeightMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


def buckets(metas: list[WeightMeta], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `metas` grouped into consecutive same-dtype buckets of at most `limit` bytes."""
    out: list[list[int]] = []
    size = 0
    for i, meta in enumerate(metas):
        if out and (size + meta.nbytes <= limit) and metas[out[-1][0]].dtype == meta.dtype:
            out[-1].append(i)
            size += meta.nbytes
        else:
            out.append([i])
            size = meta.nbytes
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class SyncGroup:
    """A weight-sync process group, and how long one broadcast may wait for its peers."""

    pg: Any  # torch's ProcessGroupGloo / ProcessGroupNCCL backend
    wait_timeout: timedelta

    def broadcast(self, flat: torch.Tensor) -> None:
        """Broadcast `flat` from rank 0 and return once it has happened here. NCCL's plain
        `wait()` only orders the current CUDA stream after the broadcast: a peer that stopped
        would leave the caller reporting success while its stream hangs, and every later kernel
        (the next sync, a training step) queued behind it. With a timeout `wait` blocks this
        thread until the broadcast completes or raises at the timeout; the stream is then
        synchronized, so timings measure the transfer and a bucket buffer is reused only once sent."""
        self.pg.broadcast(flat, root=0).wait(self.wait_timeout)
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


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`b` starts where `a` ends, in the same storage (both dense)."""
    return (a.dtype == b.dtype and a.device == b.device and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


# Buffers kept between buckets and syncs, by (role, slot, device, dtype): the buffer and the use
# count of its storage when nobody else held it.
_BUFFERS: dict[tuple[str, int, str, torch.dtype], tuple[torch.Tensor, int | None]] = {}


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors share `t`'s storage (views included), or None where torch does not say."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return None if counter is None else counter(t.untyped_storage()._cdata)


def _buffer(role: str, slot: int, numel: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A kept buffer with room for `numel` elements: the same one as last time unless it is too
    small or someone else still holds a view of it (then it is left to them and a new one made)."""
    key = (role, slot, str(torch.device(device)), dtype)
    kept = _BUFFERS.pop(key, None)
    if kept is not None:
        buffer, baseline = kept
        if buffer.numel() >= numel and baseline is not None and _use_count(buffer) == baseline:
            _BUFFERS[key] = kept
            return buffer
        del buffer, kept  # let it go before allocating the new one
    buffer = torch.empty(numel, dtype=dtype, device=device)
    _BUFFERS[key] = (buffer, _use_count(buffer))
    return buffer


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bucket as one flat tensor: a view of the tensors where they lie end to end in memory,
    else their concatenation in a kept buffer (valid until the next bucket)."""
    first, total = tensors[0], sum(t.numel() for t in tensors)
    if all(_adjacent(a, b) for a, b in zip(tensors, tensors[1:])) and first.is_contiguous():
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (total,), (1,))
    flat = _buffer("send", 0, max(total, BUCKET_BYTES // first.element_size()), first.dtype, first.device)[:total]
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    return flat


def send(group, tensors_by_bucket: Iterable[list[torch.Tensor]]) -> None:
    """Rank 0: broadcast each bucket as one flat tensor (`_flat`)."""
    for tensors in tensors_by_bucket:
        flat = _flat(tensors)
        group.broadcast(flat)
        del flat


def _rehome(refs: list[weakref.ref]) -> None:
    """Give each tensor still alive its own copy of its data (it was a view of a bucket buffer)."""
    for ref in refs:
        held = ref()
        if held is not None:
            held.data = held.clone()
        held = None


def receive(group, metas: list[WeightMeta], device: str | torch.device = "cpu", *, limit: int = BUCKET_BYTES,
            stats: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..N: yield (name, tensor) in `metas` order as the buckets arrive (`limit`: the
    sender's bucket size). A lazy generator for a consumer that loads tensor by tensor (vLLM's
    `reload_weights`): the tensors are views of two bucket buffers used in turn, so a tensor stays
    valid until the bucket after next arrives: by then the consumer has moved on from it (its loop
    variables hold newer ones); one it still keeps (a layer spanning buckets, not yet loaded) is
    then given a copy of its own. `stats` (optional) accumulates `receive_s` (seconds in the
    broadcasts) and `bytes`.

    Buckets are received one after the other, not while the consumer loads the previous one: on
    2 cores a receive overlapped with vLLM's loading slowed both more than it hid."""
    handed_out: list[list[weakref.ref]] = [[], []]  # views of each buffer given to the consumer
    for k, bucket in enumerate(buckets(metas, limit)):
        slot, dtype = k % 2, metas[bucket[0]].torch_dtype
        _rehome(handed_out[slot])
        handed_out[slot] = []
        total = sum(metas[i].numel for i in bucket)
        started = time.perf_counter()
        flat = _buffer("receive", slot, max(total, limit // dtype.itemsize), dtype, device)[:total]
        group.broadcast(flat)
        if stats is not None:
            stats["receive_s"] = stats.get("receive_s", 0.0) + time.perf_counter() - started
            stats["bytes"] = stats.get("bytes", 0.0) + flat.numel() * flat.element_size()
        offset = 0
        for i in bucket:
            view = flat[offset : offset + metas[i].numel].view(metas[i].shape)
            offset += metas[i].numel
            handed_out[slot].append(weakref.ref(view))
            yield metas[i].name, view
            del view
        del flat


# ---- delta syncs (`trainer.delta_sync`) ---------------------------------------------------------
# Between two syncs most of a bf16 model's values do not change: an update smaller than half a
# bf16 step leaves the value where it was (peers report 1-3% of bytes changing per step). A delta
# sync sends, bucket by bucket, only the changed elements (int32 positions and their values) and
# a CRC-32 of the whole new bucket, which the receiver checks against its copy once the change
# is applied (an unchanged bucket is checked too); a bucket whose change would take more than
# `max_fraction` of its full size goes whole.
# Both ends keep a host copy of every bucket as last sent (one model's bytes each), so this saves
# bytes on the wire, not memory; the receiver still loads every tensor into its engine (a partial
# reload would leave vLLM's fused layers half loaded). The first sync after a join is always
# whole: a new member has nothing to apply a change to.

DELTA_FULL, DELTA_SPARSE, DELTA_UNCHANGED = 0, 1, 2
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """`flat` as integers of its element size: equal bits, equal values (NaN and -0.0 included)."""
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """CRC-32 of a flat tensor's bytes (zlib: about 2.5 GB/s on one core)."""
    import zlib

    return zlib.crc32(_bits(flat.detach().cpu().contiguous()).numpy())


def encode_delta(new: torch.Tensor, old: torch.Tensor | None,
                 max_fraction: float) -> tuple[int, torch.Tensor | None, torch.Tensor | None, int]:
    """How to send bucket `new` (flat) to a receiver holding `old` (None: nothing yet): (mode,
    int32 positions, values, how many elements changed). DELTA_SPARSE when the changed elements
    with their 4-byte positions take at most `max_fraction` of the bucket's bytes, else
    DELTA_FULL; DELTA_UNCHANGED when no bit changed."""
    if old is None:
        return DELTA_FULL, None, None, new.numel()
    changed = (_bits(new) != _bits(old)).nonzero().squeeze(1)
    n = changed.numel()
    if n == 0:
        return DELTA_UNCHANGED, None, None, 0
    if n * (4 + new.element_size()) > max_fraction * new.numel() * new.element_size():
        return DELTA_FULL, None, None, n
    return DELTA_SPARSE, changed.to(torch.int32), new[changed], n


def apply_delta(kept: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """The receiver's side of DELTA_SPARSE: write `values` at `positions` of its copy."""
    kept.index_copy_(0, positions.long(), values)


# A bucket whose change was too large to send as one goes whole, uncompared, for this many more
# syncs before it is compared again (fp32 weights change almost everywhere every step: comparing
# them each time costs more than the broadcast it would save)
DENSE_SYNCS = 8


class DeltaSender:
    """Rank 0's side of delta syncs: the host copy of every bucket as last sent. `reset` (at every
    join) makes the next sync whole."""

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction
        self.kept: list[torch.Tensor | None] = []
        self.dense: list[int] = []  # per bucket: syncs left to send it whole without comparing

    def reset(self) -> None:
        self.kept, self.dense = [], []

    def send(self, group, tensors_by_bucket: Iterable[list[torch.Tensor]], full: bool = False) -> dict[str, float]:
        """Broadcast each bucket as a header (mode, count, CRC-32) and its change or its whole
        values; `full`: every bucket whole. Returns `bytes` (payload sent), `changed` and
        `elements` (values that differ from the last sync, of all), `full_buckets`."""
        stats = {"bytes": 0.0, "changed": 0.0, "elements": 0.0, "full_buckets": 0.0}
        for k, tensors in enumerate(tensors_by_bucket):
            if k >= len(self.kept):
                self.kept.append(None)
                self.dense.append(0)
            flat = _flat([t.detach() for t in tensors])
            device, new = flat.device, flat.cpu()
            if self.dense[k] > 0 and not full:  # large last time: whole again, without comparing
                self.dense[k] -= 1
                mode, positions, values, changed = DELTA_FULL, None, None, new.numel()
            else:
                old = None if full else self.kept[k]
                mode, positions, values, changed = encode_delta(new, old, self.max_fraction)
                if mode == DELTA_FULL and old is not None:  # the change was too large to send apart
                    self.dense[k] = DENSE_SYNCS
            if self.kept[k] is None or self.kept[k].numel() != new.numel():
                self.kept[k] = new.clone()
            else:
                self.kept[k].copy_(new)
            crc = 0 if mode == DELTA_FULL else checksum(self.kept[k])
            group.broadcast(torch.tensor([mode, 0 if positions is None else positions.numel(), crc],
                                         dtype=torch.int64, device=device))
            if mode == DELTA_FULL:
                payload = [flat]
            elif mode == DELTA_SPARSE:
                payload = [positions.to(device), values.to(device)]
            else:
                payload = []
            for t in payload:
                group.broadcast(t)
                stats["bytes"] += t.numel() * t.element_size()
            stats["changed"] += changed
            stats["elements"] += new.numel()
            stats["full_buckets"] += mode == DELTA_FULL
            del flat, new, payload
        return stats


class DeltaReceiver:
    """A receiver's side of delta syncs: its copy of every bucket as last received (reset at
    every join). `receive` yields views of that copy, as `receive` above yields views of its
    buffers; a bucket whose CRC-32 disagrees after applying its change is counted in
    `stats["delta_mismatch"]` (the weight sync then sends everything whole)."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor | None] = []

    def reset(self) -> None:
        self.kept = []

    def receive(self, group, metas: list[WeightMeta], device: str | torch.device = "cpu", *,
                limit: int = BUCKET_BYTES, stats: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        stats = {} if stats is None else stats
        for key in ("receive_s", "bytes", "delta_mismatch"):
            stats.setdefault(key, 0.0)
        plan = buckets(metas, limit)
        if len(self.kept) != len(plan):
            self.kept = [None] * len(plan)
        for k, bucket in enumerate(plan):
            dtype, total = metas[bucket[0]].torch_dtype, sum(metas[i].numel for i in bucket)
            started = time.perf_counter()
            header = torch.zeros(3, dtype=torch.int64, device=device)
            group.broadcast(header)
            mode, count, crc = (int(v) for v in header.tolist())
            kept = self.kept[k]
            if kept is None or kept.numel() != total:
                kept = self.kept[k] = torch.zeros(total, dtype=dtype, device=device)
                known = False
            else:
                known = True
            if mode == DELTA_FULL:
                group.broadcast(kept)
                stats["bytes"] += kept.numel() * kept.element_size()
            elif mode == DELTA_SPARSE:
                positions = torch.empty(count, dtype=torch.int32, device=device)
                values = torch.empty(count, dtype=dtype, device=device)
                group.broadcast(positions)
                group.broadcast(values)
                stats["bytes"] += positions.numel() * 4 + values.numel() * values.element_size()
                apply_delta(kept, positions, values)
            stats["receive_s"] += time.perf_counter() - started
            if mode != DELTA_FULL and (not known or checksum(kept) != crc):
                stats["delta_mismatch"] += 1
            offset = 0
            for i in bucket:
                yield metas[i].name, kept[offset : offset + metas[i].numel].view(metas[i].shape)
                offset += metas[i].numel
