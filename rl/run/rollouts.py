"""Where each step's groups come from (docs/architecture.md "Rollouts"): one protocol for the
schedule and one for the samples, so the loop never asks which ones it has.

A `Source` makes samples: single completions from the fleet (`Completions`), environment episodes
(`EnvEpisodes`, the framework driving `task.env`) or agent episodes (`reward.agents.runner.AgentRunner`,
the user's `task.agent`). Each takes a batch (`run`, blocking) and a stream (`submit`/`drain`).

`Rollouts` schedules them against the learner: `LockStep` generates a step's batch when the step
starts (on-policy); `rl.run.pipeline.RolloutPipeline` generates batches up to k steps ahead in a
thread; `rl.run.streaming.StreamingRollouts` keeps requests flowing and hands the learner finished
groups. All three are `take(step)`, `between_batches()` (what a weight sync waits for),
`in_flight(whole)` (what a checkpoint keeps) and `close()`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Protocol, TypeVar

from rl.data.episodes import Episodes
from rl.data.types import GenerationRequest, Sample, ScoredSample

Batch = tuple[list[ScoredSample], list[Sample], dict[str, float]]  # scored, as generated, metrics


class Source(Protocol):
    def run(self, requests: list[GenerationRequest]) -> list[Sample]:
        """One sample per request, in request order (blocking; every wait has a deadline)."""

    def submit(self, requests: list[GenerationRequest]) -> None: ...
    def drain(self, wait_s: float) -> list[Sample]:
        """The samples of submitted requests finished since the last call (waiting up to `wait_s`)."""

    def repair(self) -> None:
        """Replace what failed (rollout workers), on the thread that also runs the weight syncs."""

    def close(self) -> None: ...


class Rollouts(Protocol):
    def take(self, step: int) -> Batch: ...
    def between_batches(self) -> ContextManager[Any]: ...
    def in_flight(self, whole: bool = True) -> dict[Any, Any]:
        """What a checkpoint records so that a resumed run neither loses nor repeats a prompt;
        `whole=False`: the fleet failed (only what does not depend on it)."""

    def close(self) -> None: ...


class Repairs(Protocol):
    def repair(self) -> None:
        """Replace lost rollout workers and bring them up to date (the driver's `Cluster`)."""


T = TypeVar("T")


def repaired_while(work: Callable[[], T], repairs: Repairs, poll_s: float = 0.2) -> T:
    """`work()` on a helper thread while this thread keeps the fleet whole (`repairs.repair()`
    every `poll_s`): a fleet call that lost its worker waits for the replacement, which only the
    repairer makes. Every wait inside `work` has its own deadline, so this ends with it."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="repaired")
    try:
        future = pool.submit(work)
        while True:
            try:
                return future.result(timeout=poll_s)
            except FutureTimeout:
                repairs.repair()
    finally:
        pool.shutdown(wait=False)


class LockStep:
    """On-policy: each step's batch is generated and scored when the step asks for it."""

    def __init__(self, produce: Callable[[int], Batch]):
        self._produce = produce

    def take(self, step: int) -> Batch:
        scored, samples, metrics = self._produce(step)
        return scored, samples, {**metrics, "time/wait_rollout_s": 0.0}  # made now: time/rollout_s, not a wait

    def between_batches(self) -> ContextManager[Any]:
        return nullcontext()

    def in_flight(self, whole: bool = True) -> dict[Any, Any]:
        return {}

    def close(self) -> None:
        pass


class Completions:
    """Single completions: the fleet itself (`rollout.fleet.RolloutFleet` or any object with its
    `generate`, `submit` and `drain`); `repairs` replaces its lost workers."""

    def __init__(self, fleet: Any, repairs: Repairs):
        self.fleet, self.repairs = fleet, repairs

    def run(self, requests: list[GenerationRequest]) -> list[Sample]:
        return repaired_while(lambda: self.fleet.generate(requests), self.repairs)

    def submit(self, requests: list[GenerationRequest]) -> None:
        self.fleet.submit(requests)

    def drain(self, wait_s: float) -> list[Sample]:
        return self.fleet.drain(wait_s)

    def repair(self) -> None:
        self.repairs.repair()

    def close(self) -> None:
        pass


class EnvEpisodes:
    """Environment episodes (`task.env`): the framework drives the environment turn by turn, every
    turn of a batch's live episodes generated together (`rl.data.episodes.run_episodes`). In a
    stream, each submitted batch runs in a thread of its own; its waits are the fleet's and the
    environments' (each with its deadline)."""

    def __init__(self, episodes: Episodes, fleet: Any, repairs: Repairs, max_batches: int = 8):
        self.episodes, self.fleet, self.repairs = episodes, fleet, repairs
        self._pool = ThreadPoolExecutor(max_batches, thread_name_prefix="episodes")
        self._lock = threading.Condition()
        self._futures: list[Future] = []

    def run(self, requests: list[GenerationRequest]) -> list[Sample]:
        return repaired_while(lambda: self._episodes(requests), self.repairs)

    def _episodes(self, requests: list[GenerationRequest]) -> list[Sample]:
        return self.episodes.run(requests, self.fleet.generate)

    def submit(self, requests: list[GenerationRequest]) -> None:
        future = self._pool.submit(self._episodes, requests)
        future.add_done_callback(lambda _: self._notify())
        with self._lock:
            self._futures.append(future)

    def _notify(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def drain(self, wait_s: float) -> list[Sample]:
        """Episodes of the batches finished so far; a batch that failed raises its error here."""
        with self._lock:
            self._lock.wait_for(lambda: any(f.done() for f in self._futures), timeout=wait_s)
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        return [s for f in done for s in f.result()]

    def repair(self) -> None:
        self.repairs.repair()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
