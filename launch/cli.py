"""What every command line shares: bad input ends with one `error: ...` line naming the field
and the fix (exit 2), never a traceback; a missing model folder is reported the same way."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from rl.config.schema import ConfigError
from rl.run.run_log import refuse_existing_run
from sandbox.backend import SandboxUnavailable

# Problems with what the user gave (config, files, data, host), found before or while loading.
INPUT_ERRORS = (ConfigError, ValueError, FileNotFoundError, FileExistsError, SandboxUnavailable)


def fail(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def require_model(path: str, what: str = "model.path") -> dict[str, Any]:
    """A model folder must exist once the built-in ones have been built (`examples.ensure_builtin`)
    and hold a readable `config.json`; returns that config as a dict."""
    from trainer.gguf import convert_command, is_gguf

    if is_gguf(path):
        command, out = convert_command(path)
        raise ConfigError(f"{what}={path!r} is a GGUF checkpoint (llama.cpp's format), which vLLM and DeepSpeed do "
                          f"not train; convert it to a Hugging Face folder with `{command}` and set {what}={out}")
    if not os.path.isdir(path):
        raise ConfigError(
            f"{what}={path!r} does not exist; give a local Hugging Face model folder (config.json + "
            "weights + tokenizer), or leave the default to use the built-in tiny model"
        )
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(
            f"{what}={path!r} has no config.json, so it is not a Hugging Face model folder; give the folder "
            "that save_pretrained wrote (config.json + weights + tokenizer)"
        )
    try:
        with open(config, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{what}={path!r}: its config.json cannot be read ({err}); write it again with "
                          "save_pretrained") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what}={path!r}: its config.json is not a JSON object; write it again with save_pretrained")
    return loaded


def require_writable(path: str, what: str = "run.dir") -> None:
    """The run directory can be made and written (checked where it will be created: the deepest
    folder of `path` that exists), before anything starts or is written."""
    import tempfile

    where = os.path.abspath(path)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ConfigError(f"{what}={path}: {where} is a file, not a folder; choose another {what}, "
                          f"e.g. {what}=runs/my-run")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise ConfigError(f"{what}={path}: cannot write in {where} ({err.strerror or err}); choose a folder you can "
                          f"write, e.g. {what}=runs/my-run") from None


# Keys of config.json that bound the sequence length (the names transformers' model families use).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")


def _count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1


def position_limit(config: dict[str, Any]) -> tuple[int, str] | None:
    """The longest sequence (tokens) the model config allows and the key it comes from, or None when
    it names none. Errs on the long side: a RoPE scaling `factor` > 1 raises the limit, and a
    `model_max_length` above the position table wins (as vLLM reads them)."""
    for node in (config, config.get("text_config"), config.get("language_config")):
        if not isinstance(node, dict):
            continue
        found = [(int(node[k]), k) for k in POSITION_KEYS if _count(node.get(k))]
        if not found:
            continue
        limit, key = min(found)
        if _count(node.get("model_max_length")) and node["model_max_length"] > limit:
            limit, key = int(node["model_max_length"]), "model_max_length"
        factor = 1.0
        for rope in (node.get("rope_scaling"), node.get("rope_parameters")):
            if isinstance(rope, dict):  # one set of parameters, or one per layer type
                for r in (rope, *rope.values()):
                    if isinstance(r, dict) and isinstance(r.get("factor"), (int, float)):
                        factor = max(factor, float(r["factor"]))
        if factor > 1:
            return int(limit * factor), f"{key} x rope factor {factor:g}"
        return limit, key
    return None


def require_length(path: str, config: dict[str, Any], length: int, what: str = "rollout.max_model_len",
                   model_field: str = "model.path") -> None:
    """`length` tokens (prompt + completion) must fit the model's position limit (`position_limit`)."""
    found = position_limit(config)
    if found is not None and length > found[0]:
        limit, key = found
        raise ConfigError(
            f"{what}={length} is more than the model's limit of {limit} tokens ({key} in "
            f"{os.path.join(path, 'config.json')}, {model_field}); set {what}={limit} or less"
        )


def require_tensor_parallel(path: str, config: dict[str, Any], tp: int) -> None:
    """vLLM shards attention heads over `rollout.tensor_parallel_size` ranks: they must divide evenly
    (vLLM's own check fires inside the rollout worker, after Ray started)."""
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    if tp > 1 and heads and heads % tp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and d <= max(tp, 8)]
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the model's {heads} attention heads "
                          f"(num_attention_heads in {os.path.join(path, 'config.json')}); use one of "
                          f"{', '.join(map(str, fits))}")


def supervised_inputs(cfg: Any) -> None:
    """A supervised run's inputs: the built-in policy and data its default paths name are built
    when missing (`examples.ensure_builtin`); the model folder must exist."""
    from examples import ensure_builtin

    ensure_builtin([cfg.model.path, *cfg.data.train_files, *cfg.data.test_files], cfg.run.seed)
    require_model(cfg.model.path)


def run_supervised(app: str, train: Callable[[Any], Any], overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """`launch.train_sft.run` / `launch.train_rm.run`: the command line without a subprocess."""
    from rl.config.compose import compose

    cfg = compose(app, overrides)
    supervised_inputs(cfg)
    return train(cfg)


def supervised_main(cfg: Any, validate: Callable[[Any], None], train: Callable[[Any], Any]) -> None:
    """The body of `launch.train_sft` and `launch.train_rm`: check everything, then train; a data
    problem found while loading (a DataError, a ValueError) also ends with one line."""
    try:
        validate(cfg)
        supervised_inputs(cfg)
        require_writable(cfg.run.dir)
        refuse_existing_run(cfg.run.dir)
    except INPUT_ERRORS as err:
        fail(err)
    try:
        train(cfg)
    except ValueError as err:  # rl.data.dataset.DataError: a file, column or row problem found while loading
        fail(err)
