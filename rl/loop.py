"""The driver loop: generate -> score -> advantages -> train -> sync weights, once per step.

It owns the step counter, the policy version and the logging, and talks to the rollout fleet,
reward service and learner only through the small protocols below, so the same loop runs
colocated on a laptop or spread over a Ray cluster (and imports neither Ray nor DeepSpeed).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from rl import checkpoint
from rl.advantages import ADVANTAGES, group_success_stats
from rl.batch import build_train_batch
from rl.data import PromptDataset
from rl.run_log import RunLog
from rl.types import GenerationRequest, Sample, ScoredSample, TrainBatch


class Fleet(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[Sample]: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...


class Rewards(Protocol):
    def score(self, samples: list[Sample]) -> list[ScoredSample]: ...


class Learner(Protocol):
    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]: ...
    def sync_weights(self, fleet: Fleet, version: int) -> float: ...
    def save_checkpoint(self, path: str) -> None: ...


@dataclass
class LoopSettings:
    steps: int
    prompts_per_step: int
    n: int
    advantage: str
    norm_by_std: bool
    pad_id: int
    log_samples_per_step: int = 4
    logprob_warn_threshold: float = 0.05
    sleep_between_steps: bool = False
    save_every: int = 0
    keep_checkpoints: int = 2


def reward_metrics(scored: list[ScoredSample]) -> dict[str, float]:
    ok = [s for s in scored if s.error is None]
    out: dict[str, float] = {"reward/errors_count": float(len(scored) - len(ok))}
    if ok:
        out["reward/mean"] = statistics.fmean(s.reward for s in ok)
        out["reward/std"] = statistics.pstdev([s.reward for s in ok])
        for name in ok[0].components:
            values = [s.components.get(name) for s in ok if s.components.get(name) is not None]
            if values:
                out[f"reward/{name}_mean"] = statistics.fmean(values)
    return out


def logprob_mismatch_warning(step: int, diff: float, threshold: float) -> str | None:
    """The loud warning for when learner and rollout disagree on the sampled tokens' log-probs."""
    if diff <= threshold:
        return None
    return (
        f"WARNING: step {step}: learner and rollout log-probs of the same tokens differ by {diff:.4f} "
        f"nats on average (> trainer.logprob_warn_threshold={threshold}): the rollout engines are not "
        "sampling from the learner's weights (weight sync, dtype or temperature mismatch); training is off-policy"
    )


def run_loop(settings: LoopSettings, data: PromptDataset, fleet: Fleet, rewards: Rewards, learner: Learner,
             log: RunLog, start_step: int = 0) -> list[dict[str, float]]:
    """Run steps [start_step, settings.steps); returns each step's metrics.

    The policy version equals the number of updates so far, i.e. the step index, also on resume.
    """
    history = []
    estimator = ADVANTAGES.get(settings.advantage)
    version = start_step
    for step in range(start_step, settings.steps):
        t0 = time.perf_counter()
        requests = data.requests(step, settings.prompts_per_step, settings.n)
        samples = fleet.generate(requests)
        t_gen = time.perf_counter()
        scored = rewards.score(samples)
        t_rew = time.perf_counter()

        valid = torch.tensor([s.error is None for s in scored])
        reward = torch.tensor([s.reward if s.error is None else 0.0 for s in scored], dtype=torch.float64)
        groups = torch.tensor([s.sample.group_id for s in scored])
        adv = estimator(reward, groups, valid, norm_by_std=settings.norm_by_std)
        batch = build_train_batch(scored, adv, settings.pad_id, version)
        if settings.sleep_between_steps:
            fleet.sleep()
        train_metrics = learner.train_step(batch, step)
        t_train = time.perf_counter()
        version += 1
        if settings.sleep_between_steps:
            fleet.wake()
        sent = learner.sync_weights(fleet, version)
        t_sync = time.perf_counter()

        gen_tokens = sum(len(s.completion_ids) for s in samples)
        metrics = {
            **reward_metrics(scored),
            **group_success_stats(reward, groups, valid),
            **train_metrics,
            "rollout/tokens_per_s": gen_tokens / max(t_gen - t0, 1e-9),
            "rollout/completion_len_tokens": gen_tokens / len(samples),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "sync/weights_mb": sent / 2**20,
            "time/rollout_s": t_gen - t0,
            "time/reward_s": t_rew - t_gen,
            "time/train_s": t_train - t_rew,
            "time/sync_s": t_sync - t_train,
            "time/step_s": t_sync - t0,
            "policy/version": float(version),
        }
        warning = logprob_mismatch_warning(step, metrics.get("sync/logprob_abs_diff", 0.0),
                                           settings.logprob_warn_threshold)
        if warning:
            log.write(warning)
        log.samples(step, scored, settings.log_samples_per_step)
        log.metrics(step, metrics)
        history.append(metrics)
        done = step + 1
        if settings.save_every and (done % settings.save_every == 0 or done == settings.steps):
            checkpoint.save(log.run_dir, checkpoint.LoopState(done, version), learner.save_checkpoint,
                            settings.keep_checkpoints)
    return history
