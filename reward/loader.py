"""Turn a config string naming a reward function into the callable it names.

Two forms, so users can plug in code without packaging it:

- ``package.module:function`` imports the module (it must be on ``sys.path``);
- ``path/to/file.py:function`` executes that file as a standalone module. A relative path is
  resolved against ``base_dir`` (default: the current working directory).

``function`` may be dotted (``module:obj.method``). Every failure raises `RewardLoadError`
whose message names the config field, the spec, and how to fix it, so a bad spec fails at
start, before any generation.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

_FORMS = "expected 'package.module:function' or 'path/to/file.py:function'"


class RewardLoadError(ValueError):
    """A reward function spec could not be turned into a callable; the message says why."""


def load_reward_function(
    spec: str, base_dir: str | None = None, *, field: str = "reward function"
) -> Callable[..., Any]:
    """Import the callable named by `spec`; `field` names the config entry in error messages."""
    obj = load_object(spec, base_dir, field=field)
    prefix = f"{field}={spec!r}"
    if not callable(obj):
        raise RewardLoadError(
            f"{prefix}: {spec.rpartition(':')[2]!r} is a {type(obj).__name__}, not callable; "
            "point at a function taking (prompts, completions, **kwargs)"
        )
    _check_signature(obj, prefix)
    return obj


def load_environment(spec: str, base_dir: str | None = None, *, field: str = "task.env") -> type:
    """Import the environment class named by `spec` (rl/data/env.py): a class with a `step` method."""
    obj = load_object(spec, base_dir, field=field)
    if not inspect.isclass(obj) or not callable(getattr(obj, "step", None)):
        raise RewardLoadError(f"{field}={spec!r}: {spec.rpartition(':')[2]!r} is not a class with a step(text, "
                              "token_ids) method; point at an environment class (see rl/data/env.py)")
    return obj


def load_object(spec: str, base_dir: str | None = None, *, field: str = "reward function") -> Any:
    """The object named by `spec` (`package.module:name` or `path/file.py:name`)."""
    prefix = f"{field}={spec!r}"
    if not isinstance(spec, str):
        raise RewardLoadError(f"{prefix}: must be a string; {_FORMS}")
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target or not attr:
        raise RewardLoadError(f"{prefix}: missing ':' between module or file and function; {_FORMS}")
    if not all(part.isidentifier() for part in attr.split(".")):
        raise RewardLoadError(f"{prefix}: {attr!r} is not a Python attribute name; {_FORMS}")

    if _looks_like_path(target):
        module = _load_file(target, base_dir, prefix)
        where = f"file {module.__file__}"
    else:
        module = _import_module(target, prefix, attr)
        where = f"module {target!r}"

    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if i == 0 else f"{where} object {'.'.join(attr.split('.')[:i])!r}"
            raise RewardLoadError(
                f"{prefix}: {owner} has no attribute {part!r}{_available(obj)}; "
                "fix the name after ':'"
            )
        obj = getattr(obj, part)
    return obj


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _load_file(target: str, base_dir: str | None, prefix: str) -> ModuleType:
    """Execute a .py file as a module named after its absolute path (reused if already loaded)."""
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else os.getcwd()) / path
    path = path.resolve()
    relative_to = (
        "the directory you launch from" if base_dir is None else f"the base directory {base_dir}"
    )
    if not path.exists():
        raise RewardLoadError(
            f"{prefix}: file {path} not found; give a path relative to {relative_to}, "
            "or an absolute path"
        )
    if not path.is_file():
        raise RewardLoadError(f"{prefix}: {path} is not a file; name a .py file before ':'")

    # A unique, stable name: two files called rewards.py must not collide, and the module must
    # be in sys.modules while it runs (dataclasses and pickling look it up there).
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_reward_file_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardLoadError(f"{prefix}: cannot load {path} as Python; name a .py file before ':'")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardLoadError(
            f"{prefix}: running {path} raised {type(exc).__name__}: {exc}; fix the file"
        ) from exc
    return module


def _import_module(target: str, prefix: str, attr: str) -> ModuleType:
    if not all(part.isidentifier() for part in target.split(".")):
        raise RewardLoadError(f"{prefix}: {target!r} is neither a module name nor a .py path; {_FORMS}")
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (target == missing or target.startswith(missing + ".")):
            raise RewardLoadError(
                f"{prefix}: module {target!r} not found; install it or add its directory to "
                f"PYTHONPATH, or give a file path instead, e.g. 'path/to/file.py:{attr}'"
            ) from exc
        raise RewardLoadError(
            f"{prefix}: importing module {target!r} failed: ModuleNotFoundError: {exc}; "
            "install the missing dependency"
        ) from exc
    except Exception as exc:
        raise RewardLoadError(
            f"{prefix}: importing module {target!r} raised {type(exc).__name__}: {exc}; fix the module"
        ) from exc


def _available(obj: Any) -> str:
    names = [
        n for n, v in vars(obj).items() if not n.startswith("_") and inspect.isfunction(v)
    ] if isinstance(obj, ModuleType) else []
    return f" (functions there: {', '.join(sorted(names)[:12])})" if names else ""


def _check_signature(fn: Callable[..., Any], prefix: str) -> None:
    """Reject functions that would fail on every call: dataset columns arrive as **kwargs."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins/C callables have no introspectable signature; the call will tell
    params = sig.parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise RewardLoadError(
            f"{prefix}: the function must accept **kwargs (completion_ids, finish_reasons and "
            "dataset columns are passed as keyword arguments); add **kwargs to its parameters"
        )
    for p in params:
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise RewardLoadError(
                f"{prefix}: parameter {p.name!r} is positional-only, but arguments are passed by "
                "keyword (prompts=..., completions=...); remove the '/'"
            )


