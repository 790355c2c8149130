"""The service's asynchronous calls as the Tinker protocol has them: each submission gets a
request id at once and runs in the background; `retrieve_future` long-polls it.

A training model's calls carry a `seq_id` (1, 2, ...) and must run in that order whatever order
they arrive in (the SDK sends the first chunk of a split forward_backward last), so each model has
a `SeqGate`: a call waits, with a deadline, for the calls numbered before it. Every wait here has
one: a call still unfinished after `op_timeout_s` fails, a result nobody fetches is dropped after
`keep_s`.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class UserError(ValueError):
    """A request this service refuses for what it asks (bad ids, shapes, values): the SDK shows
    it as a RequestFailedError of category "user" (in a future) or a 4xx (at submission)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class SeqGate:
    """Runs a training model's calls in `seq_id` order: `turn(seq_id)` waits until every lower id
    has run (or failed, or was refused at submission: `skip`), `done(seq_id)` lets the next one in.
    A repeated id is refused. `close()` (the service stopping) ends every wait at once."""

    def __init__(self, wait_s: float):
        self.wait_s, self.next, self.seen, self.finished = wait_s, 1, set(), set()
        self.closed = False
        self._cond = threading.Condition()

    def claim(self, seq_id: int) -> None:
        """Reserve `seq_id` at submission: ids start at 1 and each is used once."""
        with self._cond:
            if seq_id < 1:
                raise UserError(f"seq_id={seq_id}: a training model's calls are numbered from 1")
            if seq_id in self.seen or seq_id < self.next:
                raise UserError(f"seq_id={seq_id} was already used on this model (calls are numbered 1, 2, ...)",
                                status=409)
            self.seen.add(seq_id)

    def skip(self, seq_id: int) -> None:
        """A call refused at submission (or not served at all) still takes its number: the calls
        after it go on. A number another call already holds is left to that call."""
        if not isinstance(seq_id, int) or isinstance(seq_id, bool):
            return
        try:
            self.claim(seq_id)
        except UserError:
            return
        self.done(seq_id)

    def turn(self, seq_id: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.closed or self.next == seq_id, timeout=self.wait_s):
                raise UserError(f"seq_id={seq_id} waited {self.wait_s:.0f} s (serve.seq_wait_s) for seq_id="
                                f"{self.next}, which never came: calls of a model must be numbered without gaps")
            if self.closed:
                raise self.why

    def close(self, why: BaseException | None = None) -> None:
        """End every wait, now and later, with `why` (default: the service is stopping)."""
        with self._cond:
            self.closed = True
            self.why = why or RuntimeError("the service is stopping")
            self._cond.notify_all()

    def done(self, seq_id: int) -> None:
        with self._cond:
            self.finished.add(seq_id)
            while self.next in self.finished:
                self.finished.discard(self.next)
                self.next += 1
            self._cond.notify_all()


class Futures:
    """Request id -> the background call's Future, on a thread pool."""

    def __init__(self, op_timeout_s: float, workers: int = 64, keep_s: float = 3600.0):
        self.op_timeout_s, self.keep_s = op_timeout_s, keep_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinker-call")
        self._futures: dict[str, tuple[Future, float, str]] = {}  # id -> (future, submitted at, owner session)
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def submit(self, session_id: str, fn: Callable[[], Any]) -> str:
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(8)}"
        future = self._pool.submit(fn)
        with self._lock:
            now = time.monotonic()
            self._futures = {k: v for k, v in self._futures.items() if not (v[0].done() and now - v[1] > self.keep_s)}
            self._futures[request_id] = (future, now, session_id)
        return request_id

    def get(self, request_id: str) -> tuple[Future, float, str]:
        with self._lock:
            if request_id not in self._futures:
                raise UserError(f"no request {request_id!r} here (never made, or its result expired)", status=404)
            return self._futures[request_id]

    def left_s(self, request_id: str) -> float:
        """Seconds the call may still run before `op_timeout_s` ends it."""
        _, submitted, _ = self.get(request_id)
        return self.op_timeout_s - (time.monotonic() - submitted)

    def give_up(self, request_id: str, why: BaseException | None = None) -> Future:
        """The call ran past `op_timeout_s` (or `why`): its result is now that failure (its thread
        may go on, but nothing waits for it)."""
        future, submitted, owner = self.get(request_id)
        future.cancel()
        failed: Future = Future()
        failed.set_exception(why or TimeoutError(f"the call did not finish in {self.op_timeout_s:.0f} s "
                                                 "(serve.op_timeout_s)"))
        with self._lock:
            self._futures[request_id] = (failed, submitted, owner)
        return failed

    def cancel(self, request_id: str) -> None:
        """The client gave the call up: a call not finished yet fails as cancelled (one running goes on
        in its thread; its result is dropped)."""
        if not self.get(request_id)[0].done():
            self.give_up(request_id, UserError("the call was cancelled by the client"))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
