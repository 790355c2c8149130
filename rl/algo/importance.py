"""Correcting for the behaviour policy: samples come from the rollout engine's weights (a version
or more behind with asynchronous rollouts, and numerically different even when not), while the
loss is that of the learner's policy. Truncated importance sampling reweights each token by
pi_learner / pi_behaviour capped at `cap` (Ionides 2008; "Your efficient RL framework secretly
brings you off-policy RL training", Yao et al. 2025); sequence masking instead drops whole
sequences whose geometric-mean ratio is extreme.

With `behaviour_clip` the correction is PPO's own clipped ratio taken against the behaviour
policy (with off-policy rollouts the learner passes the rollout log-probs as the "old" ones;
on-policy it changes nothing): no extra weight here.

Pure tensor functions: `learner_lp` is the learner's (pre-update) log-prob of each sampled token,
`behaviour_lp` the rollout engine's, both [B, T] with `mask` marking the tokens that count.
"""

from __future__ import annotations

import math

import torch


def importance_weights(learner_lp: torch.Tensor, behaviour_lp: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights (detached, 0 off-mask) for the policy-gradient term, and metric sums:
    `is/capped_frac` / `is/masked_frac` (tokens), `_is/w_sum`, `_is/w_sq_sum` (for the effective
    sample size, reduced over ranks by `effective_sample_size`)."""
    mask = mask.float()
    log_ratio = (learner_lp.detach().float() - behaviour_lp.float()) * mask
    sums: dict[str, float] = {}
    if mode in ("none", "behaviour_clip"):  # behaviour_clip: PPO's ratio is taken against the behaviour policy
        weights = mask.clone()
    elif mode == "token_tis":
        ratio = log_ratio.exp()
        weights = ratio.clamp(max=cap) * mask
        sums["is/capped_frac"] = float(((ratio > cap).float() * mask).sum())
    elif mode == "seq_mask":
        tokens = mask.sum(dim=1).clamp(min=1.0)
        seq_log_ratio = log_ratio.sum(dim=1) / tokens
        keep = (seq_log_ratio >= math.log(low)) & (seq_log_ratio <= math.log(high))
        weights = mask * keep.unsqueeze(1).float()
        sums["is/masked_frac"] = float((mask * (~keep).unsqueeze(1).float()).sum())
    else:
        raise ValueError(f"unknown importance correction {mode!r}: none, token_tis or seq_mask")
    # the ESS of the weights the uncorrected loss would use (ratios), as a share of the tokens
    ratio = log_ratio.exp() * mask
    sums["_is/w_sum"] = float(ratio.sum())
    sums["_is/w_sq_sum"] = float((ratio * ratio).sum())
    return weights, sums


def effective_sample_size(w_sum: float, w_sq_sum: float, tokens: float) -> float:
    """Kish's effective sample size of the importance ratios as a share of the tokens: 1.0 when
    every ratio is equal (on-policy), towards 1/tokens when one token carries all the weight."""
    if tokens <= 0 or w_sq_sum <= 0:
        return 1.0
    return w_sum * w_sum / (tokens * w_sq_sum)
