"""`python -m launch.train_rm [key=value ...]`: train a Bradley-Terry reward model (Hydra app).

Reads preference pairs (columns prompt, chosen, rejected; local jsonl/json/parquet/csv), starts
from a causal LM folder as a `AutoModelForSequenceClassification` with one output (the `score`
head is new), trains it with a one-process DeepSpeed engine (ZeRO stage `trainer.zero_stage`) on
-logsigmoid(r_chosen - r_rejected - margin), reports held-out pairwise accuracy after every epoch,
and saves the model (`save_pretrained` + tokenizer) to `<run.dir>/final_model`.

With no arguments it trains on the built-in tiny preference task (`rl/preference_tasks.py`),
building the task data and the tiny policy it starts from when they are missing.
Bad config fails here before torch loads: keys and types against `rl.sft_rm_config.TrainRMConfig`.
"""

from __future__ import annotations

import os
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from rl.config import ConfigError
from rl.sft_rm_config import TrainRMConfig, validate_rm

ConfigStore.instance().store(name="train_rm_schema", node=TrainRMConfig)

BUILTIN_POLICY_PATH = os.path.normpath("artifacts/tiny/model")
BUILTIN_RM_DATA = tuple(os.path.normpath(f"artifacts/tiny_rm/data/{split}.jsonl") for split in ("train", "test"))


def ensure_builtin_inputs(cfg: DictConfig) -> None:
    """Build the tiny policy and the tiny preference data when their default paths are used and missing."""
    files = [os.path.normpath(f) for f in [*cfg.data.train_files, *cfg.data.test_files]]
    if any(not os.path.exists(f) for f in files) and set(files) <= set(BUILTIN_RM_DATA):
        from launch.prepare_tiny_rm import write_preference_data

        print(f"Building the built-in tiny preference task in {os.path.dirname(BUILTIN_RM_DATA[0])}/ (first run only)")
        write_preference_data(os.path.dirname(os.path.dirname(BUILTIN_RM_DATA[0])), seed=cfg.run.seed)
    if not os.path.isdir(cfg.model.path) and os.path.normpath(cfg.model.path) == BUILTIN_POLICY_PATH:
        from launch.prepare_tiny import prepare_tiny

        print(f"Building the built-in tiny model in {os.path.dirname(BUILTIN_POLICY_PATH)}/ (first run only)")
        prepare_tiny(os.path.dirname(BUILTIN_POLICY_PATH), seed=cfg.run.seed)
    if not os.path.isdir(cfg.model.path):
        raise ConfigError(
            f"model.path={cfg.model.path!r} does not exist; give a local Hugging Face model folder "
            f"(config.json + weights + tokenizer), or leave the default {BUILTIN_POLICY_PATH!r}"
        )


