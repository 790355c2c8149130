"""Plain-torch supervised fine-tuning on (prompt, completion) pairs.

Used to warm up the built-in tiny model before RL (and by tests): no DeepSpeed, no Ray, so it
runs anywhere in seconds. The loss covers completion tokens only (EOS included): the model must
learn to answer and to stop, not to predict prompts it will always be given.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def tokenize_pair(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Prompt ids exactly as the RL trainer makes them (`tokenizer(prompt)`), completion ids + EOS."""
    prompt_ids = list(tokenizer(prompt).input_ids)
    completion_ids = list(tokenizer(completion, add_special_tokens=False).input_ids)
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id: the completion must end with EOS")
    return prompt_ids, completion_ids + [int(tokenizer.eos_token_id)]


def build_example(prompt_ids: list[int], completion_ids: list[int]) -> tuple[list[int], list[int]]:
    """Concatenate and mask: labels are the input ids with prompt positions set to -100.

    Labels are aligned with `input_ids` (not shifted); `completion_loss` does the shift.
    """
    input_ids = list(prompt_ids) + list(completion_ids)
    labels = [IGNORE_INDEX] * len(prompt_ids) + list(completion_ids)
    return input_ids, labels


def collate_right_padded(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-pad a batch; padded positions get attention 0 and label -100."""
    width = max(len(ids) for ids, _ in examples)
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, labs) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[i, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target label is not -100."""
    shifted_logits = logits[:, :-1, :].float()
    targets = labels[:, 1:]
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], completions: list[str], batch_size: int = 512
) -> torch.Tensor:
    """log p(completion + EOS | prompt) per pair, by teacher forcing.

    exp() of it is the exact chance that sampling at temperature 1.0 returns that completion:
    a noise-free stand-in for sampled accuracy.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch_size):
        pairs = zip(prompts[start : start + batch_size], completions[start : start + batch_size])
        batch = collate_right_padded([build_example(*tokenize_pair(tokenizer, p, c)) for p, c in pairs], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = logits[:, :-1].float().log_softmax(-1)
        targets = batch["labels"][:, 1:]
        mask = targets != IGNORE_INDEX
        token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out.append((token_logp * mask).sum(-1))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10%: stable for tiny models at high learning rates."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def sft_train(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    completions: list[str],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    log_fn: Callable[[str], None] = print,
    stop_fn: Callable[[int], bool] | None = None,
) -> list[float]:
    """Train `model` in place on completion tokens; returns the loss of every step.

    Batches are drawn epoch by epoch from a permutation made by a local generator seeded with
    `seed`, so the run depends only on its inputs, not on global RNG state. `stop_fn(done_steps)`
    is called after every step and ends training early when it returns True (e.g. once a probe
    accuracy is reached); the learning-rate schedule still spans `steps`.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need equally many prompts and completions (> 0), got {len(prompts)} and {len(completions)}"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = [build_example(*tokenize_pair(tokenizer, p, c)) for p, c in zip(prompts, completions)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _lr_factor(s, steps, warmup_steps)
    )
    model.train()
    order: list[int] = []
    losses: list[float] = []
    for step in range(steps):
        while len(order) < batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        picked, order = order[:batch_size], order[batch_size:]
        batch = collate_right_padded([examples[i] for i in picked], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = completion_loss(logits, batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            log_fn(f"sft step {step + 1}/{steps} loss {losses[-1]:.4f} lr {scheduler.get_last_lr()[0]:.2e}")
        if stop_fn is not None:
            stop = stop_fn(step + 1)
            model.train()  # stop_fn may have switched to eval mode to probe the model
            if stop:
                break
    model.eval()
    return losses
