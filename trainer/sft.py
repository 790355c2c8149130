"""Supervised fine-tuning pieces: tokenisation with prompt masking, collation, the loss.

The loss covers completion tokens only (EOS included): the model must learn to answer and to
stop, not to predict prompts it will always be given. Two data shapes:

- completion: `tokenize_pair(prompt, completion)` then `build_example` (prompt positions -100);
- chat: `chat_example(messages)` where only assistant turns are trained (see `render_chat`).

`sft_train` is the plain-torch trainer that warms up the built-in tiny models (no DeepSpeed, no
Ray, seconds on a CPU). It runs the same loop (`trainer.supervised.train_loop`) and the same
batch loss (`completion_batch_loss`) as `train_sft` (`python -m launch.train_sft`), which drives
them with a DeepSpeed engine instead of a torch optimizer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from rl.config.supervised import data_columns
from rl.data.dataset import load_encoded
from rl.data.padding import pad_id_of
from rl.plan.geometry import BatchGeometry
from trainer.supervised import TorchStepper, fit, lr_factor, torch_threads, train_loop

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


def build_segments_example(segments: list[tuple[list[int], bool]]) -> tuple[list[int], list[int]]:
    """Concatenate token segments; those marked trainable keep their labels, the rest get -100.

    `build_example(p, c)` is `build_segments_example([(p, False), (c, True)])`; multi-turn chat
    uses one segment per turn.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    for ids, trainable in segments:
        input_ids += list(ids)
        labels += list(ids) if trainable else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


# Chat data for a tokenizer without a chat template of its own: each context message is
# rendered as "{role}:\n{content}\n"; an assistant message as the header "assistant:\n" (context)
# followed by its content and EOS (trained). The whole starts with the tokenizer's special prefix.
FALLBACK_CHAT_TURN = "{role}:\n{content}\n"
FALLBACK_CHAT_HEADER = "{role}:\n"


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
    """Token segments of a conversation, each marked trainable (assistant output) or not.

    With a chat template (`tokenizer.chat_template`): the conversation is rendered by the
    template; the tokens of assistant turn i are those between the rendering of messages[:i]
    with the generation prompt and the rendering of messages[:i+1] (end-of-turn marker
    included, so the model learns to stop). The template must be prefix-stable (rendering a
    longer conversation extends the token ids of a shorter one); a ValueError says when not.

    Without one: the fallback format above (`FALLBACK_CHAT_TURN`, `FALLBACK_CHAT_HEADER`).
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a conversation has no assistant message: nothing to train on")
    if getattr(tokenizer, "chat_template", None):
        return _render_with_template(tokenizer, messages)
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id: assistant turns must end with EOS")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    segments: list[tuple[list[int], bool]] = [(list(tokenizer("").input_ids), False)]  # e.g. BOS
    for m in messages:
        if m["role"] == "assistant":
            segments.append((ids(FALLBACK_CHAT_HEADER.format(role="assistant")), False))
            segments.append((ids(m["content"]) + [int(tokenizer.eos_token_id)], True))
        else:
            segments.append((ids(FALLBACK_CHAT_TURN.format(role=m["role"], content=m["content"])), False))
    return [seg for seg in segments if seg[0]]


def _render_with_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
    def ids(conversation: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    segments: list[tuple[list[int], bool]] = []
    done: list[int] = []  # ids covered by the segments so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context, turn = ids(messages[:i], True), ids(messages[: i + 1], False)
        if context[: len(done)] != done or turn[: len(context)] != context:
            raise ValueError(
                "the tokenizer's chat template is not prefix-stable (rendering more messages changes "
                "earlier tokens), so assistant tokens cannot be located; use data.format=completion "
                "with pre-rendered prompts instead"
            )
        segments += [(context[len(done):], False), (turn[len(context):], True)]
        done = turn
    rest = ids(messages, False)
    if rest[: len(done)] != done:
        raise ValueError("the tokenizer's chat template is not prefix-stable; use data.format=completion")
    segments.append((rest[len(done):], False))  # e.g. a trailing user message
    return [seg for seg in segments if seg[0]]


def chat_example(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation; only assistant turns carry labels."""
    return build_segments_example(render_chat(tokenizer, messages))


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


def completion_batch_loss(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> Callable[[Any, list[int]], tuple[torch.Tensor, dict[str, float]]]:
    """The SFT batch loss for `trainer.supervised.train_loop`: `fn(model, indices)` collates
    `examples[indices]` (right-padded) and returns (`completion_loss`, extra metrics).

    `model` is anything called like a causal LM: a transformers model or a DeepSpeed engine.
    """

    def loss_fn(model: Any, indices: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = collate_right_padded([examples[i] for i in indices], pad_id)
        device = model.device
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
        labels = batch["labels"].to(device)
        return completion_loss(logits, labels), {"tokens": float((labels[:, 1:] != IGNORE_INDEX).sum())}

    return loss_fn


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], completions: list[str], batch_size: int = 512
) -> torch.Tensor:
    """log p(completion + EOS | prompt) per pair, by teacher forcing.

    exp() of it is the exact chance that sampling at temperature 1.0 returns that completion:
    a noise-free stand-in for sampled accuracy.
    """
    examples = [build_example(*tokenize_pair(tokenizer, p, c)) for p, c in zip(prompts, completions)]
    return example_logprobs(model, examples, pad_id_of(tokenizer), batch_size)


