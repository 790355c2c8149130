"""What a run does when a part of it fails: the failures it names, the deadlines it keeps, and
the stop request a signal leaves for the loop.

Plain Python (no Ray): the actor wrappers (`rollout.fleet`, `trainer.group`, `reward.service`)
turn Ray's errors into these, and the loop and the entry point decide what follows: replace
the actor, stop at the step boundary with a checkpoint, or restart the run from its latest one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """The first non-empty line of an error (Ray's carry a traceback after it)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def hung(seconds: float) -> str:
    return f"no answer in {seconds:.0f} s (stopped or hung; the deadline is run.call_timeout_s)"
