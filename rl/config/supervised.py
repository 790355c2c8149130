"""Structured config schemas of the supervised trainers: `launch.train_sft` and `launch.train_rm`.

Same rules as `rl/config/schema.py`: Hydra merges `configs/train_sft.yaml` / `configs/train_rm.yaml`
into these dataclasses, so a misspelled key or a wrong type fails at start naming the field;
`validate_sft` / `validate_rm` add range checks with the field's name and the fix.
No torch imports here: the CLI must reject bad input in well under a second.

The names are the RL run's (`rl/config/schema.py`): the optimization under `algorithm.*` (`lr`,
`lr_warmup_steps`, `weight_decay`, `max_grad_norm`, plus `epochs` and `batch_size`), the most
sequences per forward-backward pass as `trainer.micro_batch_size`. The old `optim.*` keys are
still accepted (a FutureWarning names the new field; `DEPRECATED_KEYS`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from rl.config.schema import ModelConfig
from rl.config.validation import check_schema, logger_errors, raise_errors


@dataclass
class SupervisedAlgorithmConfig:
    """The optimization, under the RL run's names (`algorithm.lr`, `algorithm.lr_warmup_steps`,
    `algorithm.weight_decay`, `algorithm.max_grad_norm` mean what they mean in `launch.train`)."""

    epochs: float = 1.0  # passes over the training rows (fractions allowed)
    batch_size: int = 64  # examples per optimizer update: rows (SFT) or preference pairs (RM)
    lr: float = 1e-3
    lr_warmup_steps: int = 20  # optimizer updates of linear warm-up, then cosine decay to 10% of lr
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclass
class DeprecatedOptimConfig:
    """`optim.*`: the old names of `algorithm.*` and `trainer.micro_batch_size` (`DEPRECATED_KEYS`),
    still accepted: `translate_deprecated` moves a given value to its new field with a
    FutureWarning naming it, and drops this section. null = not given."""

    epochs: float | None = None
    batch_size: int | None = None
    micro_batch_size: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None


# old key -> new key
DEPRECATED_KEYS = {
    "optim.epochs": "algorithm.epochs",
    "optim.batch_size": "algorithm.batch_size",
    "optim.micro_batch_size": "trainer.micro_batch_size",
    "optim.lr": "algorithm.lr",
    "optim.warmup_steps": "algorithm.lr_warmup_steps",
    "optim.weight_decay": "algorithm.weight_decay",
    "optim.max_grad_norm": "algorithm.max_grad_norm",
}


@dataclass
class DeepSpeedTrainerConfig:
    zero_stage: int = 0  # 0 | 1 | 2 | 3 (one process; ZeRO-3 gathers the weights to save)
    # The most sequences one forward-backward pass takes, as `trainer.micro_batch_size` of an RL
    # run (rl/plan/geometry.py): a batch is cut into the fewest micro-batches within it, of
    # near-equal size (gradient accumulation covers the rest). A preference pair is two sequences
    # (chosen and rejected in one pass): reward models take micro_batch_size // 2 pairs.
    micro_batch_size: int = 64
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
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])  # as the RL run's (rl/log/loggers.py)
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
    algorithm: SupervisedAlgorithmConfig = field(default_factory=SupervisedAlgorithmConfig)
    trainer: DeepSpeedTrainerConfig = field(default_factory=DeepSpeedTrainerConfig)
    run: SupervisedRunConfig = field(default_factory=SupervisedRunConfig)
    optim: DeprecatedOptimConfig = field(default_factory=DeprecatedOptimConfig)  # old names; validation drops it


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


def renamed(key: str, value: Any, rows_per_example: int = 1) -> tuple[str, Any] | None:
    """(new key, value) of a deprecated `key` (`DEPRECATED_KEYS`), else None. The old
    `optim.micro_batch_size` counted examples; `trainer.micro_batch_size` counts sequences, so a
    reward model's pairs (`rows_per_example=2`) double."""
    if key not in DEPRECATED_KEYS:
        return None
    if key == "optim.micro_batch_size" and isinstance(value, int):
        value *= rows_per_example
    return DEPRECATED_KEYS[key], value


