"""Structured config schemas of the supervised trainers: `launch.train_sft` and `launch.train_rm`.

Same rules as `rl/config/schema.py`: Hydra merges `configs/train_sft.yaml` / `configs/train_rm.yaml`
into these dataclasses, so a misspelled key or a wrong type fails at start naming the field;
`validate_sft` / `validate_rm` add range checks with the field's name and the fix.
No torch imports here: the CLI must reject bad input in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from rl.config.schema import ModelConfig, check_schema, logger_errors, raise_errors


@dataclass
class OptimConfig:
    epochs: float = 1.0  # passes over the training rows (fractions allowed)
    batch_size: int = 64  # rows (SFT) or pairs (RM) per optimizer update
    micro_batch_size: int = 64  # rows/pairs per forward-backward; must divide batch_size
    lr: float = 1e-3
    warmup_steps: int = 20  # linear warm-up, then cosine decay to 10% of lr
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclass
class DeepSpeedTrainerConfig:
    zero_stage: int = 0  # 0 | 1 | 2 | 3 (one process; ZeRO-3 gathers the weights to save)
    offload_optimizer: bool = False
    zero3_persistence_threshold: int = 0  # DeepSpeed's 1e5 keeps small tensors whole; 0 shards all
    threads: int = 0  # torch CPU threads while training; 0 = leave torch's default


@dataclass
class SupervisedRunConfig:
    dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    log_every: int = 20  # print (and TensorBoard-flush) a training row every N steps
    eval_every: int = 0  # evaluate every N steps as well as after every epoch; 0 = epochs only
    save_final_model: bool = True
    progress: bool = True
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])  # as the RL run's (rl/run/loggers.py)
    project: str = "rlpost"
    mlflow_tracking_uri: str = ""


@dataclass
class PreferenceDataConfig:
    train_files: list[str] = field(default_factory=lambda: ["artifacts/tiny_rm/data/train.jsonl"])
    test_files: list[str] = field(default_factory=lambda: ["artifacts/tiny_rm/data/test.jsonl"])
    test_fraction: float = 0.0  # with no test_files: hold out this share of train (seeded)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = None  # optional per-pair margin column (added to loss.margin)
    group_key: str | None = None  # optional column: eval accuracy is also reported per value
    max_length: int = 512  # pairs with a longer prompt+completion (tokens) are dropped


@dataclass
class PreferenceLossConfig:
    margin: float = 0.0  # loss = -logsigmoid(r_chosen - r_rejected - margin)


@dataclass
class SupervisedConfig:
    """The sections every supervised run has (`trainer.supervised.fit` reads them)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: DeepSpeedTrainerConfig = field(default_factory=DeepSpeedTrainerConfig)
    run: SupervisedRunConfig = field(default_factory=SupervisedRunConfig)


@dataclass
class TrainRMConfig(SupervisedConfig):
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)


@dataclass
class SFTDataConfig:
    format: str = "completion"  # completion (prompt + completion columns) | chat (messages column)
    train_files: list[str] = field(default_factory=lambda: ["artifacts/tiny/data/train.jsonl"])
    test_files: list[str] = field(default_factory=list)
    test_fraction: float = 0.0  # with no test_files: hold out this share of train (seeded)
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    messages_key: str = "messages"  # list of {role, content}; the loss covers assistant turns
    max_length: int = 512  # rows with more tokens are dropped (counted in the summary)


@dataclass
class TrainSFTConfig(SupervisedConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)


# `configs/train_rm.yaml` and `configs/train_sft.yaml` start their defaults lists with these.
ConfigStore.instance().store(name="train_rm_schema", node=TrainRMConfig)
ConfigStore.instance().store(name="train_sft_schema", node=TrainSFTConfig)


def _common_errors(cfg: Any) -> list[str]:
    errors: list[str] = logger_errors(cfg.run.loggers)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        errors.append(f"model.dtype={cfg.model.dtype!r}: choose one of float32, bfloat16")
    if cfg.trainer.zero_stage not in (0, 1, 2, 3):
        errors.append(f"trainer.zero_stage={cfg.trainer.zero_stage}: choose one of 0, 1, 2, 3")
    for key in ("batch_size", "micro_batch_size"):
        if getattr(cfg.optim, key) <= 0:
            errors.append(f"optim.{key}={getattr(cfg.optim, key)}: must be a positive integer")
    o = cfg.optim
    if o.batch_size > 0 and o.micro_batch_size > 0 and o.batch_size % o.micro_batch_size:
        errors.append(
            f"optim.batch_size={o.batch_size} is not a multiple of optim.micro_batch_size="
            f"{o.micro_batch_size}; e.g. set optim.micro_batch_size={_divisor(o.batch_size, o.micro_batch_size)}"
        )
    if not o.epochs > 0:
        errors.append(f"optim.epochs={o.epochs}: must be > 0")
    if not o.lr > 0:
        errors.append(f"optim.lr={o.lr}: must be > 0, e.g. optim.lr=1e-5")
    for key in ("warmup_steps",):
        if getattr(o, key) < 0:
            errors.append(f"optim.{key}={getattr(o, key)}: must be >= 0")
    if not 0 <= cfg.data.test_fraction < 1:
        errors.append(f"data.test_fraction={cfg.data.test_fraction}: must be in [0, 1)")
    if cfg.data.max_length <= 0:
        errors.append(f"data.max_length={cfg.data.max_length}: must be a positive number of tokens")
    if not cfg.data.train_files:
        errors.append("data.train_files is empty: give at least one .jsonl/.json/.parquet/.csv file")
    if cfg.trainer.threads < 0:
        errors.append(f"trainer.threads={cfg.trainer.threads}: must be >= 0 (0 = torch's default)")
    return errors


def _divisor(batch: int, micro: int) -> int:
    return max(d for d in range(1, min(batch, micro) + 1) if batch % d == 0)


def validate_rm(cfg: Any) -> None:
    """Raise ConfigError naming every bad field of a merged TrainRMConfig, with the fix."""
    check_schema(cfg, TrainRMConfig, "train_rm", "rl/config/supervised.py")
    raise_errors(_common_errors(cfg))


def validate_sft(cfg: Any) -> None:
    """Raise ConfigError naming every bad field of a merged TrainSFTConfig, with the fix."""
    check_schema(cfg, TrainSFTConfig, "train_sft", "rl/config/supervised.py")
    errors = _common_errors(cfg)
    if cfg.data.format not in ("completion", "chat"):
        errors.append(f"data.format={cfg.data.format!r}: choose one of completion, chat")
    raise_errors(errors)
