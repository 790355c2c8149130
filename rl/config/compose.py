"""Compose a run's config from `configs/` in Python, exactly as its command line would.

`compose("train_rm", ["algorithm.epochs=2"])` is what `python -m launch.train_rm algorithm.epochs=2`
validates before it trains: the built-in tasks (which train their own reward model) and the tests
use it, and so do the `run(overrides)` entry points of the supervised trainers.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from rl.config.serve import validate_serve
from rl.config.supervised import validate_rm, validate_sft
from rl.config.validation import validate

CONFIG_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs"))
VALIDATORS = {"train": validate, "train_rm": validate_rm, "train_sft": validate_sft, "serve": validate_serve}


def compose(app: str, overrides: list[str] | tuple[str, ...] = (),
            expand: Callable[[Any], None] | None = None) -> Any:
    """The merged, validated config of `configs/<app>.yaml` with `overrides` (a ConfigError names
    any bad field). `expand`: the step that rewrites a shorthand the config may hold, run before
    validation as the command line runs it (`task.env=openenv:...` is expanded by the code beside
    the episodes it stands for; `launch.checks.check_inputs` runs it); validation never changes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # Inside a @hydra.main app (launch.train writing its report) Hydra's global state is taken: set
    # it aside and put it back after (Hydra's initialize restores a copy of the singleton on exit).
    saved = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = hydra_compose(app, overrides=list(overrides))
    finally:
        GlobalHydra.instance().hydra = saved
    if expand is not None:
        expand(cfg)
    VALIDATORS[app](cfg)
    return cfg