def translate_deprecated(cfg: Any, rows_per_example: int = 1) -> list[str]:
    """Move every given `optim.*` value of a merged supervised config to its new field (the value
    given under the old name wins), warn once per key (FutureWarning, naming the new field), and
    drop the `optim` section, so the run's saved config has the new names only. Returns the
    warnings; a config without the section is left as it is."""
    if "optim" not in cfg:
        return []
    old = cfg.optim
    messages = []
    for key in DEPRECATED_KEYS:
        value = old[key.split(".", 1)[1]] if old is not None else None
        if value is None:
            continue
        new_key, new_value = renamed(key, value, rows_per_example)  # type: ignore[misc]
        section, name = new_key.split(".")
        unit = f", which counts sequences ({rows_per_example} per pair)" if new_value != value else ""
        current = cfg[section][name]
        replaced = f" (replacing {new_key}={current})" if current != new_value else ""
        messages.append(f"{key} is deprecated, use {new_key}{unit}: {key}={value} was applied as "
                        f"{new_key}={new_value}{replaced}")
        setattr(cfg[section], name, new_value)
    del cfg.optim
    for message in messages:
        warnings.warn(message, FutureWarning, stacklevel=3)
    return messages


def _common_errors(cfg: Any, rows_per_example: int = 1) -> list[str]:
    errors: list[str] = logger_errors(cfg.run.loggers)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        errors.append(f"model.dtype={cfg.model.dtype!r}: choose one of float32, bfloat16")
    if cfg.trainer.zero_stage not in (0, 1, 2, 3):
        errors.append(f"trainer.zero_stage={cfg.trainer.zero_stage}: choose one of 0, 1, 2, 3")
    o = cfg.algorithm
    if o.batch_size <= 0:
        errors.append(f"algorithm.batch_size={o.batch_size}: must be a positive integer")
    if cfg.trainer.micro_batch_size < rows_per_example:
        low = "a positive integer" if rows_per_example == 1 else \
            f">= {rows_per_example} (a pair is {rows_per_example} sequences in one pass), e.g. trainer.micro_batch_size=64"
        errors.append(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size}: must be {low}")
    if not o.epochs > 0:
        errors.append(f"algorithm.epochs={o.epochs}: must be > 0")
    if not o.lr > 0:
        errors.append(f"algorithm.lr={o.lr}: must be > 0, e.g. algorithm.lr=1e-5")
    for key in ("lr_warmup_steps",):
        if getattr(o, key) < 0:
            errors.append(f"algorithm.{key}={getattr(o, key)}: must be >= 0")
    if not 0 <= cfg.data.test_fraction < 1:
        errors.append(f"data.test_fraction={cfg.data.test_fraction}: must be in [0, 1)")
    if cfg.data.max_length <= 0:
        errors.append(f"data.max_length={cfg.data.max_length}: must be a positive number of tokens")
    if not cfg.data.train_files:
        errors.append("data.train_files is empty: give at least one .jsonl/.json/.parquet/.csv file")
    if cfg.trainer.threads < 0:
        errors.append(f"trainer.threads={cfg.trainer.threads}: must be >= 0 (0 = torch's default)")
    return errors


PAIR_ROWS = 2  # a preference pair's sequences in one pass (chosen and rejected)


def validate_rm(cfg: Any) -> None:
    """Translate deprecated keys (`translate_deprecated`), then raise ConfigError naming every bad
    field of a merged TrainRMConfig, with the fix."""
    check_schema(cfg, TrainRMConfig, "train_rm", "rl/config/supervised.py")
    translate_deprecated(cfg, PAIR_ROWS)
    raise_errors(_common_errors(cfg, PAIR_ROWS))


def validate_sft(cfg: Any) -> None:
    """Translate deprecated keys (`translate_deprecated`), then raise ConfigError naming every bad
    field of a merged TrainSFTConfig, with the fix."""
    check_schema(cfg, TrainSFTConfig, "train_sft", "rl/config/supervised.py")
    translate_deprecated(cfg)
    errors = _common_errors(cfg)
    if cfg.data.format not in ("completion", "chat"):
        errors.append(f"data.format={cfg.data.format!r}: choose one of completion, chat")
    raise_errors(errors)


def data_columns(data: Any) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """The columns a supervised run's rows must have (the config field naming each -> its column)
    and which of those fields are optional: a preference pair's (`launch.train_rm`) or an SFT
    row's, completion or chat. The trainers read their rows by these; the launcher checks the
    user's own files by them before any built-in task is built."""
    if getattr(data, "chosen_key", None) is not None:
        return ({"data.prompt_key": data.prompt_key, "data.chosen_key": data.chosen_key,
                 "data.rejected_key": data.rejected_key, "data.margin_key": data.margin_key,
                 "data.group_key": data.group_key}, ("data.margin_key", "data.group_key"))
    if data.format == "chat":
        return {"data.messages_key": data.messages_key}, ()
    return {"data.prompt_key": data.prompt_key, "data.completion_key": data.completion_key}, ()
