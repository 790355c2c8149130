"""Streaming rollouts (`rollout.mode=streaming`, docs/architecture.md "Rollouts"): prompts flow
through the fleet continuously and finished groups queue up for the learner, which never waits for
the slowest sample of a batch.

A background thread draws prompts as the staleness bound allows (AReaL's rule): while the learner
is at version v, at most (v + k + 1) x prompts_per_step groups have been started, k =
`algorithm.off_policy_steps`; a group that dynamic sampling sets aside (all its rewards equal;
the policy is rl/run/dynamic_sampling.py's, as in the batch modes) makes room for one more at once
(up to `max_sampling_rounds` steps' worth per step), so a step never waits on groups that cannot
count. Groups are scored as they finish. Weight syncs happen while requests are in flight (the
engines pause with them kept), so a sample may span several policy versions; it is dated by its
oldest token, and a group whose oldest token is more than k versions behind the learner is never
trained on: its prompt is generated again. A checkpoint records the groups in flight and those
waiting, so a resumed run neither loses nor repeats a prompt.

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
from rl.run.dynamic_sampling import DynamicSampling


class StreamingFleet(Protocol):
    def submit(self, requests: list[GenerationRequest]) -> None: ...
    def drain(self, wait_s: float) -> list[Sample]: ...
    def repair(self) -> None: ...


@dataclass(eq=False)  # found by identity in the queues
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


class StreamStalled(RuntimeError):
    """Nothing finished for longer than the stream's deadline: the run stops, naming what it waited for."""


