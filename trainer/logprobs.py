"""Per-token log-probs and entropy of a causal LM on right-padded sequences."""

from __future__ import annotations

import torch


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t in 0..T-2, shape [B, T-1].

    Logits are divided by the sampling temperature so the values match what the rollout engine
    reports for the tokens it sampled (vLLM `processed_logprobs`, HF processed scores).
    `entropy_grad=False`: the entropy is a metric only (no graph is kept for it).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        source = logp_all if entropy_grad else logp_all.detach()
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(source.exp() * source).sum(-1)
    return logp, entropy
