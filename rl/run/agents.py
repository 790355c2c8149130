"""Agent episodes (`task.agent`, DESIGN.md "Agents through an OpenAI-compatible endpoint"): the
user's agent code runs once per sample against a base URL of its own on the agent server, and the
calls it makes there, recorded token for token, are the sample.

`AgentRunner` has the streaming fleet's face (`submit`, `drain`, `repair`), so `rl.run.streaming`
streams agent episodes as it streams completions: each request starts an episode in a worker
thread; the agent's return value is the episode's reward (on its last model turn, like an
environment's); an episode whose agent raises, or has not returned after `task.agent_timeout_s`,
comes back as an error sample that names it (the thread is abandoned, its episode closed, so its
further calls are refused), and the run goes on.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from rl.data.agent_calls import RecordedCall, episode_sample
from rl.data.types import GenerationRequest, Sample


class EpisodeServer(Protocol):
    def open_episode(self, key: str, seed_base: int, metadata: dict | None = None) -> str: ...
    def close_episode(self, key: str, timeout_s: float | None = None) -> list[RecordedCall]: ...


class AgentRunner:
    def __init__(self, server: EpisodeServer, agent: Callable[..., Any], fleet: Any, *, prompt_key: str,
                 workers: int, timeout_s: float, max_len: int, decode: Callable[[list[int]], str] | None = None,
                 agent_kwargs: dict[str, Any] | None = None):
        """`agent(base_url, row, **agent_kwargs) -> reward`; `fleet`: repaired on `repair`."""
        self.server, self.agent, self.fleet = server, agent, fleet
        self.prompt_key, self.timeout_s, self.max_len, self.decode = prompt_key, timeout_s, max_len, decode
        self.kwargs = dict(agent_kwargs or {})
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="agent")
        self._cond = threading.Condition()
        self._done: list[Sample] = []
        self._running: dict[str, tuple[GenerationRequest, float]] = {}  # by episode key: request, start
        self._count = 0

    def submit(self, requests: list[GenerationRequest]) -> None:
        for req in requests:
            with self._cond:
                self._count += 1
                key = f"g{req.group_id}-s{req.sample_index}-{self._count}"
            self._pool.submit(self._episode, key, req)

    def _episode(self, key: str, req: GenerationRequest) -> None:
        row = {self.prompt_key: req.prompt_text, **req.metadata}
        url = self.server.open_episode(key, seed_base=req.seed, metadata=req.metadata)
        with self._cond:
            self._running[key] = (req, time.monotonic())
        reward, error = None, None
        try:
            reward = float(self.agent(url, row, **self.kwargs))
        except Exception as exc:  # noqa: BLE001 - the user's code: its error is the episode's
            error = f"task.agent raised {type(exc).__name__}: {exc}"
        with self._cond:
            if self._running.pop(key, None) is None:
                return  # past its deadline: already answered as an error
        self._finish(key, req, reward, error)

    def _finish(self, key: str, req: GenerationRequest, reward: float | None, error: str | None) -> None:
        calls = self.server.close_episode(key, timeout_s=5.0)
        sample = episode_sample(calls, prompt_text=req.prompt_text, group_id=req.group_id,
                                sample_index=req.sample_index, metadata=req.metadata, max_len=self.max_len,
                                decode=self.decode)
        if error is not None:
            sample.error = error
        elif sample.error is None:
            model_turns = [t for t in sample.turns or () if t.role == "model"]
            if model_turns:
                model_turns[-1].reward = reward
            else:
                sample.error = "agent episode sampled no token (every call returned an empty completion)"
        with self._cond:
            self._done.append(sample)
            self._cond.notify_all()

    def drain(self, wait_s: float) -> list[Sample]:
        """The episodes finished since the last call (waiting up to `wait_s`), including those whose
        agent is past its deadline: they end here as error samples."""
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout=wait_s)
            now = time.monotonic()
            late = {k: req for k, (req, started) in self._running.items() if now - started > self.timeout_s}
            for k in late:
                del self._running[k]
        for k, req in late.items():
            self._finish(k, req, None, f"task.agent did not return within task.agent_timeout_s={self.timeout_s:g} "
                                       "s: its episode is dropped (its further calls are refused)")
        with self._cond:
            done, self._done = self._done, []
        return done

    def repair(self) -> None:
        self.fleet.repair()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
