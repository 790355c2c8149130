"""`RolloutFleet`: spreads generation requests over `RolloutWorker` actors, as batches (`generate`,
`generate_one`) or as a stream (`submit`/`drain`), and keeps the fleet whole.

One fault regime for every call: a worker that dies, stops answering or raises is noted broken
(`_fail`) and gets no more requests; `repair` replaces it with a new one and returns which, and
its unfinished requests are sent again (each request carries its own seed, so a retried request
samples the same tokens). The fleet never repairs itself: the driver's `Cluster` (launch/cluster.py)
calls `repair` and brings the replaced workers up to date through the weight sync before it calls
`synced()` (the Tinker service's Cluster has a sync that moves nothing: its workers load the base
weights and take adapters per request). Until then a replaced worker takes no
requests, and a call that lost its worker waits (with a deadline) for its replacement.
Replacements are bounded by `rollout.max_restarts` per run, retries of a call by `max_retries`.
A request the engine refuses is not a fault: it comes back as a sample with its `error`."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

import ray

from rl.actors.group import ActorGroup, HoldsActorGroup
from rl.actors.faults import ActorFailure, Deadlines
from rl.data.types import GenerationRequest, Sample
from rollout.protocol import RolloutSpec
from rollout.worker import RolloutWorker


def split_by_group(requests: list[GenerationRequest], parts: int) -> list[list[GenerationRequest]]:
    """Contiguous chunks of whole groups (a prompt's n samples stay together for prefix caching),
    balanced by request count."""
    groups: dict[int, list[GenerationRequest]] = {}
    for r in requests:
        groups.setdefault(r.group_id, []).append(r)
    chunks: list[list[GenerationRequest]] = [[] for _ in range(parts)]
    per_part = -(-len(requests) // parts)
    part = 0
    for members in groups.values():
        if len(chunks[part]) >= per_part and part < parts - 1:
            part += 1
        chunks[part].extend(members)
    return chunks


class RolloutFleet(HoldsActorGroup):
    def __init__(
        self,
        spec: RolloutSpec,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
        actor_options: list[dict[str, Any]] | None = None,
        deadlines: Deadlines | None = None,
        log: Callable[[str], None] = print,
        wait: bool = True,
    ):
        """`spec.rollout.num_workers` RolloutWorker actors, worker i seeded with run.seed + i;
        `actor_options[i]` adds Ray options for worker i (its placement-group bundle). `wait=False`
        returns while the engines start, so the caller can start the learner meanwhile; call
        `wait_started()` before using the fleet."""
        base: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if spec.concurrent:  # a weight sync runs while drains and agents' calls wait
            base["max_concurrency"] = 64
        if env_vars:
            base["runtime_env"] = {"env_vars": env_vars}
        n = spec.rollout.num_workers
        self.spec, self.deadlines, self.log = spec, deadlines or Deadlines(), log
        self.group = ActorGroup(ray, RolloutWorker, n, role="rollout worker", args=lambda i: (spec, i),
                                options=base, per_actor=actor_options, deadlines=self.deadlines)
        self.restarts = 0
        # Streaming (`submit`/`drain`): each worker's requests in flight by (group, sample), with the
        # time they were sent; requests of replaced workers waiting to be sent again; workers that
        # failed during a drain (with their handle then) and replaced workers without the weights yet.
        self._lock = threading.RLock()
        self._outstanding: list[dict[tuple[int, int], tuple[GenerationRequest, float]]] = [{} for _ in range(n)]
        self._lost: list[GenerationRequest] = []
        self._broken: dict[int, tuple[Any, str, str]] = {}  # worker -> (its handle then, why, during what)
        self._unsynced: set[int] = set()
        self._turn = itertools.count()
        self._repaired = threading.Condition(self._lock)
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for every worker's engine to be up (start-up errors surface here)."""
        self.group.started()

    def wait(self, refs: dict[int, Any], kind: str,
             errors: dict[int, str] | None = None) -> tuple[dict[int, Any], dict[int, str]]:
        """Results of calls on workers (by index) that finish within the deadline of `kind`, and
        why the others failed (the process died, or it did not answer in time). `errors` given:
        a call that raised inside a live worker is noted there (else its error propagates)."""
        out = self.group.gather(refs, kind, propagate_raised=errors is None)
        if errors is not None:
            errors.update(out.raised)
        return out.results, out.failed

    def replace(self, failed: dict[int, str], phase: str) -> None:
        """Kill the failed workers and start new ones in their place (same seed, same bundle);
        they take no requests until `synced()`."""
        limit = self.spec.rollout.max_restarts
        for i, why in failed.items():
            self.restarts += 1
            if self.restarts > limit:
                raise ActorFailure(self.name(i), phase, f"{why}; all rollout.max_restarts={limit} replacements used")
            self.log(f"WARNING: {self.name(i)} failed during {phase}: {why}; replacing it "
                     f"(replacement {self.restarts} of rollout.max_restarts={limit})")
            with self._lock:
                self.group.restart(i)
                self._lost += [req for req, _ in self._outstanding[i].values()]  # streaming: sent again
                self._outstanding[i] = {}
                self._broken.pop(i, None)
                self._unsynced.add(i)
        self.group.started(list(failed))
        self.log(f"Replaced: {', '.join(self.name(i) for i in failed)} up")

    def synced(self) -> None:
        """Every worker holds the current weights (the weight sync says so after a sync): the
        replaced ones take requests again, and the calls waiting for them go on."""
        with self._repaired:
            self._unsynced.clear()
            self._repaired.notify_all()

    def _fail(self, i: int, handle: Any, why: str, phase: str) -> None:
        """Note worker `i` (as `handle`, unless replaced since) broken during `phase`: `repair`
        replaces it."""
        with self._lock:
            if self.workers[i] is handle:
                self._broken[i] = (handle, why, phase)

    def _able(self) -> list[int]:
        """Workers that may take requests: not broken, holding the current weights (under the lock)."""
        return [i for i in range(len(self.workers)) if i not in self._broken and i not in self._unsynced]

    def _await_repair(self, failed: dict[int, Any]) -> None:
        """Wait until the failed workers are replaced and up to date (by the `Cluster`, which
        polls for broken workers on the driver's thread), at most the start-up deadline plus a
        call's (the driver may be mid-update)."""
        wait_s = self.deadlines.start_s + self.deadlines.floor_s
        with self._repaired:
            ok = self._repaired.wait_for(lambda: all(self.workers[i] is not h and i not in self._unsynced
                                                     for i, h in failed.items()), timeout=wait_s)
        if not ok:
            i = next(iter(failed))
            raise ActorFailure(self.name(i), "generation", f"not replaced within {wait_s:.0f} s of failing "
                               "(run.start_timeout_s + run.call_timeout_s)")

    def _on_all(self, calls: dict[int, Callable[[Any], Any]], phase: str) -> dict[int, Any]:
        """Run one call per worker (`calls[i](handle)`); failed workers are noted broken, repaired
        and their calls sent again, at most `rollout.max_retries` times."""
        results: dict[int, Any] = {}
        for attempt in range(self.spec.rollout.max_retries + 1):
            with self._lock:
                handles = {i: self.workers[i] for i in calls}
            done, failed = self.wait({i: call(handles[i]) for i, call in calls.items()}, phase)
            results.update(done)
            if not failed:
                return results
            for i, why in failed.items():
                self._fail(i, handles[i], why, phase)
            if attempt == self.spec.rollout.max_retries:
                i, why = next(iter(failed.items()))
                raise ActorFailure(self.name(i), phase, f"{why}; its requests were tried "
                                   f"{attempt + 1} times (rollout.max_retries={attempt})")
            self._await_repair({i: handles[i] for i in failed})
            calls = {i: calls[i] for i in failed}
        return results

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        chunks = split_by_group(requests, len(self.workers))
        calls = {i: (lambda w, c=c: w.generate.remote(c)) for i, c in enumerate(chunks) if c}
        samples = [s for part in self._on_all(calls, "generate").values() for s in part]
        order = {(r.group_id, r.sample_index): i for i, r in enumerate(requests)}
        return sorted(samples, key=lambda s: order[(s.group_id, s.sample_index)])

    # --- streaming (`rollout.mode=streaming`): requests flow continuously, samples are drained ---

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Send each group's requests to the worker with the fewest in flight (a group stays on one
        worker, for prefix caching). Workers that failed or lack the current weights get none; with
        no worker able to take them, the requests wait for `drain` to send them."""
        with self._lock:
            able = self._able()
            if not able:
                self._lost += requests
                return
            groups: dict[int, list[GenerationRequest]] = {}
            for r in requests:
                groups.setdefault(r.group_id, []).append(r)
            now = time.monotonic()
            for members in groups.values():
                i = min(able, key=lambda j: len(self._outstanding[j]))
                self._outstanding[i].update({(r.group_id, r.sample_index): (r, now) for r in members})
                self.workers[i].submit.remote(members)  # a dead worker surfaces at the next drain

    def generate_one(self, request: GenerationRequest) -> Sample:
        """One request on the next worker in turn that holds the current weights (an agent's call:
        many threads call at once). A worker that fails is replaced by the driver's Cluster and the
        request sent again, as any blocking call's; a request the engine refuses comes back with
        its `error`."""
        with self._repaired:  # (the fleet's lock)
            if not self._able():
                self._repaired.wait_for(self._able, timeout=self.deadlines.start_s + self.deadlines.floor_s)
            choice = self._able() or [next(self._turn) % len(self.workers)]  # (none: the call fails and waits)
            i = choice[next(self._turn) % len(choice)]
        return self._on_all({i: lambda w: w.generate.remote([request])}, "generate")[i][0]

    def drain(self, wait_s: float) -> list[Sample]:
        """The samples finished on every worker since the last drain (waiting up to `wait_s`).

        A worker that dies, stops answering, raises, or holds a request past its deadline is noted
        as broken and gets no more requests; `repair` (called by the driver's main thread, which
        also runs the weight syncs) replaces it and sends its requests again. An engine left paused
        longer than `rollout.pause_timeout_s` is named and resumed."""
        with self._lock:
            if self._lost:
                lost, self._lost = self._lost, []
                self.submit(lost)
            handles = {i: self.workers[i] for i in range(len(self.workers))
                       if self._outstanding[i] and i not in self._broken}
        if not handles:
            time.sleep(wait_s)
            return []
        errors: dict[int, str] = {}
        results, failed = self.wait({i: w.drain.remote(wait_s) for i, w in handles.items()}, "drain", errors)
        samples: list[Sample] = []
        now = time.monotonic()
        request_deadline = self.deadlines.of("request")
        for i, why in {**failed, **errors}.items():
            self._fail(i, handles[i], why, "streaming generation")
        with self._lock:
            for i, out in results.items():
                if self.workers[i] is not handles[i]:
                    continue  # replaced meanwhile: its requests were sent again
                for s in out["samples"]:
                    _, sent = self._outstanding[i].pop((s.group_id, s.sample_index), (None, now))
                    self.deadlines.record("request", now - sent)
                    samples.append(s)
                oldest = min((sent for _, sent in self._outstanding[i].values()), default=now)
                if now - oldest > request_deadline:
                    self._fail(i, handles[i], f"a request of it has run {now - oldest:.0f} s without finishing (the "
                               f"deadline: {request_deadline:.0f} s, run.call_timeout_s or run.call_timeout_factor x "
                               "the slowest request so far)", "streaming generation")
                if out["paused_s"] > self.spec.rollout.pause_timeout_s:
                    self.log(f"WARNING: {self.name(i)} has been left paused for {out['paused_s']:.0f} s (over "
                             f"rollout.pause_timeout_s={self.spec.rollout.pause_timeout_s:g}; a weight sync that "
                             "never finished?): resuming it")
                    handles[i].resume.remote()
        return samples

    def repair(self) -> list[int]:
        """Replace the workers noted broken (their requests are sent again) and return which were
        replaced: they take no requests until the weight sync has brought them up to date and
        `synced()` is called (the `Cluster` does both). A no-op returning [] when none is broken."""
        with self._lock:
            broken = {i: (why, phase) for i, (handle, why, phase) in self._broken.items()
                      if self.workers[i] is handle}
            self._broken.clear()
        for phase in sorted({phase for _, phase in broken.values()}):
            self.replace({i: why for i, (why, p) in broken.items() if p == phase}, phase)
        return sorted(broken)

    def sleep(self, level: int | None = None) -> None:
        self._on_all({i: (lambda w: w.sleep.remote(level)) for i in range(len(self.workers))}, "sleep")

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        self._on_all({i: (lambda w: w.wake.remote(tags)) for i in range(len(self.workers))}, "wake")

    def shutdown(self) -> None:
        self.group.shutdown()
