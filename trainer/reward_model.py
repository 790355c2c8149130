"""Reward-model pieces shared by training (`launch.train_rm`) and serving (`reward.model_reward`).

One tokenisation and one pooling, used on both sides, so a served RM scores exactly what it was
trained on:

- text: `tokenizer(prompt)` (as the RL trainer tokenises prompts), then the completion's tokens,
  then EOS (`trainer.sft.tokenize_pair`);
- pooling: the score head's output at the *last attended* token of each right-padded row
  (found from the attention mask), so the result does not depend on which id is the pad token
  (transformers' own pooling looks for the last non-pad id, which skips a final EOS when a
  tokenizer pads with EOS). For these tokenizers the two agree whenever pad != EOS.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.sft import collate_right_padded, tokenize_pair


def rm_input_ids(tokenizer: Any, prompt: str, completion: str) -> list[int]:
    """Token ids of one scored text: prompt ids, completion ids, EOS."""
    prompt_ids, completion_ids = tokenize_pair(tokenizer, prompt, completion)
    return prompt_ids + completion_ids


def pad_id_of(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; give it a pad_token")
    return int(pad)


def collate(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask for a list of token-id rows."""
    batch = collate_right_padded([(ids, ids) for ids in rows], pad_id)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def score_head(model: Any) -> torch.nn.Module:
    """The linear head of a transformers *ForSequenceClassification model (or DeepSpeed engine)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    for name in ("score", "classifier"):
        head = getattr(module, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(
        f"{type(module).__name__} has no `score` or `classifier` head; load the reward model with "
        "transformers.AutoModelForSequenceClassification"
    )


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One reward per right-padded row: the head's output at the row's last attended token.

    Reads the head's per-token output with a forward hook (transformers returns only its own
    pad-id-based pooling). Works on a plain model and on a DeepSpeed engine alike.
    """
    lengths = attention_mask.sum(-1)
    if bool((lengths == 0).any()) or bool((attention_mask.cumprod(-1).sum(-1) != lengths).any()):
        raise ValueError("sequence_scores expects right-padded rows (attention mask 1...1 0...0), none empty")
    captured: list[torch.Tensor] = []
    handle = score_head(model).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        handle.remove()
    per_token = captured[-1]  # (rows, width, 1)
    last = (lengths - 1).to(per_token.device)
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), last, 0].float()


def load_reward_model(path: str, dtype: str, tokenizer: Any) -> torch.nn.Module:
    """A sequence-classification model with one output from `path`: a causal LM folder (the
    `score` head is then new, initialised from torch's current RNG state) or a trained RM.

    Sets `config.pad_token_id` (transformers refuses batches without one)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_id_of(tokenizer)
    return model