@torch.no_grad()
def example_logprobs(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], pad_id: int,
                     batch_size: int = 512) -> torch.Tensor:
    """Sum of the log-probs of each example's labelled tokens (labels != -100), by teacher forcing."""
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        batch = collate_right_padded(examples[start : start + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = logits[:, :-1].float().log_softmax(-1)
        targets = batch["labels"][:, 1:]
        mask = targets != IGNORE_INDEX
        token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out.append((token_logp * mask).sum(-1))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def sft_train(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    completions: list[str],
    **options: Any,
) -> list[float]:
    """Train `model` in place on completion tokens (plain torch AdamW); returns every step's loss.
    `options`: `train_examples`' keyword arguments (steps, batch_size, lr, seed, ...).

    Batches are drawn epoch by epoch from a permutation made by a local generator seeded with
    `seed`, so the run depends only on its inputs, not on global RNG state. `stop_fn(done_steps)`
    is called after every step and ends training early when it returns True (e.g. once a probe
    accuracy is reached); the learning-rate schedule still spans `steps`. Same loop and loss as
    `python -m launch.train_sft` (`trainer.supervised.train_loop` + `completion_batch_loss`).
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need equally many prompts and completions (> 0), got {len(prompts)} and {len(completions)}"
        )
    examples = [build_example(*tokenize_pair(tokenizer, p, c)) for p, c in zip(prompts, completions)]
    return train_examples(model, examples, pad_id_of(tokenizer), **options)


def train_examples(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]]],
    pad_id: int,
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
    """`sft_train` on examples already tokenized and masked ((input_ids, labels) rows, e.g.
    `chat_example`'s multi-turn ones)."""
    stepper = TorchStepper(
        model, lr=lr, weight_decay=weight_decay, lr_lambda=lambda s: lr_factor(s, steps, warmup_steps), max_grad_norm=1.0
    )
    losses = train_loop(
        stepper,
        len(examples),
        completion_batch_loss(examples, pad_id),
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        log_every=log_every,
        log_fn=log_fn,
        log_prefix="sft",
        stop_fn=stop_fn,
    )
    model.eval()
    return losses


# ---- `python -m launch.train_sft`: data from files, a DeepSpeed engine, a run directory -----------

def load_examples(cfg: Any, tokenizer: Any):
    """(train, test or None, dropped): (input_ids, labels) rows with the prompt masked (-100)."""
    d = cfg.data
    columns, _ = data_columns(d)

    def encode(row: dict[str, Any]) -> tuple[list[int], list[int]]:
        if d.format == "chat":
            return chat_example(tokenizer, row[d.messages_key])
        return build_example(*tokenize_pair(tokenizer, row[d.prompt_key], row[d.completion_key]))

    return load_encoded(d, cfg.run.seed, columns, encode, lambda example: len(example[0]))


def evaluate(model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int, micro_batch_size: int) -> dict[str, float]:
    """Held-out loss: mean cross-entropy per trained (completion / assistant) token, in passes of
    at most `micro_batch_size` rows (`trainer.micro_batch_size`)."""
    loss_fn = completion_batch_loss(examples, pad_id)
    was_training = model.training
    model.eval()
    total = tokens = 0.0
    start = 0
    with torch.no_grad():
        for size in BatchGeometry(len(examples), micro_batch_size=micro_batch_size).forward_sizes(len(examples)):
            loss, extra = loss_fn(model, list(range(start, start + size)))
            start += size
            total += float(loss) * extra["tokens"]
            tokens += extra["tokens"]
    model.train(was_training)
    return {"eval/loss": total / max(tokens, 1.0), "eval/tokens": tokens}


def train_sft(cfg: Any) -> dict[str, Any]:
    """Train from a validated config (paths relative to the working directory); returns the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch_threads(cfg.trainer.threads):
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        pad_id = pad_id_of(tokenizer)
        train, test, dropped = load_examples(cfg, tokenizer)
        summary = fit(
            cfg,
            title="sft",
            tokenizer=tokenizer,
            load_model=lambda: AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype)),
            n_train=len(train),
            loss_fn=completion_batch_loss(train, pad_id),
            evaluate=(lambda engine: evaluate(engine, test, pad_id, cfg.trainer.micro_batch_size)) if test else None,
            summary={"format": cfg.data.format, "train_rows": len(train), "test_rows": len(test or []),
                     "dropped_rows": dropped},
        )
    shown = f"; held-out loss {summary['eval/loss_before_training']:.4f} -> {summary['eval/loss']:.4f}" if test else ""
    print(f"SFT done in {summary['time/train_s']:.1f} s ({summary['steps']} steps){shown}. Run directory: {cfg.run.dir}",
          flush=True)
    return summary
