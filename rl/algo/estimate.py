"""One step's advantages (and value targets) from outcome rewards and the learner's scores.

The driver calls this after the learner has scored the batch (old and reference log-probs,
critic values) and before it updates: all estimators see the whole step's batch, which the
global ones (REINFORCE++ and PPO whitening) need. Pure tensor code, like the rest of `rl/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algo.advantages import ADVANTAGES, token_level_rewards, whiten
from rl.config.schema import AlgorithmConfig
from rl.algo.kl import KL_ESTIMATORS

OUTCOME_ESTIMATORS = ("grpo", "rloo")   # one advantage per sample, broadcast to its tokens
TOKEN_ESTIMATORS = ("reinforce_pp", "gae")


@dataclass
class Estimate:
    advantages: torch.Tensor        # [B, T-1], zero off the loss mask
    returns: torch.Tensor | None    # [B, T-1] value targets (gae only)
    metrics: dict[str, float]


def estimate_advantages(
    settings: AlgorithmConfig,     # advantage, norm_by_std, gamma, lam, kl_in_reward, kl_estimator, whiten_advantages
    outcome: torch.Tensor,          # [B] reward per sample (anything where invalid)
    valid: torch.Tensor,            # [B] bool: the reward could be computed
    group_ids: torch.Tensor,        # [B]
    mask: torch.Tensor,             # [B, T-1] loss mask
    kl_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    turn_rewards: torch.Tensor | None = None,  # [B, T-1] episodes: each turn's reward on its last model token
) -> Estimate:
    """Outcome estimators see each sample's total reward (an episode's turn rewards included);
    per-token ones (REINFORCE++, GAE) get each turn's reward on the turn's last model token and
    the rest of the total (reward functions' share) on the last one."""
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
    if name in OUTCOME_ESTIMATORS:
        seq_reward = outcome if kl is None else outcome - kl_coef * kl.sum(dim=1).to(torch.float64)
        extra = {"norm_by_std": settings.norm_by_std} if name == "grpo" else {}
        per_sample = ADVANTAGES.get(name)(seq_reward, group_ids, valid, **extra)
        return Estimate(per_sample.float()[:, None] * mask, None, metrics)
    if turn_rewards is None:
        token_rewards = token_level_rewards(outcome.float(), mask, kl, kl_coef)
    else:
        turns = turn_rewards.to(torch.float32) * mask
        rest = outcome.float() - turns.sum(dim=1)
        token_rewards = token_level_rewards(rest, mask, kl, kl_coef) + turns
    if name == "reinforce_pp":
        return Estimate(ADVANTAGES.get(name)(token_rewards, mask, settings.gamma), None, metrics)
    if name == "gae":
        if values is None:
            raise ValueError("algorithm.advantage=gae needs a critic (set algorithm.critic=true)")
        adv, returns = ADVANTAGES.get(name)(token_rewards, values.float(), mask, settings.gamma, settings.lam)
        metrics["critic/returns_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
        if settings.whiten_advantages:
            adv = whiten(adv, mask)
        return Estimate(adv * mask, returns, metrics)
    raise ValueError(f"algorithm.advantage={name!r}: choose one of {', '.join(OUTCOME_ESTIMATORS + TOKEN_ESTIMATORS)}")
