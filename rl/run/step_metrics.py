"""One step's metrics line, from what the step did: rewards, advantages, the update, the sync,
the times of its phases, the policy's staleness, cost and episodes. What metrics.jsonl, the
loggers and the step line show (docs/faults-and-run-dirs.md)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rl.algo.advantages import group_success_stats
from rl.config.schema import TrainConfig
from rl.data.types import Sample, ScoredSample
from rl.plan.flops import step_cost, utilisation
from rl.actors.faults import episode_cause
from rl.run.scoring import reward_metrics, reward_tensors


@dataclass
class StepTimes:
    """perf_counter() at each phase boundary of a step."""
    start: float  # waiting for the step's batch
    batch: float  # the batch taken: the learner scores it
    scored: float  # advantages and the update
    trained: float  # waiting for a batch boundary (rollouts ahead), then the sync
    held: float  # the sync
    synced: float
    end: float


def step_metrics(cfg: TrainConfig, version: int, scored: list[ScoredSample], samples: list[Sample],
                 collected: dict[str, float], trained: dict[str, float],
                 kl_coef: float, sent_bytes: float, bytes_per_sync: float, t: StepTimes,
                 evaluated: dict[str, float]) -> dict[str, float]:
    a = cfg.algorithm
    reward, valid, groups = reward_tensors(scored)
    gen_tokens = sum(sum(s.completion_mask) if s.completion_mask is not None else len(s.completion_ids)
                     for s in samples)  # the model's tokens (an episode's observations are not generated)
    behind = staleness(version, scored)
    return {
        **reward_metrics(scored),
        "reward/samples_count": float(len(scored)),  # with reward/errors_count: how many had no reward
        **group_success_stats(reward, groups, valid),
        **{k: v for k, v in collected.items() if k != "time/wait_rollout_s"},
        **({"actor/kl_coef": kl_coef} if a.kl_coef > 0 else {}),
        **trained,
        "rollout/tokens_per_s": gen_tokens / max(collected["time/rollout_s"], 1e-9),
        "rollout/completion_len_tokens": gen_tokens / len(samples),
        # the planner's lengths for the next run (rl/plan/step_time.py): prompts, and the decode steps
        "rollout/prompt_len_tokens": statistics.fmean(len(s.prompt_ids) for s in samples),
        "rollout/completion_len_max_tokens": float(max(len(s.completion_ids) for s in samples)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "sync/weights_mb": sent_bytes / 2**20,
        "sync/sent_frac": sent_bytes / max(bytes_per_sync, 1.0),  # below 1 with trainer.delta_sync
        "time/wait_rollout_s": (t.batch - t.start) + (t.held - t.trained),  # the learner idle, waiting for rollouts
        "time/score_s": t.scored - t.batch,
        "time/train_s": t.trained - t.scored,
        "time/sync_s": t.synced - t.held,
        "time/step_s": t.end - t.start,
        "policy/version_count": float(version + 1),
        "policy/staleness_mean": statistics.fmean(behind),
        "policy/staleness_max": float(max(behind)),
        "policy/staleness_bound": float(a.off_policy_steps),
        "rollout/streaming": float(cfg.rollout.mode == "streaming"),
        **cost_metrics(cfg, trained, t.trained - t.batch, t.end - t.start),
        **episode_metrics(samples),
        **evaluated,
    }


def staleness(version: int, scored: list[ScoredSample]) -> list[int]:
    """How many versions behind `version` each valid sample's policy was ([0] when none is valid)."""
    return [version - s.sample.policy_version for s in scored if s.error is None] or [0]


def cost_metrics(cfg: TrainConfig, train_metrics: dict[str, float], learner_s: float,
                 step_s: float) -> dict[str, float]:
    """Learner MFU and trained tokens/s over its time this step (score + train), and the step's
    price at `cluster.price_per_device_hour` for every learner rank and rollout worker."""
    out: dict[str, float] = {}
    tflop, peak = train_metrics.get("perf/model_tflop"), train_metrics.get("perf/peak_tflops", 0.0)
    if tflop is not None and peak > 0 and learner_s > 0:
        out["perf/mfu"] = tflop / (learner_s * peak * cfg.trainer.num_workers)
        out.update(utilisation(train_metrics, learner_s, cfg.trainer.num_workers))  # hw and effective, named
        out["perf/trained_tokens_per_s"] = train_metrics["perf/trained_tokens"] / learner_s
    if cfg.cluster.price_per_device_hour > 0:
        devices = cfg.trainer.num_workers + cfg.rollout.num_workers
        out["cost/step_usd"] = step_cost(step_s, devices, cfg.cluster.price_per_device_hour)
    return out


AGENT_KILLED = "did not return within task.agent_timeout_s"  # the pool's error (reward/agents/pool.py)


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Turns per episode, and the share of an episode's tokens that are observations; agents that
    failed (reward/agents/runner.py names them in the error), and those the pool killed at their
    deadline (not those that got no outcome at all: a pool that could not run them, issue 58)."""
    episodes = [s for s in samples if s.turns is not None]
    if not episodes:
        return {}
    failed = [s.error for s in episodes if s.error is not None and s.error.startswith("task.agent=")]
    agents = {"agent/errors_count": float(len(failed)),
              "agent/timeouts_count": float(sum(AGENT_KILLED in episode_cause(e) for e in failed))} if failed else {}
    truncated = sum(s.truncated for s in episodes)  # reached the context, kept (issue 59)
    if truncated:
        agents["agent/truncated_count"] = float(truncated)
    parts = [[*(s.segments or ()), s] for s in episodes]  # an episode's segments count as its own
    turns = [sum(t.role == "model" for p in ps for t in p.turns) for ps in parts]
    tokens = sum(len(p.completion_ids) for ps in parts for p in ps)
    obs = tokens - sum(sum(p.completion_mask) for ps in parts for p in ps)
    return {"episode/turns_mean": statistics.fmean(turns), "episode/turns_max": float(max(turns)),
            "episode/observation_tokens_frac": obs / max(1, tokens),
            "episode/errors_count": float(sum(s.error is not None for s in episodes)), **agents}


def logprob_mismatch_warning(step: int, diff: float, threshold: float) -> str | None:
    """The loud warning for when learner and rollout disagree on the sampled tokens' log-probs."""
    if diff <= threshold:
        return None
    return (
        f"WARNING: step {step}: learner and rollout log-probs of the same tokens differ by {diff:.4f} "
        f"nats on average (> trainer.logprob_warn_threshold={threshold}): the rollout engines are not "
        "sampling from the learner's weights (weight sync, dtype or temperature mismatch); training is off-policy"
    )
