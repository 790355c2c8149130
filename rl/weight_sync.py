"""The weight-sync wire protocol between the learner and the rollout engines (both sides import it).

A dedicated process group (gloo on CPU, NCCL on GPU) joins learner rank 0 (group rank 0) and
every rollout worker (ranks 1..N). It is made from a TCP store of its own, without
`torch.distributed.init_process_group`, so it does not touch the default group that DeepSpeed
and vLLM each use in their own process. Rank 0 broadcasts tensors one bucket at a time, in the
order of a `WeightMeta` list that both sides agreed on when the group was made, so receivers can
preallocate. Plain torch: no Ray, DeepSpeed or vLLM here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch

# Parameters are broadcast in buckets of at most this many bytes (one flat tensor per bucket and
# dtype) to amortise per-call latency without a second full copy of a large model in memory.
BUCKET_BYTES = 256 * 1024 * 1024


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


def init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 600.0):
    """Join the weight-sync group; every member calls this with the same host/port/size. Rank 0
    hosts the TCP store. A peer that is gone or stuck fails a collective after `timeout_s`."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"rlpost-weight-sync-{port}", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"weight-sync backend {backend!r}: choose gloo or nccl")
    return group


def send(group, tensors_by_bucket: Iterable[list[torch.Tensor]]) -> None:
    """Rank 0: broadcast each bucket as one flat tensor."""
    for tensors in tensors_by_bucket:
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
        group.broadcast(flat.contiguous(), root=0).wait()


def receive(group, metas: list[WeightMeta], device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..N: yield (name, tensor) in `metas` order as the buckets arrive."""
    for bucket in buckets(metas):
        total = sum(metas[i].numel for i in bucket)
        flat = torch.empty(total, dtype=metas[bucket[0]].torch_dtype, device=device)
        group.broadcast(flat, root=0).wait()
        offset = 0
        for i in bucket:
            meta = metas[i]
            yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
            offset += meta.numel
