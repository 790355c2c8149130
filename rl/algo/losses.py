"""Policy and value losses and loss aggregation: pure tensor functions, registered by name.

Every per-token tensor has shape [B, T] with `mask` 1 on completion tokens. Aggregation returns a
*sum* divided by a normalizer that the caller computes over the whole mini-batch on all ranks
(`LossNormalizer`), so splitting a mini-batch into micro-batches and data-parallel ranks gives
exactly the gradient of the unsplit loss.

Every registered policy loss is called as
    fn(logp, old_logp, advantages, mask=mask, **POLICY_LOSSES.settings(name, algorithm_config))
    -> (loss [B,T], clipped [B,T])
where `clipped` is a 0/1 flag of tokens whose gradient the clipping removed (for `actor/clip_frac`;
for `cispo`, which removes no gradient, the tokens whose importance weight was clipped). Its kind
says what its importance ratio is over: "token" or "sequence"; its settings are the config fields
it takes (clip_eps_low, clip_eps_high, ...).

Every registered loss aggregation is called as `fn(per_token [B,T], mask [B,T], norm) -> scalar`
through `aggregate`; its kind says what it averages over ("token" or "sequence"), and the input
"max_response_len" that it divides by `norm.max_response_len`, which must then be set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algo.registry import Registry

POLICY_LOSSES = Registry("policy loss", "algorithm.policy_loss", kinds=("token", "sequence"), inputs=("mask",))
LOSS_AGGREGATORS = Registry("loss aggregation", "algorithm.loss_agg", kinds=("token", "sequence"),
                            inputs=("max_response_len",))
_CLIP = ("clip_eps_low", "clip_eps_high")


@dataclass(frozen=True)
class LossNormalizer:
    """Token and sequence counts of a whole mini-batch (across micro-batches and ranks).

    `max_response_len` is the generation budget (rollout.max_new_tokens), a constant needed only by
    `seq_mean_token_sum_norm`.
    """

    tokens: float
    sequences: float
    max_response_len: float = 0.0

    @staticmethod
    def of(mask: torch.Tensor, max_response_len: float = 0.0) -> "LossNormalizer":
        sequences = float((mask.sum(-1) > 0).sum())
        return LossNormalizer(tokens=float(mask.sum()), sequences=sequences, max_response_len=float(max_response_len))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: LossNormalizer) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to the scalar this micro-batch contributes, as the loss
    aggregation `mode` (algorithm.loss_agg) does; KeyError for an unknown one."""
    aggregation = LOSS_AGGREGATORS.entry(mode)
    if "max_response_len" in aggregation.inputs and norm.max_response_len <= 0:
        raise ValueError(
            f"algorithm.loss_agg={mode} divides by the generation budget: build the "
            "LossNormalizer with max_response_len=rollout.max_new_tokens"
        )
    return aggregation.fn(per_token, mask.to(per_token.dtype), norm)


@LOSS_AGGREGATORS.register("token_mean", kind="token")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Sum of all tokens / tokens in the mini-batch (DAPO, TRL's default)."""
    return (per_token * mask).sum() / max(norm.tokens, 1.0)


@LOSS_AGGREGATORS.register("seq_mean_token_mean", kind="sequence")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Mean over the tokens of each sequence, then / sequences in the mini-batch (GRPO paper)."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(norm.sequences, 1.0)


@LOSS_AGGREGATORS.register("seq_mean_token_sum", kind="sequence")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Sum over the tokens of each sequence, then / sequences in the mini-batch."""
    return (per_token * mask).sum() / max(norm.sequences, 1.0)


@LOSS_AGGREGATORS.register("seq_mean_token_sum_norm", kind="sequence", inputs=("max_response_len",))
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Sum of all tokens / (max_response_len * sequences), a constant that does not depend on the
    lengths sampled (Dr.GRPO, Liu et al. 2025), so long and short answers get the same per-token weight."""
    return (per_token * mask).sum() / (norm.max_response_len * max(norm.sequences, 1.0))


LOSS_AGGREGATIONS = tuple(LOSS_AGGREGATORS.names())  # every algorithm.loss_agg


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(loss.dtype)


@POLICY_LOSSES.register("ppo_clip", kind="token", settings=_CLIP)
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017), per token: -min(r*A, clip(r, 1-el, 1+eh)*A).

    r = exp(logp - old_logp). Separate el/eh (eh > el) is DAPO's clip-higher (Yu et al. 2025).
    With `clip_ratio_c` (> 1, e.g. 3) this is dual-clip PPO (Ye et al. 2020): for A < 0 the loss is
    also capped at -clip_ratio_c * A, so a token whose ratio exploded cannot dominate the update.
    `mask` is accepted for a uniform signature and unused (the loss is per token).
    Returns (per-token loss, per-token 0/1 flag of where either clip was active).
    """
    loss, clipped = _clipped_surrogate(torch.exp(logp - old_logp), advantages, clip_eps_low, clip_eps_high)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"algorithm.clip_ratio_c={clip_ratio_c}: dual clip needs a value > 1, e.g. 3.0")
        cap = -clip_ratio_c * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = torch.maximum(clipped, dual.to(loss.dtype))
    return loss, clipped


@POLICY_LOSSES.register("ppo_dual_clip", kind="token", settings=(*_CLIP, "clip_ratio_c"))
def ppo_dual_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020): `ppo_clip` with the A < 0 loss capped at -clip_ratio_c * A."""
    return ppo_clip_loss(logp, old_logp, advantages, clip_eps_low, clip_eps_high, clip_ratio_c)


