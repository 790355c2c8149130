"""`python -m launch.train_sft [key=value ...]`: supervised fine-tuning with prompt masking (Hydra app).

Two data formats (local jsonl/json/parquet/csv, read with `datasets`):

- `data.format=completion`: columns `data.prompt_key` and `data.completion_key`; the loss covers
  the completion and a final EOS, never the prompt (tokenised as the RL trainer tokenises it);
- `data.format=chat`: a `data.messages_key` column of [{role, content}, ...]; the loss covers
  the assistant turns only, rendered with the tokenizer's chat template when it has one, else
  with a simple fallback ("{role}:\\n{content}\\n", see `trainer.sft.render_chat`).

It runs the same loop and loss as the built-in tiny model's warm-up (`trainer.sft.sft_train`),
on a one-process DeepSpeed engine (`trainer.zero_stage` 0-3), reports the held-out loss after
every epoch, and saves `<run.dir>/final_model` (`save_pretrained` + tokenizer).
With no arguments it continues the warm-up of the built-in tiny policy on its arithmetic data
(built when missing). Bad config fails before torch loads (`rl.sft_rm_config.TrainSFTConfig`).
"""

from __future__ import annotations

import os
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from rl.config import ConfigError
from rl.sft_rm_config import TrainSFTConfig, validate_sft

ConfigStore.instance().store(name="train_sft_schema", node=TrainSFTConfig)

BUILTIN_DIR = os.path.normpath("artifacts/tiny")


def ensure_builtin_inputs(cfg: DictConfig) -> None:
    """Build the tiny policy and its arithmetic data when their default paths are used and missing."""
    paths = [cfg.model.path, *cfg.data.train_files, *cfg.data.test_files]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing and all(os.path.normpath(p).startswith(BUILTIN_DIR + os.sep) for p in missing):
        from launch.prepare_tiny import prepare_tiny

        print(f"Building the built-in tiny model and arithmetic task in {BUILTIN_DIR}/ (first run only)")
        prepare_tiny(BUILTIN_DIR, seed=cfg.run.seed)
    if not os.path.isdir(cfg.model.path):
        raise ConfigError(
            f"model.path={cfg.model.path!r} does not exist; give a local Hugging Face causal LM folder "
            "(config.json + weights + tokenizer), or leave the default to use the built-in tiny model"
        )


def load_examples(cfg: DictConfig, tokenizer: Any):
    """(train, test or None, dropped): (input_ids, labels) rows with the prompt masked (-100)."""
    from trainer.sft import build_example, chat_example, tokenize_pair
    from trainer.supervised import DataError, load_columns, split_table

    d = cfg.data
    if d.format == "chat":
        columns = {"data.messages_key": d.messages_key}
    else:
        columns = {"data.prompt_key": d.prompt_key, "data.completion_key": d.completion_key}
    train = load_columns(d.train_files, columns, "data.train_files")
    train, test = split_table(train, list(d.test_files), d.test_fraction, cfg.run.seed,
                              lambda: load_columns(d.test_files, columns, "data.test_files"))
    dropped = 0

    def encode(table) -> list[tuple[list[int], list[int]]]:
        nonlocal dropped
        out = []
        for i, row in enumerate(table):
            try:
                if d.format == "chat":
                    example = chat_example(tokenizer, row[d.messages_key])
                else:
                    example = build_example(*tokenize_pair(tokenizer, row[d.prompt_key], row[d.completion_key]))
            except (ValueError, TypeError) as err:
                raise DataError(f"row {i} of {list(d.train_files if table is train else d.test_files)}: {err}") from None
            if len(example[0]) > d.max_length:
                dropped += 1
                continue
            out.append(example)
        return out

    train_examples = encode(train)
    if not train_examples:
        raise DataError(f"every training row is longer than data.max_length={d.max_length} tokens; raise it")
    return train_examples, encode(test) if test is not None else None, dropped


def evaluate(model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int, micro_batch_size: int) -> dict[str, float]:
    """Held-out loss: mean cross-entropy per trained (completion / assistant) token."""
    import torch

    from trainer.sft import completion_batch_loss

    loss_fn = completion_batch_loss(examples, pad_id)
    was_training = model.training
    model.eval()
    total = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(examples), micro_batch_size):
            loss, extra = loss_fn(model, list(range(start, min(start + micro_batch_size, len(examples)))))
            total += float(loss) * extra["tokens"]
            tokens += extra["tokens"]
    model.train(was_training)
    return {"eval/loss": total / max(tokens, 1.0), "eval/tokens": tokens}


def train_sft(cfg: DictConfig) -> dict[str, Any]:
    """Train from a validated config (paths relative to the working directory); returns the summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import completion_batch_loss
    from trainer.supervised import fit, set_threads

    before = set_threads(cfg.trainer.threads)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        train, test, dropped = load_examples(cfg, tokenizer)
        summary = fit(
            cfg,
            title="sft",
            tokenizer=tokenizer,
            load_model=lambda: AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype)),
            n_train=len(train),
            loss_fn=completion_batch_loss(train, pad_id),
            evaluate=(lambda engine: evaluate(engine, test, pad_id, cfg.optim.micro_batch_size)) if test else None,
            summary={"format": cfg.data.format, "train_rows": len(train), "test_rows": len(test or []),
                     "dropped_rows": dropped},
        )
    finally:
        torch.set_num_threads(before)
    shown = f"; held-out loss {summary['eval/loss_before_training']:.4f} -> {summary['eval/loss']:.4f}" if test else ""
    print(f"SFT done in {summary['time/train_s']:.1f} s ({summary['steps']} steps){shown}. Run directory: {cfg.run.dir}",
          flush=True)
    return summary


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The merged, validated config for `overrides`, as the CLI would build it."""
    from trainer.supervised import compose

    return compose("train_sft", validate_sft, overrides)


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Python entry: `run(["data.format=chat", "run.dir=/tmp/sft"])` is the CLI without a subprocess."""
    cfg = compose_config(overrides)
    ensure_builtin_inputs(cfg)
    return train_sft(cfg)


@hydra.main(config_path="../configs", config_name="train_sft", version_base=None)
def main(cfg: DictConfig) -> None:
    from trainer.supervised import cli_main

    cli_main(cfg, validate_sft, ensure_builtin_inputs, train_sft)


if __name__ == "__main__":
    main()
