"""Per-token KL estimators between the policy and a reference (Schulman, 'Approximating KL').

With log-ratio d = logp - ref_logp, on tokens sampled from the policy:
  k1 = d                       unbiased, high variance, can be negative
  k2 = d^2 / 2                 biased, low variance
  k3 = exp(-d) - 1 + d         unbiased, always >= 0 (GRPO's choice)
"""

from __future__ import annotations

import torch

from rl.registry import Registry

KL_ESTIMATORS = Registry("KL estimator", "algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)  # clamp keeps exp finite on outliers
    return torch.exp(log_ratio) - 1.0 - log_ratio
