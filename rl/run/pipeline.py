"""Asynchronous rollouts: the batches of the next steps are generated (and scored) in a background
thread while the learner trains on this one (DESIGN.md "Asynchronous steps").

Batch `s` is submitted when step `s - depth` starts, so it is generated from weights at most
`depth` versions older than the learner that trains on it. Weight syncs happen between batches,
never inside one: `between_batches()` waits for the batch being generated and holds the next.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RolloutPipeline(Generic[T]):
    def __init__(self, produce: Callable[[int], T], depth: int, end: int, done: dict[int, T] | None = None):
        """`produce(step)` makes step's batch; steps up to `end` (exclusive) are made. `done`:
        batches already made (from a checkpoint), used instead of making them again."""
        self._produce, self.depth, self.end = produce, depth, end
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self._futures: dict[int, Future] = {}
        for step, result in (done or {}).items():
            future: Future = Future()
            future.set_result(result)
            self._futures[step] = future
        self._cond = threading.Condition()
        self._busy = self._hold = False

    def _run(self, step: int) -> T:
        with self._cond:
            self._cond.wait_for(lambda: not self._hold)
            self._busy = True
        try:
            return self._produce(step)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def take(self, step: int) -> T:
        """Step's batch (waiting for it), after submitting the batches up to `step + depth`."""
        for s in range(step, min(step + self.depth, self.end - 1) + 1):
            if s not in self._futures:
                self._futures[s] = self._pool.submit(self._run, s)
        return self._futures.pop(step).result()

    @contextmanager
    def between_batches(self) -> Iterator[None]:
        """Hold generation at a batch boundary for the duration (a weight sync)."""
        with self._cond:
            self._hold = True
            self._cond.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self._cond:
                self._hold = False
                self._cond.notify_all()

    def in_flight(self) -> dict[int, T]:
        """Every submitted batch, waiting for those still being made (a checkpoint records them,
        so that a resumed run neither loses nor repeats a prompt); they stay queued for `take`."""
        return {s: f.result() for s, f in sorted(self._futures.items())}

    def close(self) -> None:
        """Drop the batches not started; one being made finishes on its own (a run that ends
        normally has none: nothing is submitted past `end`)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
