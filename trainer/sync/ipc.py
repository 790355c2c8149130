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

from typing import Any, Iterator

import ray
import torch

from rl.wire.weight_sync import IPC_BUFFER_BYTES, WeightMeta
from trainer.sync.base import Pushed, WeightSync


def buffer_bytes(metas: list[WeightMeta]) -> int:
    return max([IPC_BUFFER_BYTES, *(m.nbytes for m in metas)])


def learner_weights(export):
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


class FleetClient:
    """vLLM's trainer-side client protocol (`VLLMWeightSyncClient`) over our rollout workers:
    each call goes to every worker's `weight_transfer` and waits for all of them, at most
    `timeout_s` (a worker that died or stopped fails the sync, which the driver then repairs).
    Only learner rank 0 holds workers; `version` is the policy version being sent."""

    def __init__(self, workers: list[Any], timeout_s: float):
        self.workers, self.timeout_s, self.version = workers, timeout_s, 0

    def _all(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        ray.get([w.weight_transfer.remote(method, payload, version) for w in self.workers], timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", None, self.version)


class IpcSender:
    """The learner side, in every learner rank: vLLM's trainer-side IPC engine (rank 0, the
    sender, holds the rollout workers and tells the engines the wire format when built)."""

    def __init__(self) -> None:
        self.engine = None

    def bind(self, export, rank: int, device) -> None:
        self.export, self.rank = export, rank

    def connect(self, workers: list, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        self.close()
        info = IPCTrainerInitInfo(rank=self.rank, packed=True, packed_buffer_size_bytes=buffer_bytes(self.export.metas()))
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=FleetClient(workers, timeout_s),
                                                                source=learner_weights(self.export))

    def send(self, version: int) -> float:
        """Share the weights with the engine on this GPU as policy `version`; the bytes one engine loaded."""
        self.engine.client.version = version
        self.engine.send_weights()
        return self.export.nbytes()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class IpcSync(WeightSync):
    sender = IpcSender

    def _join(self) -> dict[int, str]:
        """Every rank builds vLLM's trainer-side IPC engine; rank 0 gets the rollout workers."""
        timeout = self.deadlines.of("weight sync")
        self.on_learner([w.sender_call.remote("connect", list(self.rollout.handles) if r == 0 else [], timeout)
                         for r, w in enumerate(self.learner.handles)], "weight-sync join")
        return {}

    def push(self, version: int, full: bool = False) -> Pushed:
        sends = [w.sender_call.remote("send", version) for w in self.learner.handles]
        sent = self.on_learner(sends, "weight sync", tolerate_errors=True)
        # what each worker holds now (and whether it is still there)
        out = self.rollout.gather({i: w.version.remote() for i, w in enumerate(self.rollout.handles)}, "weight sync",
                                  propagate_raised=True)
        if sent[0] is None and not out.failed:
            ray.get(sends[0])  # not a rollout worker's fault: raise the learner's error
        return Pushed(sent[0] or 0.0, {i: {"version": v} for i, v in out.results.items()}, out.failed)
