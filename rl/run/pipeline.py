"""Asynchronous rollouts: the batches of the next steps are generated (and scored) in a background
thread while the learner trains on this one (docs/architecture.md "Rollouts").

Batch `s` is submitted when step `s - depth` starts, so it is generated from weights at most
`depth` versions older than the learner that trains on it. Weight syncs happen between batches,
never inside one: `between_batches()` waits for the batch being generated and holds the next.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RolloutPipeline(Generic[T]):
    def __init__(self, produce: Callable[[int], T], depth: int, end: int, done: dict[int, T] | None = None,
                 repair: Callable[[], None] = lambda: None, poll_s: float = 0.2):
        """`produce(step)` makes step's batch; steps up to `end` (exclusive) are made. `done`:
        batches already made (from a checkpoint), used instead of making them again. `repair`:
        the source's, called while the driver waits (a worker replaced here, on the thread that
        runs the weight syncs, never beside one)."""
        self._produce, self.depth, self.end, self._repair, self._poll_s = produce, depth, end, repair, poll_s
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
        future = self._futures.pop(step)
        while not future.done():  # the batch's own calls keep the deadlines: this wait ends with them
            self._repair()
            futures_wait([future], timeout=self._poll_s)
        return future.result()

    @contextmanager
    def between_batches(self) -> Iterator[None]:
        """Hold generation at a batch boundary for the duration (a weight sync)."""
        with self._cond:
            self._hold = True
        while True:
            self._repair()
            with self._cond:
                if self._cond.wait_for(lambda: not self._busy, timeout=self._poll_s):
                    break
        try:
            yield
        finally:
            with self._cond:
                self._hold = False
                self._cond.notify_all()

    def in_flight(self, whole: bool = True) -> dict[int, T]:
        """Every submitted batch, waiting for those still being made (a checkpoint records them,
        so that a resumed run neither loses nor repeats a prompt); they stay queued for `take`.
        The fleet broken (`whole=False`): none, they are made again on resume."""
        return {s: f.result() for s, f in sorted(self._futures.items())} if whole else {}

    def close(self) -> None:
        """Drop the batches not started; one being made finishes on its own (a run that ends
        normally has none: nothing is submitted past `end`)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