def load_agent_function(spec: str, base_dir: str | None, kwargs: dict[str, Any],
                        field: str = "task.agent") -> Callable[..., Any]:
    """Import the agent function named by `spec` and check, before any episode, that it can be
    called as `fn(base_url, row, **kwargs)` (reward/agents/runner.py), and, when the function has a
    `check_kwargs` attribute, that `fn.check_kwargs(**kwargs)` accepts their values. An async
    function is accepted: reward.agents.pool runs the coroutine it returns with asyncio.run."""
    obj = load_object(spec, base_dir, field=field)
    if not callable(obj):
        raise RewardLoadError(
            f"{field}={spec!r}: {spec.rpartition(':')[2]!r} is a {type(obj).__name__}, not callable; "
            "point at a function taking (base_url, row, **kwargs)"
        )
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # no introspectable signature (some C callables): the first call will tell
    try:
        sig.bind("http://x", {}, **kwargs)
    except TypeError as exc:
        raise RewardLoadError(f"{field}={spec!r}: {_agent_call_problem(sig, spec, kwargs, field, exc)}") from exc
    check = getattr(obj, "check_kwargs", None)  # the agent's own look at its kwargs' values
    if callable(check):
        try:
            check(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any refusal is the config's error, named
            raise RewardLoadError(f"{field}={spec!r}: {field}_kwargs refused: {type(exc).__name__}: {exc}") from exc
    return obj


def _agent_call_problem(sig: inspect.Signature, spec: str, kwargs: dict[str, Any], field: str,
                        exc: TypeError) -> str:
    """Why `fn(base_url, row, **kwargs)` does not bind, in the config's terms."""
    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    by_keyword = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    if len(positional) < 2 and not any(p.kind is P.VAR_POSITIONAL for p in params):
        return (f"takes {len(positional)} positional parameter(s), but is called as fn(base_url, row, "
                f"**{field}_kwargs); give it two: (base_url, row, ...)")
    first_two = {p.name for p in positional[:2]}
    for name in kwargs:
        if name in first_two:
            return (f"{field}_kwargs has {name!r}, which {spec} already receives as one of (base_url, row); "
                    f"rename the parameter or remove it from {field}_kwargs")
        if name not in by_keyword and not any(p.kind is P.VAR_KEYWORD for p in params):
            return (f"{field}_kwargs has {name!r}, which {spec} does not take; add it to its "
                    f"parameters or remove it from {field}_kwargs")
    missing = [p.name for p in params if p.default is P.empty and p.name not in first_two | set(kwargs)
               and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if missing:
        return (f"parameter {missing[0]!r} has no default and is not in {field}_kwargs; give it a default "
                f"or set it in {field}_kwargs")
    return f"cannot be called as fn(base_url, row, **{field}_kwargs): {exc}"
