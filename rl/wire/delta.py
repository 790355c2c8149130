"""Delta weight syncs (`trainer.delta_sync`, over the collective transport: rl/wire/collective.py).

Between two syncs most of a bf16 model's values do not change: an update smaller than half a
bf16 step leaves the value where it was (peers report 1-3% of bytes changing per step). A delta
sync sends, bucket by bucket, only the changed elements (int32 positions and their values) and
a CRC-32 of the whole new bucket, which the receiver checks against its copy once the change
is applied (an unchanged bucket is checked too); a bucket whose change would take more than
`max_fraction` of its full size goes whole.
Both ends keep a host copy of every bucket as last sent (one model's bytes each), so this saves
bytes on the wire, not memory; the receiver still loads every tensor into its engine (a partial
reload would leave vLLM's fused layers half loaded). The first sync after a join is always
whole: a new member has nothing to apply a change to.

The group is anything with `broadcast(tensor)` from rank 0 (`rl.wire.collective.SyncGroup`).
Plain torch: no Ray, DeepSpeed or vLLM here.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from rl.wire.format import BUCKET_BYTES, WeightMeta, as_bits, buckets, checksum, flat_bucket

DELTA_FULL, DELTA_SPARSE, DELTA_UNCHANGED = 0, 1, 2


def encode_delta(new: torch.Tensor, old: torch.Tensor | None,
                 max_fraction: float) -> tuple[int, torch.Tensor | None, torch.Tensor | None, int]:
    """How to send bucket `new` (flat) to a receiver holding `old` (None: nothing yet): (mode,
    int32 positions, values, how many elements changed). DELTA_SPARSE when the changed elements
    with their 4-byte positions take at most `max_fraction` of the bucket's bytes, else
    DELTA_FULL; DELTA_UNCHANGED when no bit changed."""
    if old is None:
        return DELTA_FULL, None, None, new.numel()
    changed = (as_bits(new) != as_bits(old)).nonzero().squeeze(1)
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
            flat = flat_bucket([t.detach() for t in tensors])
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
    every join). `receive` yields views of that copy, as `rl.wire.collective.receive` yields
    views of its buffers; a bucket whose CRC-32 disagrees after applying its change is counted in
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