def load_pairs(cfg: DictConfig, tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """Tokenised train and test pairs (test None when there is no test set) and how many were
    dropped for exceeding data.max_length. A missing column is a DataError naming it."""
    from trainer.reward_model import rm_input_ids
    from trainer.supervised import DataError, load_columns, split_table

    d = cfg.data
    columns = {"data.prompt_key": d.prompt_key, "data.chosen_key": d.chosen_key, "data.rejected_key": d.rejected_key,
               "data.margin_key": d.margin_key, "data.group_key": d.group_key}
    optional = ("data.margin_key", "data.group_key")
    train = load_columns(d.train_files, columns, "data.train_files", optional=optional)
    train, test = split_table(train, list(d.test_files), d.test_fraction, cfg.run.seed,
                              lambda: load_columns(d.test_files, columns, "data.test_files", optional=optional))
    dropped = 0

    def encode(table) -> list[dict[str, Any]]:
        nonlocal dropped
        out = []
        for row in table:
            pair = {
                "chosen": rm_input_ids(tokenizer, row[d.prompt_key], row[d.chosen_key]),
                "rejected": rm_input_ids(tokenizer, row[d.prompt_key], row[d.rejected_key]),
                "margin": float(row[d.margin_key]) if d.margin_key else 0.0,
                "group": str(row[d.group_key]) if d.group_key else None,
            }
            if max(len(pair["chosen"]), len(pair["rejected"])) > d.max_length:
                dropped += 1
                continue
            out.append(pair)
        return out

    train_pairs = encode(train)
    if not train_pairs:
        raise DataError(f"every training pair is longer than data.max_length={d.max_length} tokens; raise it")
    return train_pairs, encode(test) if test is not None else None, dropped


def pair_scores(model: Any, pairs: list[dict[str, Any]], pad_id: int) -> tuple[Any, Any]:
    """Rewards of chosen and rejected texts of `pairs`, in one forward pass of 2 x len(pairs) rows."""
    from trainer.reward_model import collate, sequence_scores

    batch = collate([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    device = model.device
    scores = sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
    return scores[: len(pairs)], scores[len(pairs) :]


def bt_batch_loss(pairs: list[dict[str, Any]], pad_id: int, margin: float):
    """`fn(model, indices)` for `trainer.supervised.train_loop`: the BT loss of those pairs."""
    import torch

    from rl.preference import bradley_terry_loss, pairwise_accuracy

    def loss_fn(model: Any, indices: list[int]):
        chosen, rejected = pair_scores(model, [pairs[i] for i in indices], pad_id)
        margins = torch.tensor([margin + pairs[i]["margin"] for i in indices], device=chosen.device)
        loss = bradley_terry_loss(chosen, rejected, margins)
        return loss, {"pairwise_accuracy": pairwise_accuracy(chosen.detach(), rejected.detach())}

    return loss_fn


def evaluate(model: Any, pairs: list[dict[str, Any]], pad_id: int, margin: float, micro_batch_size: int) -> dict[str, float]:
    """Held-out loss and pairwise accuracy (overall and per group, when the data has groups)."""
    import torch

    from rl.preference import bradley_terry_loss, pairwise_accuracy

    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), micro_batch_size):
            c, r = pair_scores(model, pairs[start : start + micro_batch_size], pad_id)
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


def train_rm(cfg: DictConfig) -> dict[str, Any]:
    """Train from a validated config (paths relative to the working directory); returns the summary."""
    import torch
    from transformers import AutoTokenizer

    from trainer.reward_model import load_reward_model, pad_id_of
    from trainer.supervised import fit, set_threads

    before = set_threads(cfg.trainer.threads)
    try:
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
            evaluate=(lambda engine: evaluate(engine, test_pairs, pad_id, cfg.loss.margin, cfg.optim.micro_batch_size))
            if test_pairs else None,
            summary={"train_pairs": len(train_pairs), "test_pairs": len(test_pairs or []), "dropped_pairs": dropped},
        )
    finally:
        torch.set_num_threads(before)
    acc = summary.get("eval/pairwise_accuracy")
    print(f"Reward model trained in {summary['time/train_s']:.1f} s ({summary['steps']} steps)"
          + (f"; held-out pairwise accuracy {acc:.3f}" if acc is not None else "")
          + f". Run directory: {cfg.run.dir}", flush=True)
    return summary


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The merged, validated config for `overrides`, as the CLI would build it."""
    from trainer.supervised import compose

    return compose("train_rm", validate_rm, overrides)


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Python entry: `run(["optim.epochs=2", "run.dir=/tmp/rm"])` is the CLI without a subprocess."""
    cfg = compose_config(overrides)
    ensure_builtin_inputs(cfg)
    return train_rm(cfg)


@hydra.main(config_path="../configs", config_name="train_rm", version_base=None)
def main(cfg: DictConfig) -> None:
    from trainer.supervised import cli_main

    cli_main(cfg, validate_rm, ensure_builtin_inputs, train_rm)


if __name__ == "__main__":
    main()
