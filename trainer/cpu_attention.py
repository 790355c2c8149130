"""Attention for a CPU learner's bf16 training passes: plain matmul-softmax-matmul where PyTorch's
CPU flash-attention backward is slow, SDPA elsewhere.

On CPU, `scaled_dot_product_attention` with a 4D mask (every packed or shared-prefix micro-batch
has one) runs PyTorch's flash kernel, whose backward does many small bf16 GEMMs inside its own
parallel loop. Measured on the SmolLM2 recipe's shared-prefix bins (8 x 307 slots, 9 heads, a
2-core AMX host): forward 5 ms but backward 25-30 ms per layer in a plain process and 80-95 ms in
most learner actors (the same call, same threads; most likely Ray's low worker priority, now
`cluster.worker_niceness`: docs/benchmarks.md), against 17-26 ms for the plain computation's
backward in both (and, with a bf16 softmax, as fast as the flash
kernel fwd + bwd in a plain process up to ~614 slots; at a 640-slot limit the recipe's learner
peaked at 11.1 GiB against 7.3 at 384). So a training forward (grad enabled) of bins at
most `EAGER_MAX_SLOTS` long computes attention as transformers' eager attention does (two
batched matmuls and a softmax), which keeps its bf16 probabilities for backward: heads x slots
elements per token and layer more than SDPA (`rl.plan.memory_plan` counts them). Longer
bins, forward-only passes (scoring, reference, teacher), float32 and GPUs keep SDPA, as does any
call with a feature the plain computation here does not implement (dropout, soft-capping,
attention sinks, position bias).

`use_training_attention(model, device, dtype)` switches a transformers model to it (registered
with transformers' AttentionInterface as `NAME`); the values are SDPA's to bf16 rounding
(tests/test_cpu_attention.py).
"""

from __future__ import annotations

import torch

from rl.plan.memory_plan import EAGER_MAX_SLOTS, eager_attention_applies

NAME = "rl_cpu_attention"
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")  # kwargs the plain computation ignores


def takes_plain_path(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float, kwargs: dict) -> bool:
    """Whether this call computes attention as matmul-softmax-matmul (see the module doc)."""
    return (query.requires_grad and torch.is_grad_enabled() and attention_mask is not None
            and eager_attention_applies(query.device.type, query.dtype, query.shape[2])
            and key.shape[2] == query.shape[2] and not dropout
            and not any(kwargs.get(k) is not None for k in UNSUPPORTED))


def training_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [B, H, L, D], key/value [B, KV, L, D], a 4D mask
    (bool: True = attend, or additive); returns [B, L, H, D] as the other implementations do."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not takes_plain_path(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    mask = attention_mask[:, :, :, : key.shape[2]]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    # softmax of the bf16 scores: computed in float32 inside the kernel and rounded to bf16 once, as
    # a float32 softmax cast back would be, but it keeps only the bf16 probabilities for backward
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, training_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the masks SDPA gets


def use_training_attention(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Switch `model` (a transformers model, or a peft one around it) from SDPA to `NAME` where it
    can pay: a CPU learner in bf16. True when switched."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or not eager_attention_applies(device.type, dtype, 1)
            or not getattr(base, "_can_set_attn_implementation", lambda: False)()):
        return False
    _register()
    base.set_attn_implementation(NAME)
    return base.config._attn_implementation == NAME


__all__ = ["EAGER_MAX_SLOTS", "NAME", "takes_plain_path", "training_attention", "use_training_attention"]