@POLICY_LOSSES.register("gspo", kind="sequence", inputs=("mask",), settings=_CLIP)
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token (Zheng et al. 2025): the clipped surrogate on a sequence-level ratio.

    s_i = exp(mean over the valid tokens t of sequence i of (logp_t - old_logp_t)), and per token
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i, its gradient s_i * grad log pi(y_t).
    Loss per token: -min(s_i,t * A_t, clip(s_i,t, 1-el, 1+eh) * A_t) with the paper's small
    el=3e-4, eh=4e-4 (pass them explicitly: the ppo defaults of 0.2 are far too wide here). With a
    sequence-level advantage and loss_agg=seq_mean_token_mean this is the paper's objective.
    `mask` [B, T] (required) selects the tokens of the mean. The sequence log-ratio is clamped at
    10 before exp (value only) so that one stale sample cannot overflow.
    """
    if mask is None:
        raise ValueError("algorithm.policy_loss=gspo averages the log-ratio over each sequence: pass mask=loss_mask")
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    token_log_ratio = seq_log_ratio.detach().clamp(max=10.0) + logp - logp.detach()
    return _clipped_surrogate(torch.exp(token_log_ratio), advantages, clip_eps_low, clip_eps_high)


@POLICY_LOSSES.register("cispo", kind="token", settings=_CLIP)
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 1.0,
    clip_eps_high: float = 0.28,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update, per token:
    -sg(clip(r, 1-el, 1+eh)) * A * logp with r = exp(logp - old_logp). Every token keeps its
    gradient (-clip(r) * A on logp), where PPO's clip drops the gradient of tokens out of the band,
    often the rare tokens that matter; the paper sets no lower bound (el=1: weights >= 0) and tunes
    eh. `mask` is accepted for a uniform signature and unused. Returns (per-token loss, 0/1 flag
    of tokens whose weight was clipped)."""
    ratio = torch.exp(logp - old_logp).detach()
    weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -weight * advantages * logp, (weight != ratio).to(logp.dtype)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token entropy H_t = logsumexp(z) - sum_v softmax(z)_v z_v of logits [B, T, V] -> [B, T].

    Masked positions are 0 when `mask` is given. Divide logits by the sampling temperature first.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
    return entropy if mask is None else entropy * mask.to(entropy.dtype)


def with_entropy_bonus(per_token_loss: torch.Tensor, entropy: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """loss_t - entropy_coef * H_t: maximising entropy keeps exploration (Mnih et al. 2016).

    Apply before `aggregate`, so the bonus is reduced with the same mode and normalizer as the loss.
    """
    return per_token_loss - entropy_coef * entropy if entropy_coef else per_token_loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_eps_v: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss, per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -ev, ev) - R)^2).

    The critic may not move its prediction more than ev away from the rollout-time value V_old
    unless that brings it closer to the target (Schulman et al. 2017; as in OpenAI baselines).
    `clip_eps_v=None` gives the plain 0.5 * (V - R)^2. Aggregate it like the policy loss.
    Returns (per-token loss, per-token 0/1 flag of where the clipped term was the larger).
    """
    plain = (values - returns) ** 2
    if clip_eps_v is None:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps_v, clip_eps_v)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), (clipped > plain).to(plain.dtype)
