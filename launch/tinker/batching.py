"""Sample calls that arrive together go to the rollout fleet as one batch.

A client such as the cookbook's RL loop sends each rollout as its own sample call, dozens at once;
one fleet call each would run them one after another, a batch of one each. `SampleBatcher` takes
what is waiting (after a short `window_s` for the rest of a burst to arrive) into one
`fleet.generate`, which vLLM runs as one batch, and hands each call its own samples.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from typing import Callable

from rl.data.types import GenerationRequest, Sample


class SampleBatcher:
    def __init__(self, generate: Callable[[list[GenerationRequest]], list[Sample]], window_s: float = 0.02,
                 max_requests: int = 512):
        self._generate, self.window_s, self.max_requests = generate, window_s, max_requests
        self._waiting: list[tuple[list[GenerationRequest], Future]] = []
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._run, name="tinker-sampler", daemon=True).start()

    def __call__(self, requests: list[GenerationRequest], timeout_s: float) -> list[Sample]:
        """The samples of `requests`, generated with whatever else is waiting."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the service is shutting down")
            self._waiting.append((list(requests), future))
            self._cond.notify()
        return future.result(timeout_s)

    def _take(self) -> list[tuple[list[GenerationRequest], Future]]:
        with self._cond:  # (woken by a call or by close; the timeout only re-checks)
            self._cond.wait_for(lambda: self._waiting or self._closed, timeout=1.0)
            if self._closed or not self._waiting:
                return []
        time.sleep(self.window_s)  # the rest of a burst
        with self._cond:
            taken, count = [], 0
            while self._waiting and (not taken or count + len(self._waiting[0][0]) <= self.max_requests):
                item = self._waiting.pop(0)
                taken.append(item)
                count += len(item[0])
            return taken

    def _run(self) -> None:
        while not self._closed:
            taken = [(reqs, f) for reqs, f in self._take() if f.set_running_or_notify_cancel()]
            if not taken:
                continue
            # one group per call (the fleet keeps a group on one worker and orders by group, index)
            batch = [dataclasses.replace(r, group_id=g) for g, (reqs, _) in enumerate(taken) for r in reqs]
            try:
                samples = self._generate(batch)
            except BaseException as err:  # noqa: BLE001 - every call of the batch gets the failure
                for _, future in taken:
                    future.set_exception(err)
                continue
            start = 0
            for reqs, future in taken:
                future.set_result(samples[start:start + len(reqs)])
                start += len(reqs)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for _, future in waiting:
            future.cancel()
