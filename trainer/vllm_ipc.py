"""The part of the CUDA IPC weight sync (rl/wire/ipc.py) that needs Ray and vLLM, which `rl` may
not import: vLLM's trainer-side IPC engine over a learner rank's weights, and the Ray queues the
driver relays through. `ipc_runtime()` hands both to `rl.wire.transports.make_weight_sync`."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from rl.wire.base import Exported
from rl.wire.ipc import IpcRuntime


def learner_weights(export: Exported):
    """The learner's weights as vLLM's `WeightSource`: the names, dtypes and shapes it will send,
    and a fresh pass over (name, whole tensor) per sync (ZeRO-3 gathers a bucket at a time, on
    every rank in step)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    metas = export.metas()

    class LearnerWeights(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, m.torch_dtype, tuple(m.shape)) for m in metas]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in export.buckets():
                yield from bucket

    return LearnerWeights()


def trainer_engine(rank: int, buffer_bytes: int, client: Any, export: Exported):
    """vLLM's trainer-side IPC engine for learner rank `rank` (packed: one reused staging buffer of
    `buffer_bytes`); `client` (rank 0 only): the relay to the engines."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=buffer_bytes)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=learner_weights(export))


def ipc_runtime() -> IpcRuntime:
    """Ray and the engine builder, for `make_weight_sync(..., ipc=)` (in the driver)."""
    import ray
    from ray.util.queue import Queue

    return IpcRuntime(ray, Queue, trainer_engine)
