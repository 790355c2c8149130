"""Agent episodes (`task.agent`, docs/architecture.md "Agents"): the user's agent code runs once
per sample, in a process of its own, against a base URL of its own on the agent server; the calls
it makes there, recorded token for token, are the sample.

`AgentRunner` is a rollout `Source` (rl/run/rollouts.py): a batch (`run`) or a stream
(`submit`/`drain`) of episodes. Each request opens an episode on the server (an unguessable key,
the request's temperature) and starts the agent in the process pool; the agent's return value is
the episode's reward, on its last model turn, like an environment's. The pool kills an agent that
has not returned after `task.agent_timeout_s`, and one that raises, exits or crashes costs its
episode only: the episode comes back as an error sample naming the agent, the prompt and the
cause, its server episode is closed (later calls get a 404) and the run goes on. No wait here is
without a deadline, and closing never waits on an agent.
"""

from __future__ import annotations

import json
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

from rl.data.agent_calls import RecordedCall, episode_sample
from rl.data.types import GenerationRequest, Sample
from rl.actors.faults import episode_error


class EpisodeServer(Protocol):
    def open_episode(self, seed_base: int, metadata: dict | None = None,
                     temperature: float | None = None) -> tuple[str, str]: ...
    def end_episode(self, key: str, at: float | None = None) -> None: ...
    def refusal(self, key: str) -> str | None: ...
    def close_episode(self, key: str) -> list[RecordedCall]: ...


class Outcome(Protocol):
    value: Any
    error: str | None
    log_tail: str


class AgentProcesses(Protocol):
    """`reward.agents.pool.AgentPool`: agents in killable processes; `on_end(job_id)` is called as
    each agent returns, dies or is killed, before its outcome is in `results`. A pool that can run
    no episode any more (its zygote or monitor gone) may say why in `out_of_service` (None while it can)."""

    on_end: Callable[[Hashable, float | None], None] | None

    def start(self, job_id: Hashable, base_url: str, row: dict[str, Any]) -> None: ...
    def results(self, wait_s: float) -> list[tuple[Hashable, Outcome]]: ...
    def cancel(self, job_id: Hashable) -> None: ...
    def close(self) -> None: ...


def pool_out_of_service(pool: Any) -> str | None:
    """Why `pool` can run no episode any more, where it says so (its `out_of_service`: e.g. "could not run:
    its zygote process (pid 7) exited"), else None: an outcome missing from such a pool is named by
    that reason, not by a deadline (issue 58)."""
    why = getattr(pool, "out_of_service", None)
    return why if isinstance(why, str) and why else None


def episode_reward(value: Any, bound: float = 1e6) -> tuple[float | None, str | None]:
    """An agent's return value as (reward, error): a real number within +-`bound`
    (`task.agent_reward_bound`), or None (no reward of the agent's own: `reward.functions` score
    the episode); anything else is an error. A bool is refused (True is a bug, not 1.0), and so is
    a huge value: 1e30 overflowed the update and the run learned nothing (issue 47)."""
    if value is None:
        return None, None
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        if abs(float(value)) <= bound:
            return float(value), None
        return None, (f"returned {shown}, beyond task.agent_reward_bound={bound:g}: return a reward within "
                      "+-bound, or raise the bound")
    return None, (f"returned {shown} ({type(value).__name__}): an agent returns the episode's reward, a finite "
                  "number (not a bool), or None to leave it to reward.functions")


EPISODE_NOTE = "rlpost-episode-note: "


