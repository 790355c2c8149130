"""`python -m launch.train_sft [key=value ...]`: supervised fine-tuning with prompt masking (Hydra app).

Two data formats (local jsonl/json/parquet/csv, read with `datasets`):

- `data.format=completion`: columns `data.prompt_key` and `data.completion_key`; the loss covers
  the completion and a final EOS, never the prompt (tokenised as the RL trainer tokenises it);
- `data.format=chat`: a `data.messages_key` column of [{role, content}, ...]; the loss covers
  the assistant turns only, rendered with the tokenizer's chat template when it has one, else
  with a simple fallback ("{role}:\\n{content}\\n", see `trainer.sft.render_chat`).

It runs the same loop and loss as the built-in tiny model's warm-up (`trainer.sft.sft_train`),
on a one-process DeepSpeed engine (`trainer.zero_stage` 0-3), reports the held-out loss after
every epoch, and saves `<run.dir>/final_model` (`save_pretrained` + tokenizer); the training
itself is `trainer.sft.train_sft`. With no arguments it continues the warm-up of the built-in tiny
policy on its arithmetic data (built when missing). Bad config fails before torch loads
(`rl.config.supervised.TrainSFTConfig`).
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from launch.supervised_cli import run_supervised, supervised_main
from launch.console import quiet_driver
from rl.config.compose import compose
from rl.config.supervised import validate_sft


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The merged, validated config for `overrides`, as the CLI would build it."""
    return compose("train_sft", overrides)


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Python entry: `run(["run.dir=/tmp/x", ...])` is the CLI without a subprocess (the built-in
    policy and data are built when missing)."""
    return run_supervised("train_sft", "trainer.sft:train_sft", overrides)


@hydra.main(config_path="../configs", config_name="train_sft", version_base=None)
def main(cfg: DictConfig) -> None:
    quiet_driver()
    supervised_main(cfg, validate_sft, "trainer.sft:train_sft")


if __name__ == "__main__":
    main()
