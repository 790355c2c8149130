"""Advantage estimators: pure tensor functions, registered by name (`algorithm.advantage`) with
their contract, which is how `rl/algo/estimate.py` calls them (it never looks at the name):

- kind "outcome": `fn(rewards [B], valid=[B], **inputs, **settings) -> [B]`, one advantage per
  sample from its sequence reward; the caller broadcasts it to the sample's tokens.
- kind "token": `fn(token_rewards [B,T], mask=[B,T], **inputs, **settings) -> [B,T]` per-token
  advantages from per-token rewards (see `token_level_rewards`); one that takes `values` returns
  `(advantages, returns)`, the returns being the critic's targets.

`inputs` name the extra tensors (group_ids [B], values / old_logprobs / ref_logprobs [B,T]),
`settings` the AlgorithmConfig fields passed as keyword arguments. A new estimator is named in
`rl/config/algorithm_names.py` too (see there).

Samples whose reward could not be computed are excluded by the caller (`valid` mask, or an
all-zero row of the token mask). Masks are 1 on completion tokens; rows may start with prompt
positions (0) and end with right padding (0).
"""

from __future__ import annotations

import torch

from rl.algo.registry import Registry

ADVANTAGES = Registry("advantage estimator", "algorithm.advantage", kinds=("outcome", "token"),
                      inputs=("group_ids", "values", "old_logprobs", "ref_logprobs"))


# ---- outcome-reward estimators (one advantage per sample) -----------------------------------


@ADVANTAGES.register("grpo", kind="outcome", inputs=("group_ids",), settings=("norm_by_std",))
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
        # In units of the group's largest |r|, so the mean and the squares of the std stay finite
        # for any finite rewards (1e300: std inf, advantages 0, before; issue 58):
        # (r - mean) / (std + eps) = (r/s - mean/s) / (std/s + eps/s).
        r = rewards[members]
        scale = r.abs().max().clamp(min=1e-150)
        r = r / scale
        centred = r - r.mean()
        if norm_by_std:
            std = r.std(unbiased=True) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
            adv[members] = centred / (std + eps / scale)
        else:
            adv[members] = centred * scale
    return adv.to(torch.float32)


@ADVANTAGES.register("rloo", kind="outcome", inputs=("group_ids",))
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j.

    The baseline of each sample is the mean reward of the *other* valid members of its group,
    which equals n/(n-1) * (r_i - mean_group). A group of one valid sample (no other member to
    compare with) gets 0, as does an all-equal group. Invalid samples get 0 and are no baseline.
    """
    rewards = rewards.to(torch.float64)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    adv = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = (group_ids == gid) & valid
        n = int(members.sum())
        if n < 2:
            continue
        r = rewards[members]
        adv[members] = r - (r.sum() - r) / (n - 1)
    return adv.to(torch.float32)


def group_success_stats(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Share of groups whose valid rewards are all equal (they carry no GRPO signal)."""
    flat = 0
    groups = torch.unique(group_ids)
    for gid in groups:
        r = rewards[(group_ids == gid) & valid.bool()]
        flat += int(r.numel() == 0 or bool((r == r[0]).all()))
    return {"adv/flat_groups_frac": flat / max(len(groups), 1)}


# ---- per-token helpers ------------------------------------------------------------------------


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [B, T] mask (-1 for an all-zero row)."""
    t = mask.shape[-1]
    positions = torch.arange(t, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(-1)


def token_level_rewards(
    outcome: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t on every valid token, plus the outcome reward at the
    last valid token (Ziegler et al. 2019; Ouyang et al. 2022; REINFORCE++, Hu 2025).

    outcome [B]: scalar reward per sample; mask [B, T]; kl [B, T]: per-token KL estimate between the
    sampling policy and the reference (e.g. k1 on the old log-probs), or None for no penalty.
    Masked positions are 0; an all-zero mask row gets no outcome reward.
    """
    mask = mask.to(torch.float32)
    rewards = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        rewards = -kl_coef * kl.to(torch.float32) * mask
    last = last_valid_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += outcome.to(torch.float32)[rows]
    return rewards


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening: (x - mean) / sqrt(var + eps) over the valid entries of the whole tensor.

    mean and the unbiased variance (Bessel, n - 1) are taken over entries where mask is 1. With
    `shift_mean=False` the mean is added back (scale only, as in OpenRLHF/verl). Masked entries are 0.
    """
    dtype = values.dtype
    # In float64 and in units of the largest valid |x|, so the squares stay finite for any finite
    # values (fp32 overflowed from |x| ~ 2e19: var inf, every advantage 0; issue 58):
    # (x - mean) / sqrt(var + eps) = (x/s - mean/s) / sqrt(var/s^2 + eps/s^2).
    mask = mask.to(torch.float64)
    x = torch.where(mask > 0, values.to(torch.float64), torch.zeros((), dtype=torch.float64))
    scale = x.abs().max().clamp(min=1e-150) if x.numel() else torch.ones((), dtype=torch.float64)
    x = x / scale
    n = mask.sum()
    mean = x.sum() / n.clamp(min=1.0)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1.0)
    out = (x - mean) * torch.rsqrt(var + eps / scale**2)
    if not shift_mean:
        out = out + mean * scale
    return (out * mask).to(dtype)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} over valid tokens, t' the next valid token; 0 on masked positions.

    Masked positions inside a row (an episode's observation tokens) are skipped, not restarted
    at: the return flows across them from the next model turn, undiscounted by their length."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


# ---- per-token estimators ---------------------------------------------------------------------


@ADVANTAGES.register("reinforce_pp", kind="token", settings=("gamma",))
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): A_t = whiten(G_t) with G_t = sum_{k >= t} gamma^(k-t) r_k.

    token_rewards [B, T] come from `token_level_rewards` (-kl_coef * kl_t on every token, outcome
    reward at the last valid token). The returns are whitened over all valid tokens of the global
    batch (not per group), so call this on the whole step's batch. Masked positions are 0.
    """
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


@ADVANTAGES.register("gae", kind="token", inputs=("values",), settings=("gamma", "lam", "whiten_advantages"))
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) with a learned critic; returns (advantages, returns), both [B, T].

    delta_t = r_t + gamma * V_{t'} - V_t, where t' is the next valid token (V = 0 past the last);
    A_t = delta_t + gamma * lam * A_{t'}; returns R_t = A_t + V_t (the critic's target).
    lam=1 gives A_t = G_t - V_t (Monte-Carlo return minus value); lam=0 gives one-step TD.
    Masked positions inside a row (an episode's observation tokens) are skipped: value and
    advantage carry across them from the next model turn, as verl and OpenRLHF do for multi-turn,
    rather than the recursion restarting there. Masked positions are 0 in the outputs.
    With `whiten_advantages` (PPO's usual choice) the advantages are whitened over the batch's valid
    tokens; `returns` are always from the raw advantages.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a_t = (delta + gamma * lam * next_adv) * m
        adv[:, t] = a_t
        # a masked position leaves both as they were: the next valid token's
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = a_t + (1 - m) * next_adv
    returns = (adv + values) * mask
    return (whiten(adv, mask) if whiten_advantages else adv), returns
