"""What a run does when a part of it fails: the failures it names, the deadlines it keeps, and
the stop request a signal leaves for the loop.

Plain Python (no Ray): the actor wrappers (`rollout.fleet`, `trainer.group`, `reward.service`,
`reward.envs`, `sandbox.pool`) call their actors through `fan_out`, which tells the answers from
the hung, the dead and the raised, and turn those into these; the loop and the entry point decide
what follows: replace the actor, stop at the step boundary with a checkpoint, or restart the run
from its latest one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Iterable, Mapping, TypeVar


class ActorFailure(RuntimeError):
    """An actor died or stopped answering and the run cannot go on without it (a learner rank,
    or a rollout worker that used up its restarts). `step` is filled in by the loop."""

    def __init__(self, actor: str, phase: str, why: str, step: int | None = None):
        self.actor, self.phase, self.why, self.step = actor, phase, why, step
        super().__init__(str(self))

    def __str__(self) -> str:
        at = f" at step {self.step + 1}" if self.step is not None else ""
        return f"{self.actor} failed during {self.phase}{at}: {self.why}"

    def at_step(self, step: int) -> ActorFailure:
        if self.step is None:
            self.step = step
        self.args = (str(self),)
        return self


class RunStopped(Exception):
    """The run stopped at a step boundary on request (a signal), after writing a checkpoint."""

    def __init__(self, reason: str, next_step: int):
        self.reason, self.next_step = reason, next_step
        super().__init__(f"stopped by {reason} after step {next_step}")


class RewardsFailing(RuntimeError):
    """Every sample's reward failed for `steps` steps in a row: training on nothing is no run."""

    def __init__(self, steps: int, first_error: str, next_step: int):
        self.next_step = next_step
        super().__init__(
            f"every sample's reward failed for {steps} steps in a row (reward.max_failed_steps={steps}); "
            f"the first error: {first_error}"
        )


class NotLearning(RuntimeError):
    """Every update of `steps` steps in a row was skipped (non-finite gradients, DeepSpeed's overflow
    skip): the weights stopped changing, which must not pass for a finished run (issue 47)."""

    def __init__(self, steps: int, next_step: int, last_finite: dict[str, float] | None):
        self.next_step = next_step
        shown = ", ".join(f"{k} {v:.4g}" for k, v in (last_finite or {}).items()) or "none: no update was ever applied"
        super().__init__(
            f"the learner skipped every update for {steps} steps in a row (trainer.max_skipped_steps={steps}): "
            "its gradients were not finite (DeepSpeed: OVERFLOW, skipping step), so the weights did not change. "
            "Look for huge or non-finite rewards/advantages (e.g. task.agent_reward_bound, reward scale) or a "
            f"learning rate too high; the last step with finite figures: {shown}"
        )


@dataclass
class StopRequest:
    """Set by the entry point's signal handler, read by the loop at the end of every step."""

    reason: str | None = None

    def request(self, reason: str) -> None:
        self.reason = reason


@dataclass
class Deadlines:
    """How long a call of one kind may take before its actor counts as hung: at least `floor_s`,
    or `factor` times the slowest call of that kind that finished, whichever is longer. The floor
    is generous; the factor scales it to the work once the run has seen some (a bigger model or
    batch makes every call slower, and the deadline follows). The first call of a kind gets
    `start_s`, as start-up does: it may include lazy set-up (kernels, caches, compilation)."""

    floor_s: float = 300.0
    factor: float = 10.0
    start_s: float = 900.0  # actor start-up: model load, engine and DeepSpeed set-up
    slowest: dict[str, float] = field(default_factory=dict)

    def of(self, kind: str) -> float:
        if kind not in self.slowest:
            return max(self.floor_s, self.start_s)
        return max(self.floor_s, self.factor * self.slowest[kind])

    def record(self, kind: str, seconds: float) -> None:
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), seconds)


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an error (Ray's carry a traceback after it). An error raised
    in an actor (Ray's RayTaskError) starts with the call's name: its `cause`, the remote
    exception itself, says what went wrong."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return f"{type(cause).__name__}: {first_line(cause)}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def hung(seconds: float) -> str:
    return f"no answer in {seconds:.0f} s (stopped or hung; the deadline is run.call_timeout_s)"


K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Calls:
    """How `fan_out` waits on and reads remote calls: the actor framework's side of it, so that
    this module imports none. `Calls.ray(ray)` builds Ray's, in a module that may import Ray."""

    wait: Callable[[list, float], Iterable[Any]]  # (refs, timeout_s) -> those finished by then
    get: Callable[[Any], Any]  # a finished ref -> its value (or raises)
    died: tuple[type[BaseException], ...]  # `get` raised one of these: the actor's process died
    raised: tuple[type[BaseException], ...]  # ... one of these: the call raised inside a live actor

    @classmethod
    def ray(cls, ray: Any) -> Calls:
        """Ray's, from the `ray` module its caller imported (checked first for a dead actor: a
        task error whose cause is a dead actor counts as dead)."""
        return cls(wait=lambda refs, timeout_s: ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0],
                   get=ray.get, died=(ray.exceptions.RayActorError,), raised=(ray.exceptions.RayTaskError,))


@dataclass
class FanOut(Generic[K]):
    """What became of the calls of one `fan_out`, by key. Every key is in exactly one of
    `results`, `hung`, `died` and `raised`; `keys` keeps the order the calls were given in."""

    deadline_s: float
    elapsed_s: float = 0.0  # from the start of the wait until the last result was read
    keys: list[K] = field(default_factory=list)
    results: dict[K, Any] = field(default_factory=dict)
    hung: dict[K, str] = field(default_factory=dict)  # no answer by the deadline: `hung(deadline_s)`
    died: dict[K, str] = field(default_factory=dict)  # "its process died (<first line of the error>)"
    raised: dict[K, str] = field(default_factory=dict)  # the first line of the error raised inside
    errors: dict[K, BaseException] = field(default_factory=dict)  # the error behind each died or raised key

    @property
    def failed(self) -> dict[K, str]:
        """The lost actors, hung or dead, with why, in call order (one that raised is not lost)."""
        return {k: self.hung[k] if k in self.hung else self.died[k] for k in self.keys
                if k in self.hung or k in self.died}


def fan_out(refs: Mapping[K, Any], deadline_s: float, calls: Calls, *,
            kill: Callable[[K], None] | None = None, propagate_raised: bool = False) -> FanOut[K]:
    """Wait for every call in `refs` (key -> ref of a call already made), all together, for at
    most `deadline_s`, then read them in order: an answer, no answer (`kill(key)` is called, when
    given: the actor is stopped or stuck), a dead process, or an error raised inside the actor
    (`propagate_raised`: it propagates from here at once, as the caller's own bug would). Any
    other error from `calls.get` propagates too."""
    out: FanOut[K] = FanOut(deadline_s=deadline_s)
    started = time.monotonic()
    finished = set(calls.wait(list(refs.values()), deadline_s)) if refs else set()
    for key, ref in refs.items():
        out.keys.append(key)
        if ref not in finished:
            if kill is not None:
                kill(key)
            out.hung[key] = hung(deadline_s)
            continue
        try:
            out.results[key] = calls.get(ref)
        except calls.died as exc:
            out.died[key], out.errors[key] = f"its process died ({first_line(exc)})", exc
        except calls.raised as exc:
            if propagate_raised:
                raise
            out.raised[key], out.errors[key] = first_line(exc), exc
    out.elapsed_s = time.monotonic() - started
    return out
