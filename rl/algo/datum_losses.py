"""The loss functions a Tinker-protocol client names in `forward_backward` (`launch/tinker/`), as
pure tensor functions over one datum's tokens.

A datum is one sequence: the model reads its input tokens and at position t predicts
`target_tokens[t]`, whose log-prob under the model being trained is `logp[t]`. Every other input
(`weights`, the sampler's `logprobs`, `advantages`) is per position too. The client's own code does
all the normalising (its advantages and weights carry it), so each loss is a plain *sum* over the
datum's positions, and a batch's loss is the sum over its data, as the Tinker documentation defines
them. The policy-gradient losses are our registered ones (rl/algo/losses.py) on those sums:
`importance_sampling` is the PPO surrogate without a clip; `ppo`, `cispo` and `gspo` take the
client's ratio bounds (`clip_low_threshold`, `clip_high_threshold`, e.g. 0.8 and 1.2) as our
`clip_eps_low = 1 - low`, `clip_eps_high = high - 1`. `dro` is Tinker's as its documentation
defines it: `-(logp * advantages - beta / 2 * (logp - sampler_logprobs)^2)` per position, with the
client's `beta` (required: the hosted service's default is not published).

`stable_reinforce` is not served: its objective reads "stability information" the hosted sampler
records for each sequence it samples (`record_stability_info=True`), which a training datum names
only by `sequence_id` (its provenance spans); what that information is and how the loss uses it are
not published, and it never crosses the protocol, so no service but the hosted one can compute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rl.algo.losses import cispo_loss, gspo_loss, ppo_clip_loss

# loss -> (inputs it needs besides target_tokens, config keys it takes with their defaults; None: required)
DATUM_LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float | None]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "gspo": (("logprobs", "advantages", "sequence_ratio_mask"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": (("logprobs", "advantages"), {"beta": None}),
}
# losses of the protocol this service refuses, and why (each refusal names the served ones too)
NOT_SERVED = {
    "stable_reinforce": "its objective reads the stability information the hosted Tinker sampler records per sampled "
                        "sequence (record_stability_info=True); a datum carries only that sequence's sequence_id in "
                        "its provenance spans, and what is recorded and how the loss uses it are not published, so "
                        "only the hosted service can compute it. Train with importance_sampling, ppo, cispo or dro "
                        "(the cookbook: loss_fn=importance_sampling)",
    "custom": "custom losses run client-side: forward_backward_custom (the SDK's, over cross_entropy) is served",
}


class DatumLossError(ValueError):
    """A loss the client asked for that cannot be computed as asked (the client's fault: a 400)."""


@dataclass(frozen=True)
class DatumLoss:
    """A checked choice of loss: its name and its settings (defaults filled in)."""

    name: str
    config: Mapping[str, float]

    @staticmethod
    def of(name: str, config: Mapping[str, Any] | None) -> "DatumLoss":
        """Check `name` and `config`: an unknown loss, an unknown key or a bound out of range is a
        DatumLossError naming it and the choices."""
        if name not in DATUM_LOSSES:
            why = f": {NOT_SERVED[name]}" if name in NOT_SERVED else ""
            raise DatumLossError(f"loss_fn={name!r} is not served here{why}; choose one of {sorted(DATUM_LOSSES)}")
        _, defaults = DATUM_LOSSES[name]
        config = dict(config or {})
        unknown = sorted(set(config) - set(defaults))
        if unknown:
            raise DatumLossError(f"loss_fn_config keys {unknown} are not taken by loss_fn={name!r} "
                                 f"(it takes {sorted(defaults) or 'none'})")
        missing = sorted(k for k, v in defaults.items() if v is None and k not in config)
        if missing:
            raise DatumLossError(f"loss_fn={name!r} needs loss_fn_config {missing} (e.g. {{'beta': 0.05}} as in "
                                 "Tinker's docs; the hosted service's default is not published, so none is assumed)")
        try:
            merged = {**defaults, **{k: float(v) for k, v in config.items()}}
        except (TypeError, ValueError):
            raise DatumLossError(f"loss_fn_config {config}: every value must be a number") from None
        for key, value in merged.items():
            if not math.isfinite(value):
                raise DatumLossError(f"loss_fn_config.{key}={value} must be a finite number")
        if merged.get("beta", 0.0) < 0:
            raise DatumLossError(f"loss_fn_config.beta={merged['beta']} must be >= 0 (the weight of the quadratic "
                                 "penalty)")
        if "clip_low_threshold" in merged and not 0.0 <= merged["clip_low_threshold"] <= 1.0 <= merged["clip_high_threshold"]:
            raise DatumLossError(f"loss_fn_config: clip_low_threshold={merged['clip_low_threshold']} and "
                                 f"clip_high_threshold={merged['clip_high_threshold']} must satisfy 0 <= low <= 1 "
                                 "<= high (they bound the probability ratio, e.g. 0.8 and 1.2)")
        return DatumLoss(name, merged)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("target_tokens", *DATUM_LOSSES[self.name][0])


def datum_loss(loss: DatumLoss, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the datum's loss, a scalar sum; the per-position loss [T]) of `logp` [T], the log-probs of
    its target tokens under the model being trained (with gradient), and its `inputs` [T] each."""
    if loss.name == "cross_entropy":
        per_token = -inputs["weights"].to(logp.dtype) * logp
        return per_token.sum(), per_token
    sampler = inputs["logprobs"].to(logp.dtype)[None]
    advantages = inputs["advantages"].to(logp.dtype)[None]
    if loss.name == "dro":  # minus (logp * A - beta/2 * (logp - q)^2), as Tinker's docs implement it
        per_token = -(logp[None] * advantages - 0.5 * loss.config["beta"] * (logp[None] - sampler) ** 2)
    elif loss.name == "importance_sampling":
        per_token, _ = ppo_clip_loss(logp[None], sampler, advantages, math.inf, math.inf)
    else:
        eps_low, eps_high = 1.0 - loss.config["clip_low_threshold"], loss.config["clip_high_threshold"] - 1.0
        if loss.name == "ppo":
            per_token, _ = ppo_clip_loss(logp[None], sampler, advantages, eps_low, eps_high)
        elif loss.name == "cispo":
            per_token, _ = cispo_loss(logp[None], sampler, advantages, eps_low, eps_high)
        else:  # gspo: the sequence's ratio is the mean log-ratio over the positions its mask marks
            per_token, _ = gspo_loss(logp[None], sampler, advantages, eps_low, eps_high,
                                     mask=(inputs["sequence_ratio_mask"] != 0).to(logp.dtype)[None])
    return per_token.sum(), per_token[0]
