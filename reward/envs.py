"""`EnvService`: the Ray actors that run environments (rl/data/env.py), one instance per episode.

Episodes are spread over `task.env_workers` actors by key; inside an actor each episode's
`reset`/`step` runs in a thread of its own (so a slow sandbox call or an `async` environment does
not hold the others up), bounded by `task.env_timeout_s`. An environment that raises, answers
badly or overruns ends only its own episode, with the error as the answer; a whole actor that
dies or stops answering costs the episodes it held (Ray starts it again). Like reward
functions, the environment class is loaded inside the actors.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from rl.data.env import StepResult, as_step_result
from rl.actors.group import UNTRUSTED_NICENESS, ActorGroup
from rl.actors.faults import ActorFailure, Deadlines
from reward.loader import RewardLoadError, load_environment
from reward.scorer import RewardCallTimeout, call_with_timeout


def _error(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, RewardCallTimeout):
        return f"no answer within task.env_timeout_s={timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}"


class EnvWorker:
    """Actor body: environment instances by episode key."""

    def __init__(self, spec: str, kwargs: dict[str, Any], timeout_s: float, base_dir: str) -> None:
        self.spec, self.kwargs, self.timeout_s, self.base_dir = spec, kwargs, timeout_s, base_dir
        self.envs: dict[int, Any] = {}
        self._cls: type | None = None
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="env")

    def load(self) -> str:
        if self._cls is None:
            self._cls = load_environment(self.spec, self.base_dir)
        return self._cls.__name__

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def _reset_one(self, key: int, row: dict[str, Any]) -> str | None:
        try:
            env = self._cls(**self.kwargs)  # type: ignore[misc]
            self.envs[key] = env
            if callable(getattr(env, "reset", None)):
                call_with_timeout(env.reset, {"row": row}, self.timeout_s)
            return None
        except BaseException as exc:  # noqa: BLE001 - recorded on the episode
            self.envs.pop(key, None)
            return _error(exc, self.timeout_s)

    def _step_one(self, key: int, text: str, ids: list[int]) -> StepResult | str:
        env = self.envs.get(key)
        if env is None:
            return "the environment of this episode is gone (its worker restarted)"
        try:
            return as_step_result(call_with_timeout(env.step, {"text": text, "token_ids": ids}, self.timeout_s))
        except BaseException as exc:  # noqa: BLE001
            return _error(exc, self.timeout_s)

    def reset(self, keys: list[int], rows: list[dict[str, Any]]) -> dict[int, str | None]:
        self.load()
        return dict(zip(keys, self._pool.map(self._reset_one, keys, rows)))

    def step(self, keys: list[int], texts: list[str], ids: list[list[int]]) -> dict[int, StepResult | str]:
        return dict(zip(keys, self._pool.map(self._step_one, keys, texts, ids)))

    def close(self, keys: list[int]) -> None:
        for key in keys:
            env = self.envs.pop(key, None)
            if env is not None and callable(getattr(env, "close", None)):
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - the episode is over; nothing to record it on
                    pass


class EnvService:
    """The driver's handle (implements `rl.data.episodes.Envs`): episode `key` lives on worker
    `key % num_workers`."""

    def __init__(self, spec: str, kwargs: dict[str, Any], *, num_workers: int = 1, timeout_s: float = 60.0,
                 base_dir: str | None = None, num_cpus_per_worker: float = 0.25,
                 deadlines: Deadlines | None = None) -> None:
        base_dir = os.path.abspath(base_dir or os.getcwd())
        self.group = ActorGroup(ray, EnvWorker, num_workers, role="environment worker",
                                args=lambda i: (spec, kwargs, timeout_s, base_dir),
                                options={"num_cpus": num_cpus_per_worker, "max_restarts": -1}, deadlines=deadlines,
                                niceness=UNTRUSTED_NICENESS)
        self.timeout_s, self.deadlines = timeout_s, self.group.deadlines
        try:
            self._check_loaded(spec)
        except BaseException:
            self.shutdown()
            raise

    def _check_loaded(self, spec: str) -> None:
        """Every worker loads the environment class within run.start_timeout_s: the loader's
        message for one that cannot, an ActorFailure naming one that does not answer in time."""
        out = self.group.gather({i: w.load.remote() for i, w in enumerate(self.workers)}, "start-up",
                                self.deadlines.start_s, setting="run.start_timeout_s")
        for i in out.keys:
            if i in out.raised:
                cause = getattr(out.errors[i], "cause", None) or out.errors[i]
                if isinstance(cause, RewardLoadError):
                    raise RewardLoadError(str(cause)) from None
                raise ValueError(f"environment worker {i} failed to load task.env={spec!r}: {cause}") from None
            if i in out.failed:
                phase = f"start-up (loading task.env={spec!r})"
                raise ActorFailure(self.group.name(i), phase, out.failed[i]) from None

    @property
    def workers(self) -> list[Any]:
        """The actors' handles, by index (episode `key` lives on `workers[key % len(workers)]`)."""
        return self.group.handles

    def _spread(self, keys: list[int], *columns: list[Any]) -> dict[int, tuple[list[int], list[list[Any]]]]:
        parts: dict[int, tuple[list[int], list[list[Any]]]] = {}
        for i, key in enumerate(keys):
            mine, cols = parts.setdefault(key % len(self.workers), ([], [[] for _ in columns]))
            mine.append(key)
            for col, values in zip(cols, columns):
                col.append(values[i])
        return parts

    def _call(self, method: str, keys: list[int], *columns: list[Any]) -> dict[int, Any]:
        """One call per worker holding some of `keys`; a worker that dies or overruns the deadline
        (a generous multiple of task.env_timeout_s) answers with an error for each of its keys."""
        parts = self._spread(keys, *columns)
        refs = {w: getattr(self.workers[w], method).remote(ks, *cols) for w, (ks, cols) in parts.items()}
        deadline = max(self.deadlines.of(f"env {method}"), 2 * self.timeout_s + 30)
        calls = self.group.gather(refs, f"env {method}", deadline, kill_hung=True,  # Ray starts it again
                                  propagate_raised=True)
        out: dict[int, Any] = {}
        for w in calls.keys:
            if w in calls.results:
                out.update(calls.results[w])
                continue
            why, text = (("stopped answering", calls.hung[w]) if w in calls.hung
                         else ("died", str(calls.errors[w]).splitlines()[0]))
            out.update({k: f"environment worker {w} {why}: {text}" for k in parts[w][0]})
        if refs and not calls.hung:  # (also after a death, unlike gather's own record)
            self.deadlines.record(f"env {method}", calls.elapsed_s)
        return out

    def reset(self, keys: list[int], rows: list[dict[str, Any]]) -> dict[int, str | None]:
        return self._call("reset", keys, rows)

    def step(self, keys: list[int], texts: list[str], token_ids: list[list[int]]) -> dict[int, StepResult | str]:
        return self._call("step", keys, texts, token_ids)

    def close(self, keys: list[int]) -> None:
        parts = self._spread(keys)
        # best effort (the episodes are over): at most 30 s, a worker that does not answer is left be
        self.group.gather({w: self.workers[w].close.remote(ks) for w, (ks, _) in parts.items()}, "env close", 30)

    def where(self) -> list[dict]:
        """Where each worker runs now (a call's deadline: an ActorFailure names one that does not answer)."""
        return self.group.located()

    def shutdown(self) -> None:
        self.group.shutdown()
