"""The built-in tasks' default directories, and building one that is missing: what the entry points
(`launch.checks`, `launch.plan`, `launch.serve`) call once before Ray starts, so that a run on the
defaults works on a fresh clone. It lives here, below `examples/`, so the launcher does not depend on
the examples package: a task's module (`examples.<task>`, named below like a config names a plugin)
is imported only when its directory is named and missing, to build it.
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
