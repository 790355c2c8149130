"""The weight-sync wire format, the same for every transport: what a sync sends (`WeightMeta`, in
an order both sides agreed on when they joined, so receivers can preallocate), how it is cut into
buckets (consecutive tensors of one dtype, at most `BUCKET_BYTES` each), each bucket as one flat
tensor, and the CRC-32 a receiver checks its copy against (delta syncs, rl/wire/delta.py).

Neither side holds a second copy of the weights. A sender's bucket is a view of its parameters
where they lie end to end in memory (DeepSpeed ZeRO-1/2 keeps every parameter as a view of one
flat buffer), else their concatenation in a kept buffer. Buffers are kept between buckets and
syncs (`kept_buffer`): fresh memory costs a page fault per 4 KiB, which on a loaded machine took
longer than the broadcast itself (`python -m bench.weight_sync`). Plain torch: no Ray, DeepSpeed
or vLLM here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Parameters are sent in buckets of at most this many bytes (consecutive tensors of one dtype; a
# larger tensor is a bucket of its own), one broadcast each: large enough that a broadcast's fixed
# cost (~0.4 ms with gloo on one machine) is a few percent of its transfer, small enough that the
# three buckets a receiver holds (and the one ZeRO-3 gathers on the learner) stay far below a model.
BUCKET_BYTES = 16 * 1024 * 1024


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


def kept_buffer(role: str, slot: int, numel: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
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


def flat_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bucket as one flat tensor: a view of the tensors where they lie end to end in memory,
    else their concatenation in a kept buffer (valid until the next bucket)."""
    first, total = tensors[0], sum(t.numel() for t in tensors)
    if all(_adjacent(a, b) for a, b in zip(tensors, tensors[1:])) and first.is_contiguous():
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (total,), (1,))
    flat = kept_buffer("send", 0, max(total, BUCKET_BYTES // first.element_size()), first.dtype, first.device)[:total]
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    return flat


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(flat: torch.Tensor) -> torch.Tensor:
    """`flat` as integers of its element size: equal bits, equal values (NaN and -0.0 included)."""
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """CRC-32 of a flat tensor's bytes (zlib: about 2.5 GB/s on one core)."""
    import zlib

    return zlib.crc32(as_bits(flat.detach().cpu().contiguous()).numpy())
