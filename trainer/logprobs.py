"""Per-token log-probs and entropy of a causal LM on right-padded sequences, without ever
holding the full `[rows, tokens, vocab]` logits.

A real vocabulary (49k-150k entries) makes the LM head the largest activation by far: 32 rows of
128 tokens over 49,152 entries are 0.8 GB in fp32, times the copies a plain `log_softmax` makes.
Here the model runs up to its final hidden states only; the LM head is applied to the positions
that are asked for (the completion tokens: prompts are never trained on), a chunk of tokens at a
time, each chunk under activation checkpointing, so its logits exist only while that chunk's
log-probs are computed (and again, briefly, in the backward pass).

A plain linear head (no bias, not partitioned by ZeRO-3, not wrapped by an adapter, logits not
reshaped after it (`logit_shaping`): every dense and ZeRO-1/2 run of most models) goes through
`_LinearHeadLogProbs`, whose backward is written out: it recomputes the chunk's matmul from the
saved rows and log-normaliser and forms d logp / d logits = onehot - p in place, where autograd
through a recomputed `logsumexp`/`gather` made three more vocabulary-wide passes and temporaries. Any other head recomputes the chunk under activation checkpointing.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from rl.plan.memory_plan import LOGPROB_CHUNK_TOKENS as CHUNK_TOKENS  # 1024 x 49,152 x 4 bytes = 200 MB in fp32
from trainer.layouts import Layout, plan_layout


def _head_of(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head (output embeddings) of a model, a peft wrapper or a DeepSpeed engine."""
    inner = getattr(model, "module", model)  # DeepSpeedEngine.module
    return inner.get_output_embeddings()


