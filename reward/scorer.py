"""Score samples with weighted user reward functions, recording failures per sample.

Pure Python (no Ray), so it is unit-testable and the `RewardService` actors simply wrap it.
A reward function that raises, times out or returns garbage marks only the affected samples
with an error (reward None); it never crashes the step and never silently becomes a zero. So does
a value beyond +-`bound` (`reward.bound`), and a weighted sum beyond it: a reward of 1e300
overflowed GRPO's group std (its advantages became 0) and a critic's squared error (issue 58).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from rl.data.types import Sample, ScoredSample
from reward.loader import RewardLoadError, load_reward_function

RESERVED_KWARGS = ("prompts", "completions", "completion_ids", "finish_reasons")
NO_VALUE_ERROR = "no reward function returned a value"
DEFAULT_BOUND = 1e6  # reward.bound's default (rl/config/schema.py)
_ASYNC_GRACE_S = 1.0  # time for a timed-out coroutine to unwind after it is cancelled


@dataclass
class RewardFunctionSpec:
    """One entry of the reward config: which function, its weight, and its name in logs."""

    fn: str
    weight: float = 1.0
    name: str | None = None  # defaults to the function's __name__
    kwargs: dict[str, Any] | None = None  # fixed keyword arguments, e.g. a threshold from config


class RewardCallTimeout(Exception):
    """A reward call did not finish within timeout_s (its thread or task was abandoned)."""


class _BadOutput(Exception):
    """A reward function's return value as a whole is unusable (not a list, wrong length)."""


@dataclass
class _Loaded:
    name: str
    weight: float
    fn: Callable[..., Any]
    field: str = "reward.functions[?]"  # where the config names it


