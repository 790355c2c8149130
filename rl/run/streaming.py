"""Streaming rollouts (`rollout.mode=streaming`, DESIGN.md "Asynchronous steps"): prompts flow
through the fleet continuously and finished groups queue up for the learner, which never waits for
the slowest sample of a batch.

A background thread draws prompts as the staleness bound allows (AReaL's rule): while the learner
is at version v, at most (v + k + 1) x prompts_per_step groups have been started, k =
`algorithm.off_policy_steps`; groups dropped by dynamic sampling make room for more. Groups are
scored as they finish. Weight syncs happen while
requests are in flight (the engines pause with them kept), so a sample may span several policy
versions; it is dated by its oldest token, and a group whose oldest token is more than k versions
behind the learner is never trained on: its prompt is generated again. A checkpoint records the
groups in flight and those waiting, so a resumed run neither loses nor repeats a prompt.

Has the same face as `rl.run.pipeline.RolloutPipeline` (`take`, `between_batches`, `in_flight`,
`close`), so the loop drives either.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rl.data.types import GenerationRequest, Sample, ScoredSample


class StreamingFleet(Protocol):
    def submit(self, requests: list[GenerationRequest]) -> None: ...
    def drain(self, wait_s: float) -> list[Sample]: ...
    def repair(self) -> None: ...


@dataclass
class ReadyGroup:
    """A finished, scored group waiting for the learner."""

    requests: list[GenerationRequest]
    scored: list[ScoredSample]
    oldest: int  # the policy version of its oldest token
    informative: bool = True  # DAPO's dynamic sampling: False when every reward is equal


def oldest_version(samples: list[Sample]) -> int:
    return min(s.oldest_version() for s in samples)


def staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """Per token (each model token's version behind the learner) and per sample (versions spanned)."""
    behind: list[int] = []
    spans: list[int] = []
    for s in samples:
        versions = s.token_versions or [s.policy_version] * len(s.completion_ids)
        mask = s.completion_mask or [1] * len(versions)
        behind += [version - v for v, m in zip(versions, mask) if m]
        spans.append(len(set(versions)) if versions else 1)
    return {"policy/token_staleness_mean": statistics.fmean(behind) if behind else 0.0,
            "policy/token_staleness_max": float(max(behind, default=0)),
            "policy/versions_per_sample_mean": statistics.fmean(spans),
            "policy/spanning_samples_frac": sum(n > 1 for n in spans) / len(spans)}


class StreamingRollouts:
    def __init__(self, fleet: StreamingFleet, draw: Callable[[int], list[GenerationRequest]],
                 score: Callable[[list[Sample]], list[ScoredSample]], *, groups_per_step: int, max_staleness: int, start_step: int, end: int,
                 informative: Callable[[list[ScoredSample]], bool] | None = None,
                 max_rounds: int = 1, state: dict[str, Any] | None = None, poll_s: float = 0.1):
        """`draw(b)`: the requests of prompt batch b (`groups_per_step` groups, group ids unique
        across batches); `score`: rewards of finished samples; `end`: the run's last step
        (nothing is drawn for after it); `informative`: DAPO's filter, with at most `max_rounds` x
        `groups_per_step` groups looked at per step before uninformative ones fill the batch;
        `state`: what `in_flight()` returned at a checkpoint."""
        self.fleet, self._draw, self._score = fleet, draw, score
        self.P, self.k, self.end = groups_per_step, max_staleness, end
        self._informative, self._max_rounds, self._poll_s = informative, max_rounds, poll_s
        state = state or {}
        self._cursor: int = state.get("cursor", start_step)  # the next prompt batch to draw
        self._budget = (start_step + self.k + 1) * self.P  # groups that may have been started by now
        self._started = self._cursor * self.P
        self._groups: dict[int, list[GenerationRequest]] = {}  # admitted, not yet taken: by group id
        self._ready: list[ReadyGroup] = list(state.get("ready", []))
        self._partial: dict[int, list[Sample]] = {}
        self._resend: list[GenerationRequest] = []
        self._stale = 0  # groups dropped as too old (and sent again) since the last take
        self._looked = 0  # groups finished since the last take (dynamic sampling's budget)
        self._last_take = time.perf_counter()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        for g in self._ready:
            self._groups[g.requests[0].group_id] = g.requests
        pending = state.get("pending", [])
        for req in pending:
            self._groups.setdefault(req.group_id, []).append(req)
        self._resend += pending
        self._thread = threading.Thread(target=self._run, name="streaming-rollouts", daemon=True)
        self._thread.start()

    # --- the background thread: admit, drain, score ---

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                finished = self.fleet.drain(self._poll_s)
                if finished:
                    self._collect(finished)
        except BaseException as exc:  # surfaces in `take`, on the driver's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _admit(self) -> None:
        """Start the prompt batches the staleness bound allows; send groups dropped as stale again."""
        with self._cond:
            sends, self._resend = self._resend, []
            while self._started + self.P <= self._budget and self._cursor < self.end:
                batch = self._draw(self._cursor)
                self._cursor += 1
                self._started += self.P
                for req in batch:
                    self._groups.setdefault(req.group_id, []).append(req)
                sends += batch
        if sends:
            self.fleet.submit(sends)

    def _collect(self, finished: list[Sample]) -> None:
        complete: list[int] = []
        with self._cond:
            ready = {g.requests[0].group_id for g in self._ready}
            sizes = {gid: len(reqs) for gid, reqs in self._groups.items() if gid not in ready}
        for s in finished:
            if s.group_id not in sizes:
                continue  # taken or dropped already, or a duplicate of a request sent again
            members = self._partial.setdefault(s.group_id, [])
            if all(m.sample_index != s.sample_index for m in members):
                members.append(s)
            if len(members) == sizes[s.group_id]:
                complete.append(s.group_id)
                del sizes[s.group_id]
        if not complete:
            return
        samples = [s for gid in complete for s in sorted(self._partial.pop(gid), key=lambda m: m.sample_index)]
        scored = self._score(samples)
        by_group: dict[int, list[ScoredSample]] = {}
        for s in scored:
            by_group.setdefault(s.sample.group_id, []).append(s)
        with self._cond:
            for gid, members in by_group.items():
                self._ready.append(ReadyGroup(self._groups[gid], members, oldest_version([m.sample for m in members]),
                                              self._informative(members) if self._informative else True))
            self._looked += len(by_group)
            self._cond.notify_all()

    # --- the driver's side ---

    def take(self, step: int) -> tuple[list[ScoredSample], list[Sample], dict[str, float]]:
        """Step's groups (the learner trains at version `step`): the `groups_per_step` finished
        groups with the oldest tokens that are at most k versions behind (informative ones first
        under dynamic sampling), as soon as there are that many."""
        with self._cond:
            self._budget = max(self._budget, (step + self.k + 1) * self.P)  # the learner is at `step` now
        while True:
            self.fleet.repair()  # replaced workers, on this thread (which also runs the weight syncs)
            with self._cond:
                if self._error is not None:
                    raise self._error
                for g in [g for g in self._ready if g.oldest < step - self.k]:
                    self._ready.remove(g)
                    self._resend += g.requests
                    self._stale += 1
                chosen = self._choose()
                if chosen is None:
                    self._cond.wait(0.2)
                    continue
                for g in chosen:
                    self._ready.remove(g)
                    del self._groups[g.requests[0].group_id]
                ready_left, stale, self._stale, self._looked = len(self._ready), self._stale, 0, 0
                in_flight = len(self._groups) - ready_left
                break
        window, self._last_take = time.perf_counter() - self._last_take, time.perf_counter()
        scored = [s for g in chosen for s in g.scored]
        samples = [s.sample for s in scored]
        metrics = {"time/rollout_s": window, "time/reward_s": 0.0,
                   "stream/ready_groups_count": float(ready_left), "stream/in_flight_groups_count": float(in_flight),
                   "stream/stale_groups_count": float(stale), **staleness_metrics(samples, step)}
        if self._informative is not None:
            metrics["dapo/informative_groups"] = float(sum(g.informative for g in chosen))
            metrics["dapo/filled_groups"] = float(sum(not g.informative for g in chosen))
        return scored, samples, metrics

    def _choose(self) -> list[ReadyGroup] | None:
        """The groups for a step, or None while too few are ready. Under dynamic sampling,
        uninformative groups fill the step only once `max_rounds` steps' worth of groups have
        finished since the last take without enough informative ones; the surplus is dropped."""
        ready = sorted(self._ready, key=lambda g: g.oldest)
        if self._informative is None:
            return ready[: self.P] if len(ready) >= self.P else None
        good = [g for g in ready if g.informative]
        flat = [g for g in ready if not g.informative]
        if len(good) >= self.P:
            return good[: self.P]
        if self._looked >= self._max_rounds * self.P and len(ready) >= self.P:
            return good + flat[: self.P - len(good)]
        for g in flat[: max(0, len(flat) - (self.P - len(good)))]:  # more than could be needed
            self._ready.remove(g)
            del self._groups[g.requests[0].group_id]
            self._budget += 1  # room for another prompt
        return None

    def between_batches(self):
        """Weight syncs need no batch boundary here: the engines pause with their requests kept."""
        return nullcontext()

    def in_flight(self) -> dict[str, Any]:
        """What a checkpoint keeps: the next batch to draw, the groups finished and scored, and the
        requests of every group admitted and unfinished (sent again, whole, on resume)."""
        with self._cond:
            ready = {g.requests[0].group_id for g in self._ready}
            pending = [r for gid, reqs in self._groups.items() if gid not in ready for r in reqs]
            return {"streaming": {"cursor": self._cursor, "ready": list(self._ready), "pending": pending}}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
