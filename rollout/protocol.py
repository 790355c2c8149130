"""The one interface every generation backend implements, and the spec an engine is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from rl.config.schema import ModelConfig, RolloutConfig, TrainConfig
from rl.data.types import GenerationRequest, Sample


@dataclass
class RolloutSpec:
    """What an engine is built from: the run's typed `model` and `rollout` sections as they are
    (sampling: temperature, top_p, max_new_tokens; engine settings), plus what the driver
    resolves. Plain data: it crosses a Ray boundary. Per-request seeds come with each request."""

    model: ModelConfig
    rollout: RolloutConfig
    seed: int  # run.seed; worker i seeds its engine with seed + i
    threads: int = 0  # torch/OMP threads of the engine (0: all cores)
    gpu: bool = False  # the workers have a GPU each (sleep mode needs one)
    weight_sync: str = "collective"  # trainer.weight_sync: "ipc" builds the engine with vLLM's ipc transfer

    @classmethod
    def from_config(cls, cfg: TrainConfig, threads: int = 0) -> RolloutSpec:
        return cls(cfg.model, cfg.rollout, seed=cfg.run.seed, threads=threads,
                   gpu=cfg.cluster.gpus_per_rollout_worker > 0, weight_sync=cfg.trainer.weight_sync)


class RolloutEngine(Protocol):
    version: int  # policy version of the weights currently loaded

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """One Sample per request, in request order, with per-token log-probs of the sampled
        tokens under the engine's policy at `rollout.temperature` (a request may carry its own
        temperature, 0 = greedy, and token budget: `max_tokens`)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights in place (HF parameter names) and tag later samples with `version`."""

    def sleep(self, level: int | None = None) -> None:
        """Free accelerator memory (KV cache; weights dropped at level 2, kept on the host at
        level 1) while the learner runs; no-op on CPU."""

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Undo `sleep`: only the `tags` given ("weights", "kv_cache"), or everything."""


def finish_reason(completion_ids: list[int], eos_token_ids: set[int]) -> str:
    return "stop" if completion_ids and completion_ids[-1] in eos_token_ids else "length"
