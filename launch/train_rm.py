"""`python -m launch.train_rm [key=value ...]`: train a Bradley-Terry reward model (Hydra app).

Reads preference pairs (columns prompt, chosen, rejected; local jsonl/json/parquet/csv), starts
from a causal LM folder as a `AutoModelForSequenceClassification` with one output (the `score`
head is new), trains it with a one-process DeepSpeed engine (ZeRO stage `trainer.zero_stage`) on
-logsigmoid(r_chosen - r_rejected - margin), reports held-out pairwise accuracy after every epoch,
and saves the model (`save_pretrained` + tokenizer) to `<run.dir>/final_model`; the training
itself is `trainer.reward_model.train_rm`.

With no arguments it trains on the built-in tiny preference task (`examples/preference.py`),
building the task data and the tiny policy it starts from when they are missing.
Bad config fails here before torch loads: keys and types against `rl.sft_rm_config.TrainRMConfig`.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from examples import ensure_builtin
from launch.cli import require_model, supervised_main
from launch.console import quiet_driver
from rl.compose import compose
from rl.sft_rm_config import validate_rm


def ensure_inputs(cfg: DictConfig) -> None:
    """Build the tiny policy and the tiny preference data when their default paths are used and missing."""
    ensure_builtin([cfg.model.path, *cfg.data.train_files, *cfg.data.test_files], cfg.run.seed)
    require_model(cfg.model.path)


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The merged, validated config for `overrides`, as the CLI would build it."""
    return compose("train_rm", overrides)


def run(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Python entry: `run(["optim.epochs=2", "run.dir=/tmp/rm"])` is the CLI without a subprocess."""
    from trainer.reward_model import train_rm

    cfg = compose_config(overrides)
    ensure_inputs(cfg)
    return train_rm(cfg)


@hydra.main(config_path="../configs", config_name="train_rm", version_base=None)
def main(cfg: DictConfig) -> None:
    quiet_driver()
    from trainer.reward_model import train_rm

    supervised_main(cfg, validate_rm, ensure_inputs, train_rm)


if __name__ == "__main__":
    main()
