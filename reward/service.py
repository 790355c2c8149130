"""`RewardService`: a pool of Ray actors, each running a `RewardScorer`.

Scoring runs outside the driver so slow or heavy reward code (a reward model, sandboxed test
runs) scales over workers and cannot stall or crash the training loop. The caller owns
`ray.init`. User reward files are loaded inside the actors, so a ``path/to/file.py:fn`` spec
must exist at the same path on every node (true on one machine; on a cluster ship it with
`runtime_env`, or use the ``package.module:fn`` form with ``py_modules``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RuntimeEnvSetupError

from rl.actors.group import UNTRUSTED_NICENESS, ActorGroup
from rl.actors.faults import ActorFailure, Deadlines
from rl.data.types import Sample, ScoredSample
from reward.loader import RewardLoadError
from reward.scorer import DEFAULT_BOUND, RewardFunctionSpec, RewardScorer


class RewardWorker:
    """Actor body. Functions are loaded in `load()` rather than `__init__` so a load error
    reaches the driver as the original exception (Ray keeps only a string for __init__ errors);
    `score()` loads on demand too, which covers an actor Ray restarted after a crash."""

    def __init__(self, functions: list[RewardFunctionSpec], timeout_s: float, base_dir: str,
                 bound: float = DEFAULT_BOUND) -> None:
        self._args = (functions, timeout_s, base_dir, bound)
        self._scorer: RewardScorer | None = None

    def load(self) -> list[str]:
        if self._scorer is None:
            functions, timeout_s, base_dir, bound = self._args
            self._scorer = RewardScorer(functions, timeout_s=timeout_s, base_dir=base_dir, bound=bound)
        return self._scorer.names

    def where(self) -> dict:
        """This actor's process and Ray node (for placement reports and fault tests)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def score(self, samples: list[Sample]) -> list[ScoredSample]:
        self.load()
        assert self._scorer is not None
        return self._scorer.score(samples)


class RewardService:
    """Scores samples on `num_workers` actors; chunks are contiguous and results keep input order."""

    def __init__(
        self,
        functions: list[RewardFunctionSpec],
        *,
        num_workers: int = 1,
        timeout_s: float = 60.0,
        base_dir: str | None = None,
        bound: float = DEFAULT_BOUND,
        num_cpus_per_worker: float = 0.25,
        runtime_env: dict[str, Any] | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers}: must be at least 1")
        # Resolve here: relative paths mean "relative to where the driver was launched", while
        # actors may run in another working directory.
        base_dir = os.path.abspath(base_dir if base_dir is not None else os.getcwd())
        # A call runs each function once per batch, then once per sample of a failing batch.
        self._least_s = 2 * timeout_s * max(len(functions), 1) + 30
        options: dict[str, Any] = {"num_cpus": num_cpus_per_worker, "max_restarts": -1}
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        self.group = ActorGroup(ray, RewardWorker, num_workers, role="reward worker",
                                args=lambda i: (functions, timeout_s, base_dir, bound), options=options, deadlines=deadlines,
                                niceness=UNTRUSTED_NICENESS)
        try:
            self.names: list[str] = self._check_loaded()
        except BaseException:
            self.shutdown()
            raise

    def _check_loaded(self) -> list[str]:
        """Every worker must load every function within run.start_timeout_s; surface the loader's
        message, not Ray's. One that does not answer in time is an ActorFailure naming it."""
        try:
            out = self.group.gather({i: w.load.remote() for i, w in enumerate(self.group.handles)}, "start-up",
                                    self.group.deadlines.start_s, setting="run.start_timeout_s")
        except RuntimeEnvSetupError as exc:
            raise ValueError(f"a reward worker could not set up reward.runtime_env: {_first_lines(exc)}") from None
        for i in out.keys:
            if i in out.raised:
                cause = getattr(out.errors[i], "cause", None) or out.errors[i]
                if isinstance(cause, RewardLoadError):
                    raise RewardLoadError(str(cause)) from None
                raise ValueError(
                    f"reward worker {i} failed to load the reward functions: "
                    f"{type(cause).__name__}: {cause}"
                ) from None
            if i in out.died:
                raise ValueError(f"reward worker {i} could not start: {_first_lines(out.errors[i])}") from None
            if i in out.hung:
                raise ActorFailure(self.group.name(i), "start-up (loading reward.functions)", out.hung[i])
        return out.results[out.keys[-1]]

    def score(self, samples: list[Sample]) -> list[ScoredSample]:
        """Score on all workers. A worker that dies mid-chunk (e.g. user code crashed the
        process) or does not answer by the deadline marks that chunk's samples with an error;
        Ray restarts the actor (a silent one is killed first)."""
        chunks = _split(samples, len(self.group))
        refs = {i: w.score.remote(c) for i, (w, c) in enumerate(zip(self.group.handles, chunks)) if c}
        deadline, started = max(self.group.deadlines.of("reward"), self._least_s), time.monotonic()
        # a silent worker is stopped or stuck: killed, Ray starts it again
        out = self.group.gather(refs, "reward", deadline, kill_hung=True, propagate_raised=True)
        scored: list[ScoredSample] = []
        for i in out.keys:
            chunk, error = chunks[i], None
            if i in out.results:
                scored.extend(out.results[i])
            elif i in out.hung:
                error = f"reward worker stopped answering while scoring: {out.hung[i]}"
            elif isinstance(out.errors[i], ActorUnavailableError):  # still restarting after an earlier crash: the chunk never ran
                again, error = self._score_again(i, chunk, deadline)
                scored.extend(again)
            else:
                error = f"reward worker died while scoring: {_first_lines(out.errors[i])}"
            if error is not None:
                scored.extend(ScoredSample(sample=s, reward=None, error=error) for s in chunk)
        if refs and not out.hung:  # (the retries of restarting workers count too, and so does a call whose worker died)
            self.group.deadlines.record("reward", time.monotonic() - started)
        return scored

    def _score_again(self, i: int, chunk: list[Sample], deadline: float) -> tuple[list[ScoredSample], str | None]:
        """Score `chunk` on worker `i` once Ray has started it again (within run.start_timeout_s),
        then within `deadline`: its scores, or none and why."""
        back = self.group.back([i], method="load")  # the restarted actor loads its functions first
        if i not in back.results:
            return [], f"reward worker did not come back to score: {self.group.failure(i, 'restart', back)}"
        out = self.group.gather({i: self.group.handles[i].score.remote(chunk)}, "reward", deadline, kill_hung=True,
                                propagate_raised=True)
        if i in out.results:
            return out.results[i], None
        return [], f"reward worker {'stopped answering' if i in out.hung else 'died'} while scoring: {out.failed[i]}"

    def where(self) -> list[dict]:
        """Where each worker runs now (a call's deadline: an ActorFailure names one that does not answer)."""
        return self.group.located()

    def shutdown(self) -> None:
        self.group.shutdown()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _split(items: list[Sample], parts: int) -> list[list[Sample]]:
    """Contiguous chunks whose sizes differ by at most one (empty ones at the end)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _first_lines(exc: BaseException, n: int = 3) -> str:
    return " ".join(str(exc).strip().splitlines()[:n])
