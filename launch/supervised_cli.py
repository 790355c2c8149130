"""The command line of the supervised trainers (`launch.train_sft`, `launch.train_rm`): check
everything (launch/checks.py), then train; bad input ends with one `error:` line."""

from __future__ import annotations

from typing import Any, Callable

from launch.checks import require_writable, supervised_inputs
from launch.cli import INPUT_ERRORS, fail
from rl.log.run_log import refuse_existing_run


def trainer_function(name: str) -> Callable[[Any], Any]:
    """The training function `name` ("module:function"), imported only once the input is
    checked: its module imports torch (2-5 s), which a refused command never waits for."""
    from reward.loader import load_object

    return load_object(name, field="trainer")


def run_supervised(app: str, train: str, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """`launch.train_sft.run` / `launch.train_rm.run`: the command line without a subprocess."""
    from rl.config.compose import compose

    cfg = compose(app, overrides)
    supervised_inputs(cfg)
    return trainer_function(train)(cfg)


def supervised_main(cfg: Any, validate: Callable[[Any], None], train: str) -> None:
    """The body of `launch.train_sft` and `launch.train_rm`: check everything, then train with
    `train` ("module:function"); a data problem found while loading (a DataError, a ValueError)
    also ends with one line."""
    try:
        validate(cfg)
        supervised_inputs(cfg)
        require_writable(cfg.run.dir)
        refuse_existing_run(cfg.run.dir)
    except INPUT_ERRORS as err:
        fail(err)
    train_fn = trainer_function(train)
    try:
        train_fn(cfg)
    except ValueError as err:  # rl.data.dataset.DataError: a file, column or row problem found while loading
        fail(err)
