"""Per-token KL estimators between the policy and a reference (Schulman, 'Approximating KL').

With log-ratio d = logp - ref_logp, on tokens sampled from the policy:
  k1 = d                       unbiased, high variance, can be negative
  k2 = d^2 / 2                 biased, low variance
  k3 = exp(-d) - 1 + d         unbiased, always >= 0 (GRPO's choice)
  k3_clamped = clamp(k3, -10, 10)   k3 with outliers capped ("low_var_kl" in verl)

Registered with kind "unbiased" or "biased" (the expectation over sampled tokens), each called as
`fn(logp [B,T], ref_logp [B,T]) -> [B,T]`. Controllers that set the KL coefficient over training
live in `rl/algo/kl_control.py`.
"""

from __future__ import annotations

import torch

from rl.algo.registry import Registry

KL_ESTIMATORS = Registry("KL estimator", "algorithm.kl_estimator", kinds=("unbiased", "biased"))


@KL_ESTIMATORS.register("k1", kind="unbiased")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", kind="biased")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3", kind="unbiased")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)  # clamp keeps exp finite on outliers
    return torch.exp(log_ratio) - 1.0 - log_ratio


@KL_ESTIMATORS.register("k3_clamped", kind="biased")
def kl_k3_clamped(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10]: a token whose log-ratio is far out (k3 grows like exp(-d)) adds at
    most 10 nats and no gradient, which keeps the penalty's variance low."""
    return kl_k3(logp, ref_logp).clamp(-10.0, 10.0)
