"""Reward models: the pieces shared by training (`train_rm`, `python -m launch.train_rm`) and
serving (`reward.model_reward`), and the Bradley-Terry training itself.

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

from rl.data.dataset import load_encoded
from rl.algo.preference import bradley_terry_loss, pairwise_accuracy
from rl.config.supervised import PAIR_ROWS, data_columns
from rl.plan.geometry import BatchGeometry
from rl.data.padding import pad_id_of
from trainer.sft import collate_right_padded, tokenize_pair
from trainer.supervised import fit, torch_threads


def rm_input_ids(tokenizer: Any, prompt: str, completion: str) -> list[int]:
    """Token ids of one scored text: prompt ids, completion ids, EOS."""
    prompt_ids, completion_ids = tokenize_pair(tokenizer, prompt, completion)
    return prompt_ids + completion_ids


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


# ---- Bradley-Terry training (`python -m launch.train_rm`) -------------------------------------

def load_pairs(cfg: Any, tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """Tokenised train and test pairs (test None when there is no test set) and how many were
    dropped for exceeding data.max_length. A missing column is a DataError naming it."""
    d = cfg.data
    columns, optional = data_columns(d)

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "chosen": rm_input_ids(tokenizer, row[d.prompt_key], row[d.chosen_key]),
            "rejected": rm_input_ids(tokenizer, row[d.prompt_key], row[d.rejected_key]),
            "margin": float(row[d.margin_key]) if d.margin_key else 0.0,
            "group": str(row[d.group_key]) if d.group_key else None,
        }

    return load_encoded(d, cfg.run.seed, columns, encode, lambda p: max(len(p["chosen"]), len(p["rejected"])),
                        optional=optional, noun="pair")


def pair_scores(model: Any, pairs: list[dict[str, Any]], pad_id: int) -> tuple[Any, Any]:
    """Rewards of chosen and rejected texts of `pairs`, in one forward pass of 2 x len(pairs) rows."""
    batch = collate([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    device = model.device
    scores = sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
    return scores[: len(pairs)], scores[len(pairs) :]


def bt_batch_loss(pairs: list[dict[str, Any]], pad_id: int, margin: float):
    """`fn(model, indices)` for `trainer.supervised.train_loop`: the BT loss of those pairs."""
    def loss_fn(model: Any, indices: list[int]):
        chosen, rejected = pair_scores(model, [pairs[i] for i in indices], pad_id)
        margins = torch.tensor([margin + pairs[i]["margin"] for i in indices], device=chosen.device)
        loss = bradley_terry_loss(chosen, rejected, margins)
        return loss, {"pairwise_accuracy": pairwise_accuracy(chosen.detach(), rejected.detach())}

    return loss_fn


def evaluate(model: Any, pairs: list[dict[str, Any]], pad_id: int, margin: float, micro_batch_size: int) -> dict[str, float]:
    """Held-out loss and pairwise accuracy (overall and per group, when the data has groups), in
    passes of at most `micro_batch_size` sequences (`trainer.micro_batch_size`: half as many pairs)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    start = 0
    with torch.no_grad():
        geometry = BatchGeometry(len(pairs), micro_batch_size=micro_batch_size, rows_per_example=PAIR_ROWS)
        for size in geometry.forward_sizes(len(pairs)):
            c, r = pair_scores(model, pairs[start : start + size], pad_id)
            start += size
            chosen.append(c.cpu())
            rejected.append(r.cpu())
    model.train(was_training)
    chosen_t, rejected_t = torch.cat(chosen), torch.cat(rejected)
    margins = torch.tensor([margin + p["margin"] for p in pairs])
    out = {
        "eval/loss": float(bradley_terry_loss(chosen_t, rejected_t, margins)),
        "eval/pairwise_accuracy": pairwise_accuracy(chosen_t, rejected_t),
        "eval/reward_gap_mean": float((chosen_t - rejected_t).mean()),
    }
    groups = sorted({p["group"] for p in pairs if p["group"] is not None})
    for g in groups:
        rows = torch.tensor([p["group"] == g for p in pairs])
        out[f"eval/pairwise_accuracy/{g}"] = pairwise_accuracy(chosen_t[rows], rejected_t[rows])
    return out


def train_rm(cfg: Any) -> dict[str, Any]:
    """Train from a validated config (paths relative to the working directory); returns the summary."""
    from transformers import AutoTokenizer

    with torch_threads(cfg.trainer.threads):
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        pad_id = pad_id_of(tokenizer)
        train_pairs, test_pairs, dropped = load_pairs(cfg, tokenizer)

        def load_model():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.run.seed)  # the new score head's init derives from the run seed
                return load_reward_model(cfg.model.path, cfg.model.dtype, tokenizer)

        summary = fit(
            cfg,
            title="rm",
            tokenizer=tokenizer,
            load_model=load_model,
            n_train=len(train_pairs),
            loss_fn=bt_batch_loss(train_pairs, pad_id, cfg.loss.margin),
            evaluate=(lambda engine: evaluate(engine, test_pairs, pad_id, cfg.loss.margin, cfg.trainer.micro_batch_size))
            if test_pairs else None,
            rows_per_example=PAIR_ROWS,
            summary={"train_pairs": len(train_pairs), "test_pairs": len(test_pairs or []), "dropped_pairs": dropped},
        )
    acc = summary.get("eval/pairwise_accuracy")
    print(f"Reward model trained in {summary['time/train_s']:.1f} s ({summary['steps']} steps)"
          + (f"; held-out pairwise accuracy {acc:.3f}" if acc is not None else "")
          + f". Run directory: {cfg.run.dir}", flush=True)
    return summary
