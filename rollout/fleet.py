"""`RolloutFleet`: spreads a batch of generation requests over `RolloutWorker` actors, and keeps
the fleet whole: a worker that dies or stops answering is replaced by a new one, which rejoins
the weight-sync group and loads the current weights (`on_replace`), and its unfinished requests
are sent again (each request carries its own seed, so a retried request samples the same
tokens). Replacements are bounded by `rollout.max_restarts` per run, retries by `max_retries`."""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rl.run.faults import ActorFailure, Deadlines, first_line, hung
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


class RolloutFleet:
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
        if env_vars:
            base["runtime_env"] = {"env_vars": env_vars}
        n = spec.rollout.num_workers
        self.spec, self.deadlines, self.log = spec, deadlines or Deadlines(), log
        self._options = [{**base, **(actor_options[i] if actor_options else {})} for i in range(n)]
        self._remote = ray.remote(RolloutWorker)
        self.version = 0  # the policy version every worker holds (set by the learner's sync)
        self.restarts = 0
        # Set by the learner when it connects: rejoin the weight-sync group and load the weights.
        self.on_replace: Callable[[], None] | None = None
        self.workers = [self._start(i) for i in range(n)]
        self.where: list[dict[str, Any]] = [{} for _ in range(n)]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for every worker's engine to be up (start-up errors surface here)."""
        self._started(range(len(self.workers)))

    def _start(self, i: int):
        return self._remote.options(**self._options[i]).remote(self.spec, i)

    def _started(self, indices) -> None:
        """Wait for the workers to be up (surfacing start-up errors here) and note where they run."""
        refs = {i: self.workers[i].where.remote() for i in indices}
        try:
            for i, ref in refs.items():
                self.where[i] = ray.get(ref, timeout=self.deadlines.start_s)
        except GetTimeoutError:
            raise ActorFailure("rollout worker", "start-up", f"not up after {self.deadlines.start_s:.0f} s "
                               "(run.start_timeout_s); is there a free CPU/GPU for it?") from None

    def name(self, i: int) -> str:
        pid = self.where[i].get("pid")
        return f"rollout worker {i}" + (f" (pid {pid})" if pid else "")

    def wait(self, refs: dict[int, Any], kind: str,
             errors: dict[int, str] | None = None) -> tuple[dict[int, Any], dict[int, str]]:
        """Results of calls on workers (by index) that finish within the deadline of `kind`, and
        why the others failed (the process died, or it did not answer in time). `errors` given:
        a call that raised inside a live worker is noted there (else its error propagates)."""
        if not refs:
            return {}, {}
        deadline, started = self.deadlines.of(kind), time.monotonic()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=deadline)
        finished = set(ready)
        results: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for i, ref in refs.items():
            if ref not in finished:
                failed[i] = hung(deadline)
                continue
            try:
                results[i] = ray.get(ref)
            except RayActorError as exc:
                failed[i] = f"its process died ({first_line(exc)})"
            except RayTaskError as exc:
                if errors is None:
                    raise
                errors[i] = first_line(exc)
        if not failed:
            self.deadlines.record(kind, time.monotonic() - started)
        return results, failed

    def replace(self, failed: dict[int, str], phase: str) -> None:
        """Kill the failed workers and start new ones in their place (same seed, same bundle)."""
        limit = self.spec.rollout.max_restarts
        for i, why in failed.items():
            self.restarts += 1
            if self.restarts > limit:
                raise ActorFailure(self.name(i), phase, f"{why}; all rollout.max_restarts={limit} replacements used")
            self.log(f"WARNING: {self.name(i)} failed during {phase}: {why}; replacing it "
                     f"(replacement {self.restarts} of rollout.max_restarts={limit})")
            ray.kill(self.workers[i], no_restart=True)
            self.workers[i] = self._start(i)
        self._started(failed)
        self.log(f"Replaced: {', '.join(self.name(i) for i in failed)} up")

    def _on_all(self, calls: dict[int, Callable[[], Any]], phase: str) -> dict[int, Any]:
        """Run one call per worker; failed workers are replaced (and brought up to date) and
        their calls sent again, at most `rollout.max_retries` times."""
        results: dict[int, Any] = {}
        for attempt in range(self.spec.rollout.max_retries + 1):
            done, failed = self.wait({i: call() for i, call in calls.items()}, phase)
            results.update(done)
            if not failed:
                return results
            if attempt == self.spec.rollout.max_retries:
                i, why = next(iter(failed.items()))
                raise ActorFailure(self.name(i), phase, f"{why}; its requests were tried "
                                   f"{attempt + 1} times (rollout.max_retries={attempt})")
            self.replace(failed, phase)
            if self.on_replace is not None:
                self.on_replace()
            calls = {i: calls[i] for i in failed}
        return results

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        chunks = split_by_group(requests, len(self.workers))
        calls = {i: (lambda i=i, c=c: self.workers[i].generate.remote(c)) for i, c in enumerate(chunks) if c}
        samples = [s for part in self._on_all(calls, "generate").values() for s in part]
        order = {(r.group_id, r.sample_index): i for i, r in enumerate(requests)}
        return sorted(samples, key=lambda s: order[(s.group_id, s.sample_index)])

    def sleep(self, level: int | None = None) -> None:
        self._on_all({i: (lambda i=i: self.workers[i].sleep.remote(level)) for i in range(len(self.workers))},
                     "sleep")

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        self._on_all({i: (lambda i=i: self.workers[i].wake.remote(tags)) for i in range(len(self.workers))}, "wake")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
