"""`RolloutWorker`: a Ray actor owning one generation engine and its end of the weight-sync group."""

from __future__ import annotations

import os

import torch

from rl import weight_sync
from rl.types import GenerationRequest, Sample
from rollout.protocol import RolloutSpec


def make_engine(spec: RolloutSpec, seed: int):
    if spec.rollout.backend == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(spec, seed)
    if spec.rollout.backend == "hf":
        from rollout.hf_engine import HFEngine

        return HFEngine(spec, seed)
    raise ValueError(f"rollout.backend={spec.rollout.backend!r}: choose vllm or hf")


class RolloutWorker:
    def __init__(self, spec: RolloutSpec, index: int = 0):
        self.engine = make_engine(spec, seed=spec.seed + index)
        self._group = None
        self._metas: list[weight_sync.WeightMeta] = []

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        return self.engine.generate(requests)

    def version(self) -> int:
        return self.engine.version

    def where(self) -> dict:
        """This actor's process and Ray node (for placement reports and fault messages)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

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