class RewardScorer:
    """Loads reward functions eagerly (a bad spec fails here) and scores batches of samples.

    `functions` may also hold mappings with the same keys (fn, weight, name), e.g. config entries.
    """

    def __init__(
        self,
        functions: list[RewardFunctionSpec],
        timeout_s: float = 60.0,
        base_dir: str | None = None,
        bound: float = DEFAULT_BOUND,
    ) -> None:
        if not functions:
            raise RewardLoadError("reward.functions is empty; configure at least one reward function")
        if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise ValueError(f"reward.timeout_s={timeout_s!r}: must be a positive number of seconds")
        if isinstance(bound, bool) or not (isinstance(bound, numbers.Real) and 0 < bound < math.inf):
            raise ValueError(f"reward.bound={bound!r}: must be a positive finite number, e.g. reward.bound=1e6")
        self.timeout_s, self.bound = float(timeout_s), float(bound)
        self.functions: list[_Loaded] = []
        seen: dict[str, int] = {}
        for i, spec in enumerate(functions):
            field = f"reward.functions[{i}]"
            if isinstance(spec, Mapping):
                spec = RewardFunctionSpec(**spec)
            weight = spec.weight
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise RewardLoadError(f"{field}.weight={weight!r}: must be a finite number")
            fn = load_reward_function(spec.fn, base_dir, field=f"{field}.fn")
            name = spec.name or getattr(fn, "__name__", None) or spec.fn.rpartition(":")[2]
            if spec.kwargs:
                fn = _bind_kwargs(fn, dict(spec.kwargs), field)
            if name in seen:
                raise RewardLoadError(
                    f"{field}: name {name!r} is already used by reward.functions[{seen[name]}]; "
                    f"set {field}.name to tell them apart"
                )
            seen[name] = i
            self.functions.append(_Loaded(name=name, weight=float(weight), fn=fn, field=field))

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def missing_columns(self, columns: list[str]) -> dict[int, list[str]]:
        """By function index, the dataset columns a function requires (arguments without a
        default, other than the per-sample ones and its config kwargs, and those its
        `columns_needed(**kwargs)` names, e.g. a judge's template fields) that `columns` lacks."""
        missing: dict[int, list[str]] = {}
        for i, f in enumerate(self.functions):
            try:
                params = inspect.signature(f.fn).parameters.values()
            except (TypeError, ValueError):  # a builtin or C function: nothing to tell
                continue
            given = getattr(f.fn, "keywords", {})  # config kwargs (the signature is the unbound function's)
            needed = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in RESERVED_KWARGS
                      and p.name not in given
                      and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
            declared = getattr(f.fn, "columns_needed", None)
            if declared is not None:
                try:
                    needed += [c for c in declared(**given) if c not in needed]
                except ValueError as err:
                    raise RewardLoadError(f"reward.functions[{i}].kwargs: {err}") from None
            lacking = [name for name in needed if name not in columns]
            if lacking:
                missing[i] = lacking
        return missing

    def score(self, samples: list[Sample]) -> list[ScoredSample]:
        """One batched call per function; a failing batch is retried per sample to isolate errors."""
        if not samples:
            return []
        kwargs = build_kwargs(samples)
        per_fn = [self._run_function(f, kwargs, len(samples)) for f in self.functions]
        scored = []
        for i, sample in enumerate(samples):
            components: dict[str, float | None] = {}
            errors: list[str] = []
            total, applied = 0.0, False
            for f, (values, errs) in zip(self.functions, per_fn):
                components[f.name] = values[i]
                if errs[i] is not None:
                    errors.append(errs[i])
                elif values[i] is not None:
                    total += f.weight * values[i]
                    applied = True
            if not errors and not applied:
                errors.append(NO_VALUE_ERROR)
            if not errors and not abs(total) <= self.bound:  # NaN too (inf - inf)
                errors.append(self._sum_error(components, total))
            scored.append(
                ScoredSample(
                    sample=sample,
                    reward=None if errors else total,
                    components=components,
                    error="; ".join(errors) if errors else None,
                )
            )
        return scored

    def _sum_error(self, components: dict[str, float | None], total: float) -> str:
        terms = " + ".join(f"{f.weight:g} * {components[f.name]!r}" for f in self.functions
                           if components[f.name] is not None)
        return (f"the weighted sum of reward.functions ({terms} = {total!r}) is beyond reward.bound={self.bound:g}: "
                "lower reward.functions[i].weight, or raise reward.bound")

    def _checked(self, f: _Loaded, out: Any, n: int) -> tuple[list[float | None], list[str | None]]:
        return _check_values(f.name, out, n, self.bound, f.field)

    def _run_function(
        self, f: _Loaded, kwargs: dict[str, list[Any]], n: int
    ) -> tuple[list[float | None], list[str | None]]:
        """Values and error strings (one each per sample) for one reward function."""
        try:
            return self._checked(f, call_with_timeout(f.fn, _copy(kwargs), self.timeout_s), n)
        except RewardCallTimeout:
            # Retrying one by one could cost n * timeout_s; the whole batch is marked instead.
            msg = f"{f.name}: {_timeout_message(self.timeout_s)} for a batch of {n} samples"
            return [None] * n, [msg] * n
        except _BadOutput as exc:
            return [None] * n, [str(exc)] * n
        except (Exception, SystemExit) as exc:
            if n == 1:
                return [None], [f"{f.name}: {type(exc).__name__}: {exc}"]
        # The batched call raised: re-run one sample at a time to find which samples fail.
        values: list[float | None] = []
        errors: list[str | None] = []
        for i in range(n):
            (v,), (e,) = self._run_one(f, kwargs, i)
            values.append(v)
            errors.append(e)
        return values, errors

    def _run_one(
        self, f: _Loaded, kwargs: dict[str, list[Any]], i: int
    ) -> tuple[list[float | None], list[str | None]]:
        one = {k: [v[i]] for k, v in kwargs.items()}
        try:
            return self._checked(f, call_with_timeout(f.fn, one, self.timeout_s), 1)
        except RewardCallTimeout:
            return [None], [f"{f.name}: {_timeout_message(self.timeout_s)}"]
        except _BadOutput as exc:
            return [None], [str(exc)]
        except (Exception, SystemExit) as exc:
            return [None], [f"{f.name}: {type(exc).__name__}: {exc}"]


def _bind_kwargs(fn: Callable[..., Any], fixed: dict[str, Any], field: str) -> Callable[..., Any]:
    """`fn` with config-given keyword arguments fixed; names that clash with per-sample
    arguments are refused here rather than on every call."""
    clash = sorted(set(fixed) & set(RESERVED_KWARGS))
    if clash:
        raise RewardLoadError(f"{field}.kwargs: {clash} are passed per sample; remove them from kwargs")
    bound = functools.partial(fn, **fixed)
    functools.update_wrapper(bound, fn)
    return bound


