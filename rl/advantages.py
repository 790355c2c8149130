"""Advantage estimators: pure tensor functions, registered by name (`algorithm.advantage`).

Outcome-reward estimators take one scalar reward per sample and the group (prompt) each
sample belongs to, and return one advantage per sample; the loop broadcasts it to the tokens.
Samples whose reward could not be computed are excluded by the caller (`valid` mask).
"""

from __future__ import annotations

import torch

from rl.registry import Registry

ADVANTAGES = Registry("advantage estimator", "algorithm.advantage")


@ADVANTAGES.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): (r - mean_group) / (std_group + eps).

    std is the unbiased sample std over the group's valid members, as in the paper and TRL.
    With `norm_by_std=False` this is Dr.GRPO (Liu et al. 2025): r - mean_group. A group whose
    rewards are all equal gets advantage 0. Invalid samples get 0 and do not enter the statistics.
    """
    rewards = rewards.to(torch.float64)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    adv = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = (group_ids == gid) & valid
        if members.sum() < 1:
            continue
        r = rewards[members]
        centred = r - r.mean()
        if norm_by_std:
            std = r.std(unbiased=True) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
            centred = centred / (std + eps)
        adv[members] = centred
    return adv.to(torch.float32)


def group_success_stats(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Share of groups whose valid rewards are all equal (they carry no GRPO signal)."""
    flat = 0
    groups = torch.unique(group_ids)
    for gid in groups:
        r = rewards[(group_ids == gid) & valid.bool()]
        flat += int(r.numel() == 0 or bool((r == r[0]).all()))
    return {"adv/flat_groups_frac": flat / max(len(groups), 1)}
