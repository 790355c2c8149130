"""The environment API: what a multi-turn task implements (named in config as `task.env`).

An environment is plain Python, like a reward function: a class named as
``package.module:Class`` or ``path/to/file.py:Class``, built once per episode with the fixed
keyword arguments of `task.env_kwargs`. Each method may be a plain or an ``async def``::

    class Guess:
        def __init__(self, **kwargs): ...          # task.env_kwargs
        def reset(self, row: dict) -> None: ...     # the dataset row the episode starts from (optional)
        def step(self, text: str, token_ids: list[int]) -> StepResult: ...

`step` gets the model's turn (decoded text, and the sampled token ids exactly as generated) and
answers with a `StepResult`: an observation to append (text, or chat messages such as
``[{"role": "tool", "content": "42"}]``), an optional reward for this turn, and whether the
episode is done. A plain ``(observation, reward, done)`` tuple is accepted too. The episode also
ends at `task.max_turns` model turns or when its token budget is spent.

An environment that raises, returns anything else or does not answer within
`task.env_timeout_s` ends that episode with the error recorded on its sample (reward None, not
trained on); the other episodes and the step go on. Environments run in Ray actors
(`reward.envs.EnvService`), never on the driver; they may send jobs to the sandbox pool
(`reward.code_speedup.judge`) like reward functions do.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Union

Observation = Union[str, list[dict[str, Any]], None]


@dataclass
class StepResult:
    """The environment's answer to one model turn."""

    observation: Observation = None  # appended after the model's turn; None or "" appends nothing
    reward: float | None = None  # this turn's reward (summed over the episode; GAE puts it on the turn's last token)
    done: bool = False  # True: the episode ends after this turn
    info: dict[str, Any] = field(default_factory=dict)  # logged with the turn in samples.jsonl


class Environment:
    """Optional base class: subclass it, or write any class with `step` (and `reset`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode from `row`, the dataset row (every column) its prompt came from."""

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        raise NotImplementedError


class MalformedStep(ValueError):
    """An environment's `step` returned something that is not a StepResult."""


def as_step_result(out: Any) -> StepResult:
    """Check an environment's answer: a StepResult, or an (observation, reward, done) tuple."""
    if isinstance(out, tuple) and len(out) == 3:
        out = StepResult(*out)
    if not isinstance(out, StepResult):
        raise MalformedStep(f"step returned {type(out).__name__}; return a StepResult(observation, reward, done) "
                            "or an (observation, reward, done) tuple")
    obs = out.observation
    if not (obs is None or isinstance(obs, str) or _is_messages(obs)):
        raise MalformedStep(f"step returned an observation of type {type(obs).__name__}; return text, a list of "
                            "chat messages ({'role': ..., 'content': str}) or None")
    if out.reward is not None and not (isinstance(out.reward, numbers.Real) and not isinstance(out.reward, bool)
                                       and math.isfinite(float(out.reward))):
        raise MalformedStep(f"step returned reward {out.reward!r}; return a finite float or None")
    if not isinstance(out.done, (bool, int)):
        raise MalformedStep(f"step returned done={out.done!r}; return True or False")
    if not isinstance(out.info, dict):
        raise MalformedStep(f"step returned info of type {type(out.info).__name__}; return a dict")
    return StepResult(obs, None if out.reward is None else float(out.reward), bool(out.done), out.info)


def _is_messages(obs: Any) -> bool:
    return isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs)
