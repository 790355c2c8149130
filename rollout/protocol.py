"""The one interface every generation backend implements (DESIGN.md, `rollout/`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from rl.types import GenerationRequest, Sample


@dataclass
class SamplingConfig:
    """How to sample; per-request seeds come with each `GenerationRequest`."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


class RolloutEngine(Protocol):
    version: int  # policy version of the weights currently loaded

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Sample]:
        """One Sample per request, in request order, with per-token log-probs of the sampled
        tokens under the engine's policy at `sampling.temperature`."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights in place (HF parameter names) and tag later samples with `version`."""

    def sleep(self) -> None:
        """Free accelerator memory (weights and KV cache) while the learner runs; no-op on CPU."""

    def wake(self) -> None:
        """Undo `sleep`."""


def finish_reason(completion_ids: list[int], eos_token_ids: set[int]) -> str:
    return "stop" if completion_ids and completion_ids[-1] in eos_token_ids else "length"
