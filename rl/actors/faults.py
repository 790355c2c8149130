"""What a run does when a part of it fails: the failures it names, the deadlines it keeps, and
the stop request a signal leaves for the loop.

Plain Python (no Ray): the actor wrappers (`rollout.fleet`, `trainer.group`, `reward.service`,
`reward.envs`, `sandbox.pool`) call their actors through `fan_out`, which tells the answers from
the hung, the dead and the raised, and turn those into these; the loop and the entry point decide
what follows: replace the actor, stop at the step boundary with a checkpoint, or restart the run
from its latest one.
"""

from __future__ import annotations

import re
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
    """Every sample's reward failed for `steps` steps in a row: training on nothing is no run.
    `limit`: reward.max_failed_steps (default: `steps`); `ended`: the run reached `run.steps` with
    its last `steps` steps failing, fewer than the limit (never exit code 0 with no reward)."""

    def __init__(self, steps: int, first_error: str, next_step: int, limit: int | None = None,
                 ended: bool = False):
        self.next_step = next_step
        super().__init__(f"every sample's reward failed {_failed_steps(steps, limit, ended)}; the first error: "
                         f"{first_error}")


def _failed_steps(steps: int, limit: int | None, ended: bool) -> str:
    limit = steps if limit is None else limit
    if ended:
        return f"in the run's last {steps} step(s), where it ended (before reward.max_failed_steps={limit})"
    return f"for {steps} steps in a row (reward.max_failed_steps={limit})"


class EpisodesFailing(RewardsFailing):
    """Every episode (an agent's or an environment's) failed for `steps` steps in a row, or in the
    run's last steps (`ended`): named by the most common cause of the last step's episodes
    (`common_cause`), e.g. an agent pool that can no longer run any episode (issue 58)."""

    def __init__(self, steps: int, cause: str, count: int, total: int, next_step: int, limit: int | None = None,
                 ended: bool = False):
        self.next_step, self.cause = next_step, cause
        RuntimeError.__init__(self, f"every episode failed {_failed_steps(steps, limit, ended)}; the cause of "
                                    f"{count} of the {total} episodes of the last step: {cause}")


# the per-sample error of an agent episode (reward/agents/runner.py, `episode_error`): the agent,
# the prompt and the sample, the cause, then the end of what the agent printed
_EPISODE_PREFIX = re.compile(r"^(task\.agent=.+?) on prompt .*? \(group \d+, sample \d+\): ", re.DOTALL)
_OUTPUT_TAIL = " [its output ends: "


def episode_error(agent: str, prompt: str, group: int, index: int, cause: str, output_tail: str = "") -> str:
    """An agent episode's error, as its sample carries it: `episode_cause` reads the cause back."""
    return (f"task.agent={agent} on prompt {prompt[:60]!r} (group {group}, sample {index}): {cause}"
            + (f"{_OUTPUT_TAIL}{output_tail[-300:]}]" if output_tail else ""))


def episode_cause(error: str) -> str:
    """What a sample's error says went wrong, without what differs from sample to sample: an agent
    episode's prompt, group and index, and the end of its output. `task.agent=<spec> on prompt
    '2+2=' (group 3, sample 1): could not run: ... [its output ends: ...]` -> `task.agent=<spec>:
    could not run: ...`. Any other error is kept as it is."""
    cause = _EPISODE_PREFIX.sub(r"\1: ", error, count=1)
    if cause != error and _OUTPUT_TAIL in cause:
        cause = cause[:cause.index(_OUTPUT_TAIL)]
    return cause


def common_cause(errors: list[str]) -> tuple[str, int]:
    """The most common `episode_cause` of `errors` (the first seen of equals) and how many share it."""
    counts: dict[str, int] = {}
    for error in errors:
        cause = episode_cause(error)
        counts[cause] = counts.get(cause, 0) + 1
    cause = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts: the first seen
    return cause, counts[cause]