def logit_shaping(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's forward does to its LM head's output before returning logits, from its
    config (None: nothing): Gemma 2/3 soft-cap them (`final_logit_softcapping`: c tanh(z / c)),
    Granite divides them (`logits_scaling`), Cohere multiplies them (`logit_scale`). vLLM applies
    the same before sampling, so log-probs computed from the head alone would be off-policy (for
    a real Gemma, whose logits reach the cap, by far more than any tolerance)."""
    config = getattr(getattr(model, "module", model), "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    divide = getattr(config, "logits_scaling", None)
    multiply = getattr(config, "logit_scale", None)
    if cap:
        return lambda z: torch.tanh(z / cap) * cap
    if divide and divide != 1.0:
        return lambda z: z / divide
    if multiply and multiply != 1.0:
        return lambda z: z * multiply
    return None


def _entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = log Z - sum_v p_v z_v, a dot product per row (no vocabulary-wide `p * z` temporary; as
    fast as `(softmax * z).sum(-1)` on 1024 x 49,152 fp32, 0.13 s on 2 cores; exp(z - lse) in its
    place took 0.20 s)."""
    return lse - torch.linalg.vecdot(torch.softmax(logits, dim=-1), logits)


class _FirstPass:
    """The entropy of a chunk as a metric (no gradient), kept from the chunk's first forward:
    checkpointing runs the chunk again inside the backward pass, where a metric is not needed, so
    the second run skips it (it saves no tensor for backward, so both runs save the same ones)."""

    def __init__(self) -> None:
        self.entropy: torch.Tensor | None = None


def _plain_linear_weight(head: torch.nn.Module) -> torch.Tensor | None:
    """The head's full weight when the head is a bias-free `nn.Linear` whose weight is all here
    (ZeRO-3 partitions it and gathers it in module hooks only; an adapter wraps the layer)."""
    if type(head) is torch.nn.Linear and head.bias is None and not hasattr(head.weight, "ds_id"):
        return head.weight
    return None


class _LinearHeadLogProbs(torch.autograd.Function):
    """log p(target) of `hidden` [N, H] rows through `weight` [V, H], logits in fp32 scaled by
    `scale` (1 / temperature), and their entropy when `entropy` is "grad" (differentiable) or
    "metric" (a value, no gradient); "none" returns an empty tensor in its place.

    Saved for backward: the rows (already held by the model's graph), the targets and the fp32
    log-normaliser, N values. The backward recomputes z = scale * h W^T and forms, in place,
    dL/dz = g_lp * (onehot - p) - g_ent * p * (log p + H), then dh = dz W and dW = dz^T h."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float,
                entropy: str) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _scaled_logits(hidden, weight, scale)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ent = _entropy(logits, lse) if entropy != "none" else logp.new_empty(0)
        ctx.scale, ctx.entropy_grad = scale, entropy == "grad"
        ctx.save_for_backward(hidden, weight, targets, lse, ent if entropy == "grad" else None)
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        log_p = _scaled_logits(hidden, weight, ctx.scale).sub_(lse.unsqueeze(-1))
        if ctx.entropy_grad and g_ent is not None:
            p = log_p.exp()
            dz = log_p.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1)).mul_(p).neg_()
            del p
        else:
            dz = log_p.exp_().mul_(g_logp.neg().unsqueeze(-1))
        dz.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
        if ctx.scale != 1.0:
            dz.mul_(ctx.scale)
        del log_p  # the fp32 buffer `dz` was made in: freed before the matmuls when the model is bf16
        dz = dz.to(hidden.dtype)
        d_hidden = dz @ weight if ctx.needs_input_grad[0] else None
        d_weight = dz.t() @ hidden if ctx.needs_input_grad[1] else None
        return d_hidden, d_weight, None, None, None


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 logits of the rows (the matmul in the model's dtype, as the head computes it), scaled."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    return logits.mul_(scale) if scale != 1.0 else logits


def _chunk_logprobs(head: torch.nn.Module, shaping, temperature: float, entropy_grad: bool,
                    metric: _FirstPass | None, hidden: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) of `hidden` [N, H] rows in fp32, and their entropy: differentiable when
    `entropy_grad` (an entropy bonus), else zeros here and the value, on the first pass only, in
    `metric` (None: not asked for). `shaping`: `logit_shaping` of the model (None: none)."""
    logits = head(hidden).float()
    if shaping is not None:
        logits = shaping(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if entropy_grad:
        return logp, _entropy(logits, lse)
    if metric is not None and metric.entropy is None:
        with torch.no_grad():
            metric.entropy = _entropy(logits, lse)
    return logp, torch.zeros_like(logp)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    positions: torch.Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    router_aux: list[torch.Tensor] | None = None,
    layout: Layout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t in 0..T-2, shape [B, T-1] (fp32).

    Logits are divided by the sampling temperature so the values match what the rollout engine
    reports for the tokens it sampled (vLLM `processed_logprobs`, HF processed scores).
    `positions` ([B, T-1] bool): where the values are computed (0 elsewhere); default every
    position whose next token is real (`attention_mask[:, 1:]`). The learner asks for the loss
    mask's positions only. `entropy_grad=False`: the entropy is a metric only (no gradient).

    The model is called as usual (so a DeepSpeed engine's forward hooks run) for its last hidden
    states (`output_hidden_states`, with the logits of one position only); the LM head then runs
    on `chunk_tokens` selected tokens at a time. `layout`: how the rows enter the model, planned
    by the caller (trainer/layouts.py `plan_layout`: packed end to end, only for a model
    `packing_matches` has checked; shared-prefix trees, from the rows' groups); default padded.
    Every layout gives the same values.
    `router_aux` (a MoE model): the forward also computes the routers' load-balancing loss
    (transformers' `aux_loss`, from `output_router_logits`), appended to this list.
    """
    if positions is None:
        positions = attention_mask[:, 1:].bool()
    positions = positions.bool()
    if layout is None:
        layout = plan_layout(input_ids, attention_mask)
    if layout.name != "padded":  # a padded position has no place in the other layouts
        positions = positions & attention_mask[:, 1:].bool()
    routers = {} if router_aux is None else {"output_router_logits": True}
    out = model(**layout.model_inputs(next(_head_of(model).parameters()).dtype), use_cache=False, output_hidden_states=True,
                logits_to_keep=1, **routers)
    hidden = out.hidden_states[-1]
    rows, targets = layout.gather(hidden, positions), input_ids[:, 1:][positions]
    index = positions.flatten().nonzero().squeeze(1)  # boolean indexing's order: row-major
    if router_aux is not None:
        router_aux.append(out.aux_loss)
    spread = partial(_spread, index, positions.shape, hidden)
    head, shaping = _head_of(model), logit_shaping(model)
    entropy_grad = with_entropy and entropy_grad
    weight = _plain_linear_weight(head) if shaping is None else None
    if weight is not None:
        mode = "grad" if entropy_grad else "metric" if with_entropy else "none"
        parts = [_LinearHeadLogProbs.apply(rows[start:start + chunk_tokens], weight,
                                           targets[start:start + chunk_tokens], 1.0 / temperature, mode)
                 for start in range(0, rows.shape[0], chunk_tokens)]
        logps, entropies = [lp for lp, _ in parts], [ent for _, ent in parts]
        return spread(logps), spread(entropies) if with_entropy else None
    recompute = torch.is_grad_enabled() and rows.requires_grad
    # Non-reentrant checkpointing keeps one backward graph, so a trained head tied to the input
    # embedding gets one gradient, reduced once by ZeRO (reentrant: two, which ZeRO-1/2 refuse).
    # But ZeRO-3 does not gather a frozen weight again when it recomputes under it: a frozen head
    # (LoRA) recomputes reentrantly, as an ordinary forward pass inside the backward.
    reentrant = not any(p.requires_grad for p in head.parameters())
    logps, entropies = [], []
    for start in range(0, rows.shape[0], chunk_tokens):
        part = (rows[start:start + chunk_tokens], targets[start:start + chunk_tokens])
        metric = _FirstPass() if with_entropy and not entropy_grad else None
        step = partial(_chunk_logprobs, head, shaping, temperature, entropy_grad, metric)
        lp, ent = checkpoint(step, *part, use_reentrant=reentrant) if recompute else step(*part)
        logps.append(lp)
        entropies.append(ent if metric is None else metric.entropy)
    return spread(logps), spread(entropies) if with_entropy else None


def _spread(index: torch.Tensor, shape: torch.Size, hidden: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' values at their flat `index` in a [B, T-1] fp32 tensor, 0 elsewhere."""
    out = torch.zeros(shape.numel(), dtype=torch.float32, device=hidden.device)
    if not values:  # nothing asked for: zeros, still attached to the graph (a backward must reach the model)
        return (out + hidden.sum().float() * 0).view(shape)
    return out.index_put((index.to(out.device),), torch.cat(values)).view(shape)


def packing_matches(model: torch.nn.Module, vocab_size: int, device: torch.device | str = "cpu") -> bool:
    """Whether `model` keeps packed rows (trainer/packing.py) apart and in place: rows of 8, 4 and
    4 tokens, the last two sharing a bin. Isolation: changing the tokens of the bin's first row
    leaves the second row's log-probs as they were (keys masked out add exact zeros). Positions:
    packed log-probs equal padded ones (loosely: bf16 matmuls block differently per shape). A
    model whose attention ignored the packed position ids would let rows see each other."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (3, 8), generator=g)
    other = ids.clone()
    other[1, :4] = torch.randint(1, vocab_size, (4,), generator=g)
    mask = torch.tensor([[1] * 8, [1] * 4 + [0] * 4, [1] * 4 + [0] * 4])
    ids, other, mask = ids.to(device), other.to(device), mask.to(device)
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask)
        packed, _ = token_logprobs(model, ids, mask, layout=plan_layout(ids, mask, pack=True))
        packed_other, _ = token_logprobs(model, other, mask, layout=plan_layout(other, mask, pack=True))
    exact = next(_head_of(model).parameters()).dtype == torch.float32
    isolated = torch.allclose(packed[2], packed_other[2], rtol=0, atol=1e-4)
    positioned = torch.allclose(padded, packed, rtol=0, atol=1e-3 if exact else 0.1)
    return bool(isolated and positioned)


def prefix_sharing_matches(model: torch.nn.Module, vocab_size: int, device: torch.device | str = "cpu") -> bool:
    """Whether `model` computes shared-prefix trees (trainer/prefix_tree.py) as the rows alone:
    a group of three rows sharing 6 tokens (one row ending inside another's completion) and a
    group of one. Tree log-probs equal padded ones (loosely in low precision), and changing one
    row's completion leaves its siblings' values as they were (a model that ignored the 4D mask
    would let siblings see each other)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (4, 10), generator=g)
    ids[1:3, :6] = ids[0, :6]
    ids[2, 6:8] = ids[1, 6:8]
    other = ids.clone()
    other[0, 6:] = torch.randint(1, vocab_size, (4,), generator=g)
    mask = (torch.arange(10)[None, :] < torch.tensor([10, 9, 8, 7])[:, None]).long()
    groups = torch.tensor([0, 0, 0, 1])
    ids, other, mask, groups = ids.to(device), other.to(device), mask.to(device), groups.to(device)
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask)
        shared, _ = token_logprobs(model, ids, mask, layout=plan_layout(ids, mask, group_ids=groups, share="on"))
        changed, _ = token_logprobs(model, other, mask, layout=plan_layout(other, mask, group_ids=groups, share="on"))
    # in low precision by the mean: bf16 matmuls over other shapes round differently (SmolLM2's
    # random tokens: 0.056 nats on average, rows padded against rows alone); a token that sees
    # the wrong tokens is off by nats
    close = (lambda a, b: bool((a - b).abs().max() < 1e-3)) if next(_head_of(model).parameters()).dtype == \
        torch.float32 else (lambda a, b: bool((a - b).abs().mean() < 0.25))
    return close(shared[1:], changed[1:]) and close(padded * mask[:, 1:], shared)