def episode_note(log_tail: str) -> dict[str, Any]:
    """What an episode says besides its reward (its result crosses as one float): the JSON object
    on the last line of its output that starts with `EPISODE_NOTE` (the framework episodes print
    one as they return: reward/agents/verifiers.py, openenv.py). Its keys, each optional:
    `truncated` (why: a limit of the agent's own environment ended it before it was done; the
    reward is kept), `prompt` ("rendered": the sample's prompt text is the model's first prompt
    as rendered, where the row's column only names the task), `reward_parts` ({name: value}, named
    when the reward is refused). Anything else in it, or a line that does not parse, is ignored."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith(EPISODE_NOTE):
            try:
                note = json.loads(line[len(EPISODE_NOTE):])
            except ValueError:
                return {}
            return note if isinstance(note, dict) else {}
    return {}


@dataclass
class _Running:
    request: GenerationRequest
    owner: Hashable  # "stream", or the `run` call waiting for it


class AgentRunner:
    def __init__(self, server: EpisodeServer, pool: AgentProcesses, repairs: Any, *, name: str, prompt_key: str,
                 timeout_s: float, workers: int, max_len: int, decode: Callable[[list[int]], str] | None = None,
                 reward_bound: float = 1e6):
        """`name`: the `task.agent` spec (in error messages); `repairs`: what replaces lost rollout workers
        (the driver's `Cluster`), on `repair`;
        `timeout_s`/`workers`: the pool's deadline and size, which bound how long `run` may take."""
        self.server, self.pool, self.repairs = server, pool, repairs
        self.name, self.prompt_key, self.timeout_s, self.workers = name, prompt_key, timeout_s, workers
        self.max_len, self.decode, self.reward_bound = max_len, decode, reward_bound
        # on the server, before the driver sees it; calls left in flight when the agent returned are dropped
        pool.on_end = lambda key, at=None: server.end_episode(str(key), at=at)
        self._cond = threading.Condition()
        self._running: dict[str, _Running] = {}  # by episode key
        self._done: dict[Hashable, list[Sample]] = {}  # by owner
        self._calls = 0

    # --- a rollout source ---

    def submit(self, requests: list[GenerationRequest], owner: Hashable = "stream") -> None:
        for req in requests:
            key, url = self.server.open_episode(req.seed, req.metadata, req.temperature)
            with self._cond:
                self._running[key] = _Running(req, owner)
            try:
                self.pool.start(key, url, {self.prompt_key: req.prompt_text, **req.metadata})
            except BaseException:  # not started: its episode must not stay open for good (issue 47)
                with self._cond:
                    self._running.pop(key, None)
                self.server.close_episode(key)
                raise

    def drain(self, wait_s: float) -> list[Sample]:
        """The streamed episodes finished since the last call (waiting up to `wait_s`)."""
        self._pump(wait_s)
        with self._cond:
            return self._done.pop("stream", [])

    def run(self, requests: list[GenerationRequest]) -> list[Sample]:
        """A batch of episodes, in request order, beside any stream. Every agent ends within its
        deadline (the pool kills it), so the batch ends within as many deadlines as it takes rounds
        of the pool; past that (a bug), the episodes left are error samples."""
        with self._cond:
            self._calls += 1
            owner = ("run", self._calls)
        self.submit(requests, owner)
        rounds = -(-len(requests) // self.workers) + 1
        deadline = time.monotonic() + rounds * (self.timeout_s + 30.0)
        while True:
            with self._cond:
                got = len(self._done.get(owner, []))
            if got == len(requests) or time.monotonic() > deadline:
                break
            self.repair()  # a rollout worker lost under an agent's call: replaced (launch/cluster.py)
            self._pump(0.2)
            why = pool_out_of_service(self.pool)
            if why is not None:  # no outcome will come any more: the episodes left are lost now
                self._pump(0.0)
                break
        with self._cond:
            done = {(s.group_id, s.sample_index): s for s in self._done.pop(owner, [])}
            late = [k for k, r in self._running.items() if r.owner == owner]
        why = pool_out_of_service(self.pool)
        for key in late:
            self.pool.cancel(key)
            self._finish(key, None, f"no outcome: the agent pool is out of service ({why})" if why is not None
                         else f"no outcome within {rounds} x (task.agent_timeout_s + 30 s)")
        with self._cond:
            done.update({(s.group_id, s.sample_index): s for s in self._done.pop(owner, [])})
        return [done[(r.group_id, r.sample_index)] for r in requests]

    def repair(self) -> None:
        self.repairs.repair()

    def close(self) -> None:
        """Kill every agent (never waits on one) and close their episodes."""
        self.pool.close()
        with self._cond:
            keys, self._running = list(self._running), {}
        for key in keys:
            self.server.close_episode(key)

    # --- outcomes ---

    def _pump(self, wait_s: float) -> None:
        """Turn the pool's finished agents into samples for whoever waits for them."""
        for key, outcome in self.pool.results(wait_s):
            self._finish(str(key), outcome, None)

    def _finish(self, key: str, outcome: Outcome | None, lost: str | None) -> None:
        with self._cond:
            running = self._running.pop(key, None)
        if running is None:
            return  # closed meanwhile
        req = running.request
        refused = self.server.refusal(key)
        calls = self.server.close_episode(key)
        note = episode_note(outcome.log_tail) if outcome is not None else {}
        prompt_text = req.prompt_text
        if note.get("prompt") == "rendered" and calls and self.decode is not None:
            prompt_text = self.decode(calls[0].prompt_ids)  # what the model saw (issue 59)
        sample = episode_sample(calls, prompt_ids=req.prompt_ids, prompt_text=prompt_text,
                                group_id=req.group_id, sample_index=req.sample_index, metadata=req.metadata,
                                max_len=self.max_len, decode=self.decode)
        cause = lost or (outcome.error if outcome is not None else "no outcome")
        if lost is None and refused and "(rollout.max_model_len)" in refused:
            # it reached its context (a call refused for it): the episode ends there, truncated, and keeps
            # what it earned: the agent's return value, or, where the agent raised at the refusal, the
            # reward functions' score (issue 59)
            sample.truncated, cause = True, None
        if cause is None and refused and "task.agent_max_calls" in refused:
            cause = refused
        elif cause is not None and refused:  # named, though the agent's client may have hidden it (issue 59)
            said = refused.partition(": ")[2][4:] in cause  # its message (after the status) is there already
            cause += f" ({refused.partition(':')[0]})" if said else f"; before that, {refused}"
        reward = None
        if cause is None:
            reward, cause = episode_reward(outcome.value, self.reward_bound)
            # a limit of its own environment (max_turns) ended it before it was done: kept, truncated
            sample.truncated = sample.truncated or (cause is None and isinstance(note.get("truncated"), str))
        parts = note.get("reward_parts")
        if cause is not None and "task.agent_reward_bound" in cause and isinstance(parts, dict) and parts:
            cause += "; its parts: " + ", ".join(f"{k}={v!r}" for k, v in list(parts.items())[:8])
        model_turns = [t for t in sample.turns or () if t.role == "model"]
        if cause is None and sample.error is None and not model_turns:
            cause = "the episode sampled no token (every call returned an empty completion)"
        cause = cause or sample.error  # (the calls themselves: none made, or history rewritten)
        if cause is not None:
            tail = " ".join((outcome.log_tail if outcome is not None else "").split()[-40:])
            sample.error = episode_error(self.name, req.prompt_text, req.group_id, req.sample_index, cause, tail)
        else:
            model_turns[-1].reward = reward
        with self._cond:
            self._done.setdefault(running.owner, []).append(sample)
            self._cond.notify_all()