@dataclass(frozen=True)
class Failures:
    """A step's failed samples: `failed` of `total`, their most common cause (`common_cause`) and
    how many share it (`count`); `episodes`: the samples are episodes (an agent's or an environment's)."""

    failed: int
    total: int
    cause: str
    count: int
    episodes: bool

    @classmethod
    def of(cls, scored: Iterable[Any]) -> Failures | None:
        """The failures of a step's ScoredSamples (None when none failed)."""
        scored = list(scored)
        errors = [s.error for s in scored if s.error is not None]
        if not errors:
            return None
        cause, count = common_cause(errors)
        return cls(len(errors), len(scored), cause, count,
                   any(getattr(s.sample, "turns", None) is not None for s in scored))

    @property
    def every(self) -> bool:
        return self.failed >= self.total

    def line(self) -> str:
        """The step line's part, e.g. `32 of 32 episodes failed: task.agent=a.py:f: could not run: ...`."""
        others = f" (and {self.failed - self.count} other errors: samples.jsonl)" if self.count < self.failed else ""
        kind = "episodes" if self.episodes else "samples"
        return f"{self.failed} of {self.total} {kind} failed: {self.cause}{others}"

    def error(self, steps: int, first_error: str, next_step: int, limit: int, ended: bool) -> RewardsFailing:
        """The run's stop after `steps` steps like this one (RewardsFailing; EpisodesFailing for episodes)."""
        if self.episodes:
            return EpisodesFailing(steps, self.cause, self.count, self.total, next_step, limit, ended)
        return RewardsFailing(steps, first_error, next_step, limit, ended)


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

    def key(self, kind: str) -> str:
        """The setting that sets `of(kind)` now: the one to raise when a call of `kind` needs longer
        (`start_s` is run.start_timeout_s, `floor_s` run.call_timeout_s, `factor` its factor)."""
        if kind not in self.slowest:
            return "run.start_timeout_s" if self.start_s > self.floor_s else "run.call_timeout_s"
        return "run.call_timeout_factor" if self.factor * self.slowest[kind] > self.floor_s else "run.call_timeout_s"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an error (Ray's carry a traceback after it). An error raised
    in an actor (Ray's RayTaskError) starts with the call's name: its `cause`, the remote
    exception itself, says what went wrong."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return f"{type(cause).__name__}: {first_line(cause)}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def hung(seconds: float, setting: str = "run.call_timeout_s") -> str:
    """Why a call that did not answer by its deadline failed; `setting`: where that deadline comes
    from (the config key to raise when it was too short)."""
    return f"no answer in {seconds:.0f} s (stopped or hung; the deadline is {setting})"


K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Calls:
    """How `fan_out` waits on and reads remote calls: the actor framework's side of it, so that
    this module imports none. `Calls.ray(ray)` builds Ray's, in a module that may import Ray."""

    wait: Callable[[list, float], Iterable[Any]]  # (refs, timeout_s) -> those finished by then
    get: Callable[[Any], Any]  # a finished ref -> its value (or raises)
    died: tuple[type[BaseException], ...]  # `get` raised one of these: the actor's process died
    raised: tuple[type[BaseException], ...]  # ... one of these: the call raised inside a live actor
    # ... one of these (among `died`): the actor is being started again after its process died, and
    # a call made meanwhile may not have run; `await_answers` asks it again
    unavailable: tuple[type[BaseException], ...] = ()

    @classmethod
    def ray(cls, ray: Any) -> Calls:
        """Ray's, from the `ray` module its caller imported (checked first for a dead actor: a
        task error whose cause is a dead actor counts as dead)."""
        restarting = getattr(ray.exceptions, "ActorUnavailableError", None)
        return cls(wait=lambda refs, timeout_s: ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0],
                   get=ray.get, died=(ray.exceptions.RayActorError,), raised=(ray.exceptions.RayTaskError,),
                   unavailable=(restarting,) if restarting else ())


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
            kill: Callable[[K], None] | None = None, propagate_raised: bool = False,
            setting: str = "run.call_timeout_s") -> FanOut[K]:
    """Wait for every call in `refs` (key -> ref of a call already made), all together, for at
    most `deadline_s`, then read them in order: an answer, no answer (`kill(key)` is called, when
    given: the actor is stopped or stuck), a dead process, or an error raised inside the actor
    (`propagate_raised`: it propagates from here at once, as the caller's own bug would). Any
    other error from `calls.get` propagates too. `setting`: where the deadline comes from (a config
    key), named in a hung call's `hung` message."""
    out: FanOut[K] = FanOut(deadline_s=deadline_s)
    started = time.monotonic()
    finished = set(calls.wait(list(refs.values()), deadline_s)) if refs else set()
    for key, ref in refs.items():
        out.keys.append(key)
        if ref not in finished:
            if kill is not None:
                kill(key)
            out.hung[key] = hung(deadline_s, setting)
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


def await_answers(call: Callable[[K], Any], keys: Iterable[K], deadline_s: float, calls: Calls, *,
                  setting: str = "run.start_timeout_s", poll_s: float = 0.5) -> FanOut[K]:
    """Until every actor of `keys` answers a call `call(key)` makes (a fresh one each time), all
    within `deadline_s`: the wait for actors the framework is starting again after their process
    died. A call refused meanwhile (`calls.unavailable`: the actor is restarting) is made again
    every `poll_s`; one that gets no answer by the deadline is `hung` (naming `setting`), one whose
    actor is gone for good `died`, one that raised `raised`."""
    keys = list(keys)
    out: FanOut[K] = FanOut(deadline_s=deadline_s, keys=keys)
    started = time.monotonic()
    end, pending = started + deadline_s, keys
    while pending:
        step = fan_out({k: call(k) for k in pending}, max(0.0, end - time.monotonic()), calls)
        pending = []
        for k in step.keys:
            if k in step.died and isinstance(step.errors[k], calls.unavailable):
                if time.monotonic() + poll_s < end:
                    pending.append(k)
                else:
                    out.hung[k] = hung(deadline_s, setting)
            elif k in step.hung:
                out.hung[k] = hung(deadline_s, setting)
            elif k in step.results:
                out.results[k] = step.results[k]
            else:
                for have, into in ((step.died, out.died), (step.raised, out.raised)):
                    if k in have:
                        into[k], out.errors[k] = have[k], step.errors[k]
        if pending:
            time.sleep(poll_s)
    out.elapsed_s = time.monotonic() - started
    return out
