"""`python -m launch.train_rm [key=value ...]`: train a Bradley-Terry reward model (Hydra app).

Reads preference pairs (columns prompt, chosen, rejected; local jsonl/json/parquet/csv), starts
from a causal LM folder as a `AutoModelForSequenceClassification` with one output (the `score`
head is new), trains it with a one-process DeepSpeed engine (ZeRO stage `trainer.zero_stage`) on
-logsigmoid(r_chosen - r_rejected - margin), reports held-out pairwise accuracy after every epoch,
and saves the model (`save_pretrained` + tokenizer) to `<run.dir>/final_model`; the training
itself is `trainer.reward_model.train_rm`.

With no arguments it trains on the built-in tiny preference task (`examples/preference.py`),
building the task data and the tiny policy it starts from when they are missing.
Bad config fails here before torch loads: keys and types against `rl.config.supervised.TrainRMConfig`.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from launch.supervised_cli import run_supervised, supervised_main
from launch.console import quiet_driver
from rl.config.compose import compose
from rl.config.supervised import validate_rm


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The merged, validated config for `overrides`, as the CLI would build it."""
    return compose("train_rm", overrides)


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Python entry: `run(["run.dir=/tmp/x", ...])` is the CLI without a subprocess (the built-in
    policy and data are built when missing)."""
    return run_supervised("train_rm", "trainer.reward_model:train_rm", overrides)


@hydra.main(config_path="../configs", config_name="train_rm", version_base=None)
def main(cfg: DictConfig) -> None:
    quiet_driver()
    supervised_main(cfg, validate_rm, "trainer.reward_model:train_rm")


if __name__ == "__main__":
    main()
