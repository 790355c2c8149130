"""Pairwise-preference math for reward models (Bradley-Terry), on plain tensors.

A reward model r scores a (prompt, completion) pair with one number. Bradley-Terry models the
chance that `chosen` beats `rejected` as sigmoid(r_chosen - r_rejected); training maximises that
likelihood, i.e. minimises

    loss = -log sigmoid(r_chosen - r_rejected - margin)

An optional margin (a constant, or one value per pair as in Llama 2's reward models) asks the
model to separate clearly-better pairs by at least that much before the loss flattens out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """-log sigmoid(chosen - rejected - margin), per pair ("none") or averaged ("mean") / summed.

    `chosen` and `rejected` are rewards of shape (pairs,); `margin` is a float or a tensor of the
    same shape. logsigmoid is evaluated stably, so large reward gaps do not overflow.
    """
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} rewards differ in shape")
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - (margin.float() if isinstance(margin, torch.Tensor) else float(margin))
    losses = -F.logsigmoid(diff)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.mean()
    raise ValueError(f"reduction={reduction!r}: choose none, mean or sum")


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs the model orders correctly; a tie counts as half (a constant model gets 0.5)."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} rewards differ in shape")
    if chosen.numel() == 0:
        return float("nan")
    wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return float(wins.mean())


def preference_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None
) -> dict[str, float]:
    """Loss, accuracy and reward statistics of a batch of scored pairs (for logging)."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    return {
        "loss": float(bradley_terry_loss(chosen, rejected, margin)),
        "pairwise_accuracy": pairwise_accuracy(chosen, rejected),
        "reward_gap_mean": float((chosen - rejected).mean()),
        "chosen_reward_mean": float(chosen.mean()),
        "rejected_reward_mean": float(rejected.mean()),
    }
