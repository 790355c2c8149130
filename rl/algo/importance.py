"""Correcting for the behaviour policy: samples come from the rollout engine's weights (a version
or more behind with asynchronous rollouts, and numerically different even when not), while the
loss is that of the learner's policy. Where each correction's definition comes from:

- token_tis, truncated IS: each token weighted by its ratio pi_learner / pi_behaviour capped at
  `tis_cap` (Ionides 2008; Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training", the TIS of verl's rollout_corr docs);
- token_mis, masked IS: the ratio as weight, but a token above `mis_cap` gets none at all instead
  of the cap (Yao et al.'s follow-up "masked importance sampling"; ms-swift's `token_mask`,
  verl's token-level rejection in docs/algo/rollout_corr.md);
- icepop: a two-sided token mask, the ratio as weight inside [icepop_low, icepop_high], 0 outside
  (IcePop, the Ring-1T report, Ling Team 2025, arXiv 2510.18855; INTELLECT-3's loss, defaults
  0.5 and 5.0);
- seq_mask: whole sequences dropped whose geometric-mean ratio (the mean log-ratio over their
  tokens, exponentiated) leaves [seq_mask_low, seq_mask_high] (verl's `geometric` rejection mode,
  docs/algo/rollout_corr.md; the sequence-level masking of Yao et al.).

With `behaviour_clip` the correction is PPO's own clipped ratio taken against the behaviour
policy (with off-policy rollouts the learner passes the rollout log-probs as the "old" ones;
on-policy it changes nothing): no extra weight here.

Pure tensor functions: `learner_lp` is the learner's (pre-update) log-prob of each sampled token,
`behaviour_lp` the rollout engine's, both [B, T] with `mask` marking the tokens that count.

Each correction (`algorithm.importance_correction`) is registered with its kind: "none" (no
weight), "token" (a weight per token), "sequence" (one per sequence) or "ratio" (no weight: PPO's
ratio is taken against the behaviour policy instead); and the settings it takes (tis_cap, ...).
It is called as `fn(log_ratio [B,T], mask [B,T], **settings) -> (weights [B,T], metric sums)`.
"""

from __future__ import annotations

import math

import torch

from rl.algo.registry import Registry

IMPORTANCE_CORRECTIONS = Registry("importance correction", "algorithm.importance_correction",
                                  kinds=("none", "token", "sequence", "ratio"))


@IMPORTANCE_CORRECTIONS.register("none", kind="none")
def no_correction(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    return mask.clone(), {}


@IMPORTANCE_CORRECTIONS.register("behaviour_clip", kind="ratio")
def behaviour_clip(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """No weight: the correction is PPO's clipped ratio taken against the behaviour policy."""
    return mask.clone(), {}


@IMPORTANCE_CORRECTIONS.register("token_tis", kind="token", settings=("tis_cap",))
def token_tis(log_ratio: torch.Tensor, mask: torch.Tensor,
              tis_cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling: each token weighted by min(ratio, tis_cap)."""
    ratio = log_ratio.exp()
    return ratio.clamp(max=tis_cap) * mask, {"is/capped_frac": float(((ratio > tis_cap).float() * mask).sum())}


@IMPORTANCE_CORRECTIONS.register("token_mis", kind="token", settings=("mis_cap",))
def token_mis(log_ratio: torch.Tensor, mask: torch.Tensor,
              mis_cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked importance sampling: each token weighted by its ratio, none above mis_cap."""
    ratio = log_ratio.exp()
    keep = (ratio <= mis_cap).float() * mask
    return ratio * keep, {"is/masked_frac": float((mask - keep).sum())}


@IMPORTANCE_CORRECTIONS.register("icepop", kind="token", settings=("icepop_low", "icepop_high"))
def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, icepop_low: float = 0.5,
           icepop_high: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """IcePop: each token weighted by its ratio inside [icepop_low, icepop_high], none outside."""
    ratio = log_ratio.exp()
    keep = ((ratio >= icepop_low) & (ratio <= icepop_high)).float() * mask
    return ratio * keep, {"is/masked_frac": float((mask - keep).sum())}


@IMPORTANCE_CORRECTIONS.register("seq_mask", kind="sequence", settings=("seq_mask_low", "seq_mask_high"))
def seq_mask(log_ratio: torch.Tensor, mask: torch.Tensor, seq_mask_low: float = 0.5,
             seq_mask_high: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Drop whole sequences whose geometric-mean ratio leaves [seq_mask_low, seq_mask_high]."""
    tokens = mask.sum(dim=1).clamp(min=1.0)
    seq_log_ratio = log_ratio.sum(dim=1) / tokens
    keep = (seq_log_ratio >= math.log(seq_mask_low)) & (seq_log_ratio <= math.log(seq_mask_high))
    return mask * keep.unsqueeze(1).float(), {"is/masked_frac": float((mask * (~keep).unsqueeze(1).float()).sum())}


def ratio_against_behaviour(mode: str) -> bool:
    """Whether correction `mode` takes PPO's ratio against the behaviour policy (kind "ratio")."""
    return IMPORTANCE_CORRECTIONS.entry(mode).kind == "ratio"


def importance_weights(learner_lp: torch.Tensor, behaviour_lp: torch.Tensor, mask: torch.Tensor, mode: str,
                       **settings: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights (detached, 0 off-mask) for the policy-gradient term, and metric sums:
    `is/capped_frac` / `is/masked_frac` (tokens), `_is/w_sum`, `_is/w_sq_sum` (for the effective
    sample size, reduced over ranks by `effective_sample_size`). `settings`: the correction's
    own (`IMPORTANCE_CORRECTIONS.settings(mode, algorithm config)`); omitted ones take defaults."""
    correction = IMPORTANCE_CORRECTIONS.entry(mode)
    mask = mask.float()
    log_ratio = (learner_lp.detach().float() - behaviour_lp.float()) * mask
    weights, sums = correction.fn(log_ratio, mask, **settings)
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
    # at most 1 (Cauchy-Schwarz); on-policy ratios of 1 +- rounding summed in fp32 gave 1.000000008
    return min(1.0, w_sum * w_sum / (tokens * w_sq_sum))
