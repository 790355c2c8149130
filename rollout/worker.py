"""`RolloutWorker`: a Ray actor owning one generation engine and its ends of the weight sync
(`rl/wire/collective.py`, `rl/wire/object_store.py`; CUDA IPC's is in the vLLM engine,
`rl/wire/ipc.py`'s `IpcReceiver`)."""

from __future__ import annotations

import os
import time

import torch

from rl.plan.devices import actor_device
from rl.wire.collective import CollectiveReceiver
from rl.wire.format import WeightMeta
from rl.wire.object_store import StateReceiver
from rl.data.types import GenerationRequest, Sample
from rollout.adapters import adapter_merger
from rollout.protocol import RolloutSpec


def make_engine(spec: RolloutSpec, seed: int):
    if spec.rollout.backend == "vllm" and spec.concurrent:
        from rollout.vllm_stream import AsyncVLLMEngine

        return AsyncVLLMEngine(spec, seed)
    if spec.rollout.backend == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(spec, seed)
    if spec.rollout.backend == "hf":
        from rollout.hf_engine import HFEngine

        return HFEngine(spec, seed)
    raise ValueError(f"rollout.backend={spec.rollout.backend!r}: choose vllm or hf")


def _assigned_gpus() -> list:
    """The GPUs Ray gave this actor (none outside Ray)."""
    import ray

    return ray.get_gpu_ids() if ray.is_initialized() else []


class RolloutWorker:
    def __init__(self, spec: RolloutSpec, index: int = 0):
        # the device Ray gave this worker, not whether the machine has CUDA (rl/plan/devices.py)
        self.device = actor_device(_assigned_gpus(), torch.cuda.is_available(), f"rollout worker {index}")
        self.spec = spec
        self.engine = make_engine(spec, seed=spec.seed + index)
        # vLLM with tensor parallelism runs its model in one worker process per TP rank: each of
        # them joins the weight-sync group and loads the broadcast itself (rollout/vllm_worker.py)
        self._in_workers = not getattr(self.engine, "in_process", True)
        # LoRA base weights: kept here when the model runs here, else by each vLLM worker (and here
        # only if an object-store sync comes, `_lora_merger`)
        self._merger = None if self._in_workers else adapter_merger(spec)
        self._receiver, self._joined = CollectiveReceiver(), False
        self.last_sync: dict[str, float] = {}

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        return self.engine.generate(requests)

    def version(self) -> int:
        return self.engine.version

    # A stream (every engine has submit/drain, rollout/protocol.py); with a concurrent engine
    # (rollout/vllm_stream.py) the actor runs its calls in threads (max_concurrency), so a weight
    # sync proceeds while a drain waits.
    def submit(self, requests: list[GenerationRequest]) -> None:
        self.engine.submit(requests)

    def drain(self, wait_s: float) -> dict:
        return self.engine.drain(wait_s)

    def pause(self) -> None:  # concurrent engines: tests and fault drills
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def where(self) -> dict:
        """This actor's process and Ray node (for placement reports and fault messages)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "device": self.device,
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                         metas: list[WeightMeta], delta: bool = False) -> None:
        """Join the weight-sync group at ranks `rank` .. `rank + rollout.tensor_parallel_size - 1`:
        this process alone without tensor parallelism, else each vLLM worker at `rank` + its rank
        (each with its own `rl.wire.collective.CollectiveReceiver`). `delta`: syncs send changes
        (`trainer.delta_sync`), applied to a kept copy of the weights."""
        if self._in_workers:
            lora = self.spec if self.spec.model.lora.rank > 0 else None
            self.engine.join_weight_sync(host, port, rank, world_size, backend, metas, lora, delta)
        else:
            self._receiver.join(host, port, rank, world_size, backend, metas, delta, self._lora_merger())
        self._joined = True

    def receive_weights(self, version: int) -> dict[str, float]:
        """Take rank 0's broadcast and load it bucket by bucket as it arrives. Returns the sync's
        figures: bytes (taken by all `ranks` of a tensor-parallel engine together), total_s,
        receive_s (in the broadcasts), load_s (the rest: loading into the engine) and the
        `version` the engine now holds."""
        if not self._joined:
            raise RuntimeError("receive_weights before join_weight_sync: the fleet was not connected")
        started = time.perf_counter()
        if self._in_workers:  # every TP rank takes all buckets; the slowest one's receive, bytes of all
            per_rank = self.engine.receive_weights(version)
            stats = {"receive_s": max(s["receive_s"] for s in per_rank), "bytes": sum(s["bytes"] for s in per_rank),
                     "ranks": len(per_rank), "delta_mismatch": sum(s.get("delta_mismatch", 0.0) for s in per_rank)}
        else:
            stats = self._receiver.receive(lambda tensors: self.engine.update_weights(tensors, version), self.device)
        stats["total_s"] = time.perf_counter() - started
        stats["load_s"] = stats["total_s"] - stats["receive_s"]
        self.last_sync = stats
        return {**stats, "version": self.engine.version}

    def sync_stats(self) -> dict[str, float]:
        """The figures of the latest `receive_weights` (empty before the first)."""
        return self.last_sync

    def load_weights_from_object(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Load weights from Ray's object store (merged here with LoRA; with tensor parallelism they
        then cross to every vLLM worker as a list, each keeping its shard). Returns the bytes
        taken and the `version` the engine now holds."""
        stats = StateReceiver.receive(state, lambda tensors: self.engine.update_weights(tensors, version),
                                      self._lora_merger())
        return {**stats, "version": self.engine.version}

    def _lora_merger(self):
        """With LoRA, the base weights syncs are merged into (read once, kept); else None."""
        if self._merger is None and self.spec.model.lora.rank > 0:
            self._merger = adapter_merger(self.spec)
        return self._merger

    def sleep(self, level: int | None = None) -> None:
        self.engine.sleep(level)

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        self.engine.wake(tags)

    def weight_transfer(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        """vLLM's weight-transfer API on this worker's engine (CUDA IPC from the learner rank on
        this GPU in hybrid placement, `rl/wire/ipc.py`)."""
        self.engine.weight_transfer(method, payload, version)