def build_kwargs(samples: list[Sample]) -> dict[str, list[Any]]:
    """The batched keyword arguments: fixed fields plus one list per metadata column."""
    kwargs: dict[str, list[Any]] = {
        "prompts": [s.prompt_text for s in samples],
        "completions": [s.completion_text for s in samples],
        "completion_ids": [list(s.completion_ids) for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
    }
    columns: dict[str, None] = {}
    for s in samples:
        columns.update(dict.fromkeys(s.metadata))
    for col in columns:
        if col in RESERVED_KWARGS:
            raise ValueError(
                f"dataset column {col!r} clashes with the reward argument of the same name; "
                f"rename the column (reserved: {', '.join(RESERVED_KWARGS)})"
            )
        kwargs[col] = [s.metadata.get(col) for s in samples]
    return kwargs


def _copy(kwargs: dict[str, list[Any]]) -> dict[str, list[Any]]:
    # Fresh lists per function, so one function mutating its arguments cannot affect the next.
    return {k: list(v) for k, v in kwargs.items()}


def _timeout_message(timeout_s: float) -> str:
    return f"RewardCallTimeout: no result within timeout_s={timeout_s:g}s (call abandoned)"


def _check_values(name: str, out: Any, n: int, bound: float = DEFAULT_BOUND,
                  field: str = "reward.functions[?]") -> tuple[list[float | None], list[str | None]]:
    """One value per sample: a finite real within +-`bound`, None, or an exception (that sample's
    error); anything else is that sample's error, naming the function (`field`, `name`)."""
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise _BadOutput(f"{name}: returned {type(out).__name__}, expected a list of {n} floats or None")
    values = list(out)
    if len(values) != n:
        raise _BadOutput(f"{name}: returned {len(values)} values for {n} samples; return one per sample")
    result: list[float | None] = []
    errors: list[str | None] = []
    for v in values:
        if v is None:
            result.append(None)
            errors.append(None)
        elif isinstance(v, BaseException):  # the function's way to report one sample's failure
            result.append(None)
            errors.append(f"{name}: {type(v).__name__}: {v}")
        elif isinstance(v, numbers.Real) and math.isfinite(x := _as_float(v)) and abs(x) <= bound:
            result.append(x)
            errors.append(None)
        elif isinstance(v, numbers.Real) and math.isfinite(x):
            result.append(None)
            errors.append(f"{field} {name} returned {x!r}, beyond reward.bound={bound:g}: return a reward within "
                          f"+-{bound:g} (one this large overflows the update), or raise reward.bound")
        else:
            result.append(None)
            shown = repr(v) if isinstance(v, numbers.Real) else type(v).__name__
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            errors.append(f"{name}: returned {shown}, expected a finite float or None")
    return result, errors


def _as_float(v: numbers.Real) -> float:
    """float(v), or inf for an integer too large for a float (10**400)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


def call_with_timeout(fn: Callable[..., Any], kwargs: dict[str, list[Any]], timeout_s: float) -> Any:
    """Call `fn(**kwargs)` in a daemon thread, awaiting it there if it is async.

    Sync functions are bounded by joining the thread with a timeout; async ones additionally by
    cancelling their task after `timeout_s` (asyncio.wait_for style). A thread that overruns is
    abandoned: Python cannot kill a thread, so it keeps running (and using CPU) in the
    background until the function returns by itself. Running in a fresh thread also means an
    async function gets its own event loop, even if the caller already runs one.
    """
    box: dict[str, Any] = {}
    awaiting = threading.Event()
    deadline = time.monotonic() + timeout_s

    def target() -> None:
        try:
            out = fn(**kwargs)
            if inspect.isawaitable(out):
                awaiting.set()
                out = asyncio.run(_await_until(out, deadline))
            box["value"] = out
        except BaseException as exc:  # handed to the calling thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() and awaiting.is_set():
        thread.join(_ASYNC_GRACE_S)  # the task was cancelled at the deadline; let it unwind
    if thread.is_alive():
        raise RewardCallTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _await_until(awaitable: Any, deadline: float) -> Any:
    # asyncio.wait (not wait_for) so a TimeoutError raised by the user's own code stays theirs.
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
    if not done:
        task.cancel()
        raise RewardCallTimeout()
    return task.result()
