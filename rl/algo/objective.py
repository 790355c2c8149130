"""The learner's whole loss for one micro-batch, as a pure function of its tensors.

`policy_objective` puts together what `algorithm.*` picks: the clipped policy loss (its ratio
taken against the old or the behaviour policy), the behaviour-policy importance weights, the KL
penalty, the entropy bonus and the aggregation. The learner only runs the forward, calls this and
backpropagates `loss`, so every branch of the objective can be checked on small hand-made tensors
without DeepSpeed. The statistics come back as plain sums (the learner adds them to its metric
sums, which the group reduces over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl.algo.importance import IMPORTANCE_CORRECTIONS, importance_weights, ratio_against_behaviour
from rl.algo.kl import KL_ESTIMATORS
from rl.algo.losses import POLICY_LOSSES, LossNormalizer, aggregate, value_loss, with_entropy_bonus
from rl.config.schema import AlgorithmConfig


@dataclass(frozen=True)
class PolicyObjective:
    """One micro-batch's policy loss and the sums its metrics are made of (over masked tokens)."""

    loss: torch.Tensor  # scalar, carries the gradient (to logp, and to entropy when entropy_coef > 0)
    pg_loss_sum: float  # sum of the per-token policy-gradient loss, before weights, KL and entropy
    clipped_sum: float  # tokens whose gradient the policy loss's clip removed
    kl_sum: float | None  # sum of the per-token KL estimate; None when the loss has no KL term
    importance_sums: dict[str, float] = field(default_factory=dict)  # importance_weights' metric sums
    router_aux: float | None = None  # this micro-batch's share of the routers' load-balancing loss (MoE)


@dataclass(frozen=True)
class ValueObjective:
    """One micro-batch's critic loss and the sums of its metrics (over masked tokens)."""

    loss: torch.Tensor  # scalar, carries the gradient to values
    clipped_sum: float  # tokens where the clipped value term was the larger
    abs_error_sum: float  # sum of |V - R|


def ratio_base(old: torch.Tensor, behaviour: torch.Tensor, algo: AlgorithmConfig) -> torch.Tensor:
    """The log-probs PPO's ratio is taken against. With behaviour_clip and off-policy rollouts the
    trust region is around the policy that sampled; on-policy the sampler is the old policy, so the
    ratio stays PPO's own (and the rollout engine's numerical drift stays out of it)."""
    if ratio_against_behaviour(algo.importance_correction) and algo.off_policy_steps > 0:
        return behaviour
    return old


def policy_objective(
    logp: torch.Tensor,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    norm: LossNormalizer,
    kl_coef: float,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    router_aux: torch.Tensor | None = None,
) -> PolicyObjective:
    """The policy loss of a micro-batch; every tensor is [B, T] with `mask` 1 on the tokens that count.

    `logp` is the learner's log-prob of each sampled token (with grad), `old` the pre-update
    policy's, `behaviour` the rollout engine's. `entropy` is needed only when
    algo.entropy_coef > 0. The KL term is in the loss only with `ref_logprobs` and not
    algo.kl_in_reward (then the penalty is already in the rewards). `norm` counts the whole
    mini-batch on all ranks, so micro-batch losses add up to the mini-batch's. Only `logp` and
    `entropy` get a gradient: the other tensors are targets, detached here whatever the caller did.
    `router_aux` (a scalar, needed only when algo.router_aux_loss_coef > 0): the micro-batch's mean
    MoE load-balancing loss, weighted by its share of the mini-batch's tokens (so the shares add up
    to the mini-batch's token-weighted mean) and by the coefficient; its gradient reaches the routers.
    """
    old, behaviour, advantages = old.detach(), behaviour.detach(), advantages.detach()
    ref_logprobs = None if ref_logprobs is None else ref_logprobs.detach()
    pg_loss, clipped = POLICY_LOSSES.get(algo.policy_loss)(
        logp, ratio_base(old, behaviour, algo), advantages, mask=mask, **POLICY_LOSSES.settings(algo.policy_loss, algo))
    weights, is_sums = importance_weights(old, behaviour, mask, algo.importance_correction,
                                          **IMPORTANCE_CORRECTIONS.settings(algo.importance_correction, algo))
    per_token = pg_loss * weights
    kl_sum = None
    if ref_logprobs is not None and not algo.kl_in_reward:
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(logp, ref_logprobs)
        per_token = per_token + kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    if algo.entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"algorithm.entropy_coef={algo.entropy_coef} adds an entropy bonus: pass the "
                             "per-token entropy (token_logprobs(..., with_entropy=True, entropy_grad=True))")
        per_token = with_entropy_bonus(per_token, entropy, algo.entropy_coef)
    loss = aggregate(per_token, mask, algo.loss_agg, norm)
    router_share = None
    if algo.router_aux_loss_coef > 0:
        if router_aux is None:
            raise ValueError(f"algorithm.router_aux_loss_coef={algo.router_aux_loss_coef} adds the routers' "
                             "load-balancing loss: pass it (token_logprobs(..., router_aux=[]))")
        share = router_aux * (float(mask.sum()) / max(norm.tokens, 1.0))
        loss = loss + algo.router_aux_loss_coef * share
        router_share = float(share.detach())
    return PolicyObjective(
        loss=loss,
        pg_loss_sum=float((pg_loss.detach() * mask).sum()),
        clipped_sum=float((clipped * mask).sum()),
        kl_sum=kl_sum,
        importance_sums=is_sums,
        router_aux=router_share,
    )


def value_objective(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    norm: LossNormalizer,
) -> ValueObjective:
    """The critic's clipped value loss (algo.value_clip; 0 = unclipped), averaged over the
    mini-batch's tokens whatever algo.loss_agg is: a regression target per token, not a per-sequence
    policy gradient. Only `values` gets a gradient."""
    old_values, returns = old_values.detach(), returns.detach()
    per_token, clipped = value_loss(values, old_values, returns, algo.value_clip or None)
    loss = aggregate(per_token, mask, "token_mean", norm)
    return ValueObjective(
        loss=loss,
        clipped_sum=float((clipped * mask).sum()),
        abs_error_sum=float(((values.detach() - returns).abs() * mask).sum()),
    )
