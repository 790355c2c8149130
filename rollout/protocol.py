"""The one interface every generation backend implements, and the spec an engine is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

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
    agents: bool = False  # task.agent: agents' calls arrive one by one, from many threads at once

    @classmethod
    def from_config(cls, cfg: TrainConfig, threads: int = 0) -> RolloutSpec:
        return cls(cfg.model, cfg.rollout, seed=cfg.run.seed, threads=threads,
                   gpu=cfg.cluster.gpus_per_rollout_worker > 0, weight_sync=cfg.trainer.weight_sync,
                   agents=bool(cfg.task.agent))

    @property
    def concurrent(self) -> bool:
        """Requests arrive continuously, not as batches (a stream, or agents' calls): the engine is
        vLLM's AsyncLLM, which batches whatever is running, and the actor takes calls in threads
        (a weight sync proceeds while a drain or a call waits)."""
        return self.rollout.mode == "streaming" or self.agents


class RolloutEngine(Protocol):
    version: int  # policy version of the weights currently loaded

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """One Sample per request, in request order, with per-token log-probs of the sampled
        tokens under the engine's policy at `rollout.temperature` (a request may carry its own
        temperature, 0 = greedy, and token budget: `max_tokens`). A request the engine refuses
        (its parameters or token ids) comes back as a Sample with `error` set, never as a raise:
        a raise means the engine itself failed."""

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Start requests whose samples `drain` returns as they finish (a stream)."""

    def drain(self, wait_s: float) -> dict[str, Any]:
        """{"samples": finished since the last call (waiting up to `wait_s`), "paused_s": how long
        the engine has been paused, 0 when it is not}."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights in place (HF parameter names) and tag later samples with `version`."""

    def sleep(self, level: int | None = None) -> None:
        """Free accelerator memory (KV cache; weights dropped at level 2, kept on the host at
        level 1) while the learner runs; no-op on CPU."""

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Undo `sleep`: only the `tags` given ("weights", "kv_cache"), or everything."""


class BatchQueue:
    """`submit`/`drain` for an engine that generates in batches (its `generate`): `drain`
    generates everything submitted since the last one, together (an engine that streams,
    `rollout.vllm_stream`, has its own)."""

    _queued: list[GenerationRequest] = []

    def submit(self, requests: list[GenerationRequest]) -> None:
        self._queued = self._queued + list(requests)

    def drain(self, wait_s: float) -> dict[str, Any]:
        queued, self._queued = self._queued, []
        return {"samples": self.generate(queued) if queued else [], "paused_s": 0.0}


def refused(request: GenerationRequest, why: str, version: int) -> Sample:
    """The sample of a request the engine refused: no tokens, its error (the request's own fault)."""
    return Sample(list(request.prompt_ids), [], [], "stop", version, request.prompt_text, "", request.group_id,
                  request.sample_index, request.metadata, error=f"the rollout engine refused this request: {why}")


def each_or_refused(generate: Callable[[list[GenerationRequest]], list[Sample]], requests: list[GenerationRequest],
                    refusals: tuple[type[BaseException], ...], version: int) -> list[Sample]:
    """`generate(requests)`; if the engine refuses the batch (one of `refusals`, raised before it
    generates anything), each request alone, so only the bad ones become `refused` samples."""
    try:
        return generate(requests)
    except refusals as err:
        if len(requests) == 1:
            return [refused(requests[0], f"{type(err).__name__}: {err}", version)]
    return [s for r in requests for s in each_or_refused(generate, [r], refusals, version)]


def finish_reason(completion_ids: list[int], eos_token_ids: set[int]) -> str:
    return "stop" if completion_ids and completion_ids[-1] in eos_token_ids else "length"
