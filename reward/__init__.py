"""Reward functions: the user-facing API, and the Ray pool (`RewardService`) that runs them.

A reward function is plain Python, named in config as ``package.module:function`` or
``path/to/file.py:function`` (a relative path is resolved against the directory you launch
from). It is called once per batch, with keyword arguments::

    def my_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
        ...

    async def my_async_reward(prompts, completions, **kwargs) -> list[float | None]:
        ...

- ``prompts[i]`` / ``completions[i]``: the prompt text and the decoded completion of sample i
  (without the EOS token).
- ``kwargs`` always include ``completion_ids: list[list[int]]`` and
  ``finish_reasons: list[str]`` (``"stop"``, or ``"length"`` when cut off at max_tokens), plus
  every dataset column as a list, e.g. ``answer: list[str]``. A column a sample lacks is None.
  Because columns vary by dataset, the function must accept ``**kwargs``.
- Return one value per sample: a float, or ``None`` for "this function does not apply to this
  sample". None is skipped in the weighted sum; a sample to which no function applies is an
  error ("no reward function returned a value"). Return an exception *instance* (not raise) for
  a sample whose value could not be computed (e.g. the code sandbox failed): that sample gets
  ``reward=None`` and the exception as its error, the others keep their values.
- Config may fix extra keyword arguments: ``{fn: ..., kwargs: {max_speedup: 100}}``.

Several functions combine as ``reward = sum(weight * value)`` over those that returned a value;
``ScoredSample.components`` keeps each function's unweighted value by name.

Failures are recorded per sample, never crash a step and never become a silent zero: if a batched
call raises, the function is re-run one sample at a time and only the failing samples get
``reward=None`` and ``error="<name>: <ExceptionType>: <message>"``. A call that exceeds
``timeout_s`` marks its samples with a timeout error (a timed-out sync function keeps running in
an abandoned thread; see `reward.scorer`). Returning the wrong number of values, or a value that
is not a finite number or None, is an error naming the function.

Example (``my_rewards.py``, configured as ``fn: my_rewards.py:short_and_right``)::

    def short_and_right(prompts, completions, answer, finish_reasons, **kwargs):
        return [
            None if a is None else float(c.strip() == a and r == "stop")
            for c, a, r in zip(completions, answer, finish_reasons)
        ]

Importing this package does not import Ray; `RewardService` loads it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reward.loader import RewardLoadError, load_reward_function
from reward.scorer import RewardCallTimeout, RewardFunctionSpec, RewardScorer

if TYPE_CHECKING:
    from reward.service import RewardService, RewardWorker

__all__ = [
    "RewardCallTimeout",
    "RewardFunctionSpec",
    "RewardLoadError",
    "RewardScorer",
    "RewardService",
    "RewardWorker",
    "load_reward_function",
]


def __getattr__(name: str) -> Any:
    if name in ("RewardService", "RewardWorker"):
        from reward import service

        return getattr(service, name)
    raise AttributeError(f"module 'reward' has no attribute {name!r}")
