"""Weight sync by CUDA IPC (`trainer.weight_sync=ipc`, with `cluster.placement_mode=hybrid`).

A learner rank and a rollout engine share each GPU, so the new weights need not cross a network
or even leave the device: through vLLM's own `ipc` weight-transfer engine every learner rank
copies its weights, chunk by chunk, into one staging buffer on its GPU and exports a CUDA IPC
handle of it keyed by the GPU's UUID; vLLM all-gathers the handles over the learner's default
process group, rank 0 sends the merged handles to every rollout worker (`FleetClient`), and each
engine opens the handle of its own GPU and loads the chunk. Packed mode (one reused buffer of
`buffer_bytes`) keeps the extra memory on the shared GPU bounded and lets a ZeRO-3 gather be
freed after each chunk. CUDA only: vLLM's trainer engine reads the device's UUID when built
(tests/test_gpu.py runs it; on CPU hybrid placement syncs with `collective`, over gloo).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from rl.wire.weight_sync import IPC_BUFFER_BYTES, WeightMeta


def buffer_bytes(metas: list[WeightMeta]) -> int:
    return max([IPC_BUFFER_BYTES, *(m.nbytes for m in metas)])


def learner_weights(metas: list[WeightMeta], buckets: Callable[[], Iterator[list[tuple[str, torch.Tensor]]]]):
    """The learner's weights as vLLM's `WeightSource`: the names, dtypes and shapes it will send,
    and a fresh pass over (name, whole tensor) per sync; `buckets` is the learner's own bucketed
    iterator (ZeRO-3 gathers a bucket at a time, on every rank in step)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class LearnerWeights(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, m.torch_dtype, tuple(m.shape)) for m in metas]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets():
                yield from bucket

    return LearnerWeights()


class FleetClient:
    """vLLM's trainer-side client protocol (`VLLMWeightSyncClient`) over our rollout workers:
    each call goes to every worker's `weight_transfer` and waits for all of them, at most
    `timeout_s` (a worker that died or stopped fails the sync, which the driver then repairs).
    Only learner rank 0 holds workers; `version` is the policy version being sent."""

    def __init__(self, workers: list[Any], timeout_s: float):
        self.workers, self.timeout_s, self.version = workers, timeout_s, 0

    def _all(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        import ray

        ray.get([w.weight_transfer.remote(method, payload, version) for w in self.workers], timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", None, self.version)


def trainer_engine(rank: int, client: FleetClient, metas: list[WeightMeta], buckets):
    """vLLM's trainer-side IPC engine for this rank (rank 0, the sender, tells the engines the
    wire format now)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=buffer_bytes(metas))
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=learner_weights(metas, buckets))
