"""Policy losses and loss aggregation: pure tensor functions, registered by name.

Every per-token tensor has shape [B, T] with `mask` 1 on completion tokens. Aggregation returns a
*sum* divided by a normalizer that the caller computes over the whole mini-batch on all ranks
(`LossNormalizer`), so splitting a mini-batch into micro-batches and data-parallel ranks gives
exactly the gradient of the unsplit loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.registry import Registry

POLICY_LOSSES = Registry("policy loss", "algorithm.policy_loss")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass(frozen=True)
class LossNormalizer:
    """Token and sequence counts of a whole mini-batch (across micro-batches and ranks)."""

    tokens: float
    sequences: float

    @staticmethod
    def of(mask: torch.Tensor) -> "LossNormalizer":
        return LossNormalizer(tokens=float(mask.sum()), sequences=float((mask.sum(-1) > 0).sum()))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: LossNormalizer) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to the scalar this micro-batch contributes.

    token_mean:           sum of all tokens / tokens in mini-batch (DAPO, TRL default)
    seq_mean_token_mean:  mean over tokens of each sequence, then / sequences (GRPO paper)
    seq_mean_token_sum:   sum over tokens of each sequence, then / sequences
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / max(norm.tokens, 1.0)
    per_seq_sum = (per_token * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1.0)).sum() / max(norm.sequences, 1.0)
    if mode == "seq_mean_token_sum":
        return per_seq_sum.sum() / max(norm.sequences, 1.0)
    raise KeyError(f"algorithm.loss_agg={mode!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, per token: -min(ratio*A, clip(ratio, 1-el, 1+eh)*A).

    Returns (per-token loss, per-token 0/1 flag of where clipping was active).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(loss.dtype)
