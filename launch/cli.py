"""What every command line shares: bad input ends with one `error: ...` line naming the field
and the fix (exit 2), never a traceback; a missing model folder is reported the same way."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from rl.config import ConfigError
from rl.run_log import refuse_existing_run
from sandbox.backend import SandboxUnavailable

# Problems with what the user gave (config, files, data, host), found before or while loading.
INPUT_ERRORS = (ConfigError, ValueError, FileNotFoundError, FileExistsError, SandboxUnavailable)


def fail(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def require_model(path: str, what: str = "model.path") -> None:
    """A model folder must exist once the built-in ones have been built (`examples.ensure_builtin`)."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"{what}={path!r} does not exist; give a local Hugging Face model folder (config.json + "
            "weights + tokenizer), or leave the default to use the built-in tiny model"
        )


def supervised_inputs(cfg: Any) -> None:
    """A supervised run's inputs: the built-in policy and data its default paths name are built
    when missing (`examples.ensure_builtin`); the model folder must exist."""
    from examples import ensure_builtin

    ensure_builtin([cfg.model.path, *cfg.data.train_files, *cfg.data.test_files], cfg.run.seed)
    require_model(cfg.model.path)


def run_supervised(app: str, train: Callable[[Any], Any], overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """`launch.train_sft.run` / `launch.train_rm.run`: the command line without a subprocess."""
    from rl.compose import compose

    cfg = compose(app, overrides)
    supervised_inputs(cfg)
    return train(cfg)


def supervised_main(cfg: Any, validate: Callable[[Any], None], train: Callable[[Any], Any]) -> None:
    """The body of `launch.train_sft` and `launch.train_rm`: check everything, then train; a data
    problem found while loading (a DataError, a ValueError) also ends with one line."""
    try:
        validate(cfg)
        supervised_inputs(cfg)
        refuse_existing_run(cfg.run.dir)
    except INPUT_ERRORS as err:
        fail(err)
    try:
        train(cfg)
    except ValueError as err:  # rl.data.DataError: a file, column or row problem found while loading
        fail(err)