class StreamingRollouts:
    def __init__(self, fleet: StreamingFleet, draw: Callable[[int], list[GenerationRequest]],
                 score: Callable[[list[Sample]], list[ScoredSample]], *, groups_per_step: int, max_staleness: int,
                 start_step: int, steps: int, sampling: DynamicSampling | None = None,
                 state: dict[str, Any] | None = None, poll_s: float = 0.1,
                 stall_s: float = 1800.0, stall_hint: str = "run.call_timeout_s"):
        """`draw(b)`: the requests of prompt batch b (`groups_per_step` groups, group ids unique
        across batches); `score`: rewards of finished samples; `steps`: the run's (nothing is drawn
        for a step after the last); `sampling`: DAPO's dynamic sampling (what to keep, when and how
        to fill a step with set-aside groups), or None (every group counts);
        `state`: what `in_flight()` returned at a checkpoint; `stall_s`: how long `take` waits with
        no sample finishing before it stops the run (`StreamStalled`, naming `stall_hint`)."""
        self.fleet, self._draw, self._score = fleet, draw, score
        self.P, self.k, self.steps = groups_per_step, max_staleness, steps
        self._sampling, self._poll_s = sampling, poll_s
        self._stall_s, self._stall_hint = stall_s, stall_hint
        state = state or {}
        self._cursor: int = state.get("cursor", start_step)  # the next prompt batch to draw
        self._version = start_step  # the learner's
        # Dynamic sampling: every uninformative group that finishes is set aside (a filler for a step
        # short of informative ones, `_spare`) and frees its place in the staleness budget at once
        # (`_credit`), so a step never waits on groups that cannot count; a set-aside group dropped
        # unused (too old, or more than a step could need) frees one more (`_dropped`); `_looked`
        # counts the groups finished since the last take (when a step may fill: `sampling.choose`).
        self._credit: int = state.get("credit", 0)
        self._dropped: int = state.get("dropped", 0)
        self._looked: int = state.get("looked", 0)
        self._spare: list[ReadyGroup] = list(state.get("spare", []))
        self._groups: dict[int, list[GenerationRequest]] = {}  # admitted, not yet taken: by group id
        self._ready: list[ReadyGroup] = list(state.get("ready", []))
        self._partial: dict[int, list[Sample]] = {}
        self._resend: list[GenerationRequest] = []
        self._stale = 0  # groups dropped as too old (and sent again) since the last take
        self._last_take = self._progress = time.monotonic()
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

    def _budget(self) -> int:
        """Groups that may have been started by now: k + 1 steps' worth ahead of the learner (none
        for a step after the run's last), plus one for every group dynamic sampling set aside, up to
        what the rounds allow (`sampling.refills`), plus one for every set-aside group dropped unused."""
        steps = min(self._version + self.k + 1, self.steps)
        refills = self._sampling.refills(self._credit, steps) if self._sampling is not None else 0
        return steps * self.P + refills + self._dropped

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
            while self._cursor * self.P < self._budget():  # a whole batch once a place is free
                batch = self._draw(self._cursor)
                self._cursor += 1
                self._progress = time.monotonic()
                for req in batch:
                    self._groups.setdefault(req.group_id, []).append(req)
                sends += batch
        if sends:
            self.fleet.submit(sends)

    def _collect(self, finished: list[Sample]) -> None:
        complete: list[int] = []
        with self._cond:
            self._progress = time.monotonic()
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
                group = ReadyGroup(self._groups[gid], members, oldest_version([m.sample for m in members]),
                                   self._sampling.keeps(members) if self._sampling is not None else True)
                if group.informative:
                    self._ready.append(group)
                else:  # set aside: a filler at most, and its place in the budget is free again
                    del self._groups[gid]
                    self._credit += 1
                    self._keep_spare(self._spare + [group], self._version - self.k)
            self._looked += len(by_group)
            self._cond.notify_all()

    # --- the driver's side ---

    def take(self, step: int) -> tuple[list[ScoredSample], list[Sample], dict[str, float]]:
        """Step's groups (the learner trains at version `step`): the `groups_per_step` finished
        groups with the oldest tokens that are at most k versions behind (informative ones first
        under dynamic sampling), as soon as there are that many. Every wait here ends: groups
        arrive, the draws run out (an error naming the budget), or `stall_s` passes without a
        sample finishing (`StreamStalled`)."""
        with self._cond:
            self._version = max(self._version, step)  # the learner is at `step` now: more may start
            self._progress = max(self._progress, time.monotonic() - self._poll_s)
        while True:
            self.fleet.repair()  # replaced workers, on this thread (which also runs the weight syncs)
            with self._cond:
                if self._error is not None:
                    raise self._error
                self._drop_stale(step)
                chosen = self._choose()
                if chosen is None:
                    self._check_stalled(step)
                    self._cond.wait(0.2)
                    continue
                for g in chosen:
                    if g in self._ready:
                        self._ready.remove(g)
                        del self._groups[g.requests[0].group_id]
                    else:
                        self._spare.remove(g)
                ready_left, stale, looked = len(self._ready), self._stale, self._looked
                self._stale = self._looked = 0
                in_flight = len(self._groups) - ready_left
                break
        window, self._last_take = time.monotonic() - self._last_take, time.monotonic()
        scored = [s for g in chosen for s in g.scored]
        samples = [s.sample for s in scored]
        metrics = {"time/rollout_s": window, "time/reward_s": 0.0,
                   "stream/ready_groups_count": float(ready_left), "stream/in_flight_groups_count": float(in_flight),
                   "stream/stale_groups_count": float(stale), **staleness_metrics(samples, step)}
        if self._sampling is not None:
            metrics.update(self._sampling.metrics(kept=sum(g.informative for g in chosen), looked=looked))
        return scored, samples, metrics

    def _drop_stale(self, step: int) -> None:
        """Finished groups older than the bound: informative ones are generated again; set-aside
        ones are forgotten (their place in the budget was freed when they were set aside)."""
        for g in [g for g in self._ready if g.oldest < step - self.k]:
            self._ready.remove(g)
            self._resend += g.requests
            self._stale += 1
        self._keep_spare(self._spare, step - self.k)

    def _keep_spare(self, groups: list[ReadyGroup], fresh_from: int) -> None:
        """Of `groups` (the set-aside ones, and any new), keep the freshest `P` of versions >=
        `fresh_from` (a step needs no more fillers); the others are dropped, each freeing its place
        in the budget."""
        keep = sorted((g for g in groups if g.oldest >= fresh_from), key=lambda g: -g.oldest)[: self.P]
        self._dropped += len(groups) - len(keep)
        self._spare = keep

    def _exhausted(self) -> bool:
        """Nothing in flight or waiting to be sent, and nothing more may be drawn: what is finished
        is all this step will get."""
        in_flight = len(self._groups) - len(self._ready) + len(self._resend)
        return not in_flight and self._cursor * self.P >= self._budget()

    def _choose(self) -> list[ReadyGroup] | None:
        """The groups for a step, or None while too few are ready: the P oldest informative ones;
        under dynamic sampling, set-aside ones fill the step as `sampling.choose` says (once
        `max_rounds` steps' worth of groups finished since the last take, or nothing more can come)."""
        ready = sorted(self._ready, key=lambda g: g.oldest)
        exhausted = self._exhausted()
        if self._sampling is not None:
            chosen = self._sampling.choose(ready, self._spare, self._looked, exhausted)
        else:
            chosen = ready[: self.P] if len(ready) >= self.P else None
        if chosen is None and exhausted:
            raise RuntimeError(f"streaming rollouts: the learner at version {self._version} needs {self.P} finished "
                               f"groups but only {len(ready)} (+{len(self._spare)} set aside) can come: the staleness "
                               f"budget of {self._budget()} groups (algorithm.off_policy_steps, "
                               "algorithm.max_sampling_rounds) is used up")
        return chosen

    def _check_stalled(self, step: int) -> None:
        waited = time.monotonic() - self._progress
        if waited > self._stall_s:
            raise StreamStalled(
                f"streaming rollouts: no sample finished for {waited:.0f} s while the learner waited for step "
                f"{step + 1}'s {self.P} groups ({len(self._ready)} finished, {len(self._groups) - len(self._ready)} "
                f"in flight): the deadline is {self._stall_s:g} s ({self._stall_hint})")

    def between_batches(self):
        """Weight syncs need no batch boundary here: the engines pause with their requests kept."""
        return nullcontext()

    def in_flight(self, whole: bool = True) -> dict[str, Any]:
        """What a checkpoint keeps (also when the fleet is broken: it is the driver's own record):
        the next batch to draw, the groups finished and scored (and set aside), the requests of
        every group admitted and unfinished (sent again, whole, on resume), and dynamic sampling's
        budget state."""
        with self._cond:
            ready = {g.requests[0].group_id for g in self._ready}
            pending = [r for gid, reqs in self._groups.items() if gid not in ready for r in reqs]
            return {"streaming": {"cursor": self._cursor, "ready": list(self._ready), "pending": pending,
                                  "spare": list(self._spare), "credit": self._credit, "dropped": self._dropped,
                                  "looked": self._looked}}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
