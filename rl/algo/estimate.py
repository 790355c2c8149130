"""One step's advantages (and value targets) from outcome rewards and the learner's scores.

The driver calls this after the learner has scored the batch (old and reference log-probs,
critic values) and before it updates: all estimators see the whole step's batch, which the
global ones (REINFORCE++ and PPO whitening) need. Pure tensor code, like the rest of `rl/`.

It calls the estimator as its registration says (`rl/algo/advantages.py`): by its kind, with the
inputs and settings it declares; no estimator is named here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algo.advantages import ADVANTAGES, token_level_rewards
from rl.algo.distill import distill_advantages
from rl.config.schema import AlgorithmConfig
from rl.algo.kl import KL_ESTIMATORS

# what to set when an estimator's input is missing
_MISSING_INPUT_FIX = {
    "values": "a critic (set algorithm.critic=true)",
    "old_logprobs": "the old policy's log-probs (the learner's score step)",
    "ref_logprobs": "a reference model (set algorithm.kl_coef > 0)",
    "group_ids": "the group (prompt) of each sample",
}


@dataclass
class Estimate:
    advantages: torch.Tensor        # [B, T-1], zero off the loss mask
    returns: torch.Tensor | None    # [B, T-1] value targets (estimators that take values only)
    metrics: dict[str, float]


def estimate_advantages(
    settings: AlgorithmConfig,     # advantage, norm_by_std, gamma, lam, kl_in_reward, kl_estimator, whiten_advantages, distill_coef
    outcome: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    turn_rewards: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,  # [B, T-1] on-policy distillation: the teacher's
    student_logprobs: torch.Tensor | None = None,  # [B, T-1] ... and the student's of the same tokens
    episode_index: torch.Tensor | None = None,  # [rows] each row's episode (TrainBatch.episode_index)
) -> Estimate:
    """The task's advantages (`_task_advantages`), with on-policy distillation
    (algorithm.distill_coef > 0) mixed with the teacher's per-token ones (rl/algo/distill.py)."""
    est = _task_advantages(settings, outcome, valid, group_ids, mask, kl_coef, old_logprobs, ref_logprobs, values,
                           turn_rewards, episode_index)
    if settings.distill_coef > 0:
        if teacher_logprobs is None or student_logprobs is None:
            raise ValueError("algorithm.distill_coef > 0 needs the teacher's and the student's log-probs of the "
                             "sampled tokens (set algorithm.teacher_path)")
        advantages, metrics = distill_advantages(est.advantages, teacher_logprobs, student_logprobs, mask,
                                                 settings.distill_coef)
        est = Estimate(advantages, est.returns, {**est.metrics, **metrics})
    est.metrics["adv/nonzero_frac"] = nonzero_frac(est.advantages, mask)
    return est


def nonzero_frac(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of the loss tokens whose advantage is not 0: at 0 the step has nothing to learn
    from its rewards (every group's rewards equal, under a group-relative estimator), which the
    step line says (rl/log/run_log.py)."""
    on = mask > 0
    return float((advantages[on] != 0).sum()) / max(int(on.sum()), 1)


def _task_advantages(
    settings: AlgorithmConfig,
    outcome: torch.Tensor,          # [B] reward per sample (anything where invalid)
    valid: torch.Tensor,            # [B] bool: the reward could be computed
    group_ids: torch.Tensor,        # [B]
    mask: torch.Tensor,             # [B, T-1] loss mask
    kl_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    turn_rewards: torch.Tensor | None = None,  # [B, T-1] episodes: each turn's reward on its last model token
    episode_index: torch.Tensor | None = None,  # [rows]: an episode's segments are rows of their own
) -> Estimate:
    """Outcome estimators see each sample's total reward (an episode's turn rewards included);
    per-token ones (REINFORCE++, GAE) get each turn's reward on the turn's last model token and
    the rest of the total (reward functions' share) on the last one. With `episode_index` (an
    episode in several rows, its segments: outcome, valid and group_ids are per episode, the rest
    per row), an outcome estimator sees each episode once and its advantage goes to every row of
    it; a per-token one treats each row as a trajectory ending with its episode's reward."""
    mask = mask.to(torch.float32)
    outcome = torch.where(valid.bool(), outcome.to(torch.float64), torch.zeros_like(outcome, dtype=torch.float64))
    metrics: dict[str, float] = {}
    kl = None
    if settings.kl_in_reward and kl_coef > 0:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("KL in the reward needs old and reference log-probs (set algorithm.kl_coef > 0)")
        kl = KL_ESTIMATORS.get(settings.kl_estimator)(old_logprobs.float(), ref_logprobs.float()) * mask
        metrics["actor/kl_in_reward_nats"] = float(kl.sum() / mask.sum().clamp(min=1))
        metrics["actor/kl_coef"] = float(kl_coef)

    name = settings.advantage
    estimator = ADVANTAGES.entry(name)
    given = {"group_ids": group_ids, "values": values, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    missing = [key for key in estimator.inputs if given[key] is None]
    if missing:
        raise ValueError(f"algorithm.advantage={name} needs {', '.join(_MISSING_INPUT_FIX[key] for key in missing)}")
    kwargs = {key: given[key] if key == "group_ids" else given[key].float() for key in estimator.inputs}
    kwargs.update(ADVANTAGES.settings(name, settings))
    if estimator.kind == "outcome":
        seq_kl = None if kl is None else kl.sum(dim=1).to(torch.float64)
        if seq_kl is not None and episode_index is not None:  # an episode's KL: all of its rows'
            seq_kl = torch.zeros_like(outcome).index_add_(0, episode_index, seq_kl)
        seq_reward = outcome if seq_kl is None else outcome - kl_coef * seq_kl
        per_sample = estimator.fn(seq_reward, valid=valid, **kwargs)
        if episode_index is not None:
            per_sample = per_sample[episode_index]
        return Estimate(per_sample.float()[:, None] * mask, None, metrics)
    if episode_index is not None:  # per-token: each row a trajectory, ending with its episode's reward
        outcome, valid = outcome[episode_index], valid[episode_index]
        if "group_ids" in kwargs:
            kwargs["group_ids"] = group_ids[episode_index]
    if turn_rewards is None:
        token_rewards = token_level_rewards(outcome.float(), mask, kl, kl_coef)
    else:
        turns = turn_rewards.to(torch.float32) * mask
        rest = outcome.float() - turns.sum(dim=1)
        token_rewards = token_level_rewards(rest, mask, kl, kl_coef) + turns
    out = estimator.fn(token_rewards, mask=mask, **kwargs)
    if "values" not in estimator.inputs:
        return Estimate(out * mask, None, metrics)
    adv, returns = out  # an estimator with a critic also gives the critic's targets
    metrics["critic/returns_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
    return Estimate(adv * mask, returns, metrics)
