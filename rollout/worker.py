"""`RolloutWorker`: a Ray actor owning one generation engine and its end of the weight-sync group."""

from __future__ import annotations

from typing import Any

import torch

from rl.types import GenerationRequest, Sample
from rollout.protocol import SamplingConfig
from trainer import weight_sync


def make_engine(backend: str, model_path: str, **kwargs: Any):
    if backend == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kwargs)
    if backend == "hf":
        from rollout.hf_engine import HFEngine

        return HFEngine(model_path, **kwargs)
    raise ValueError(f"rollout.backend={backend!r}: choose vllm or hf")


class RolloutWorker:
    def __init__(self, backend: str, model_path: str, engine_kwargs: dict[str, Any]):
        self.engine = make_engine(backend, model_path, **engine_kwargs)
        self._group = None
        self._metas: list[weight_sync.WeightMeta] = []

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Sample]:
        return self.engine.generate(requests, sampling)

    def version(self) -> int:
        return self.engine.version

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                         metas: list[weight_sync.WeightMeta]) -> None:
        self._group = weight_sync.init_group(host, port, rank, world_size, backend)
        self._metas = metas

    def receive_weights(self, version: int) -> None:
        if self._group is None:
            raise RuntimeError("receive_weights before join_weight_sync: the fleet was not connected")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine.update_weights(weight_sync.receive(self._group, self._metas, device), version)

    def load_weights_from_object(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state.items(), version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()
