"""Sandbox workers as Ray actors, and the one call code rewards use to run jobs.

`SandboxPool` starts `num_workers` named actors (optionally pinned to nodes advertising a custom
Ray resource such as `benchmark`, so a cluster can keep compile-and-benchmark work on CPU nodes
apart from the GPU nodes). `run_jobs` finds those actors by name from anywhere in the same Ray
job (e.g. inside a reward actor) and falls back to running in-process when there is no pool.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rl.actors.group import UNTRUSTED_NICENESS, ActorGroup
from rl.actors.faults import ActorFailure, Calls, Deadlines, await_answers, fan_out
from sandbox.backend import Backend
from sandbox.job import COMPILE_LIMITS, Job, Method, Result, Status
from sandbox.runner import VALGRIND_SLOWDOWN, run_job

ACTOR_PREFIX = "rlpost-sandbox-"


def worker_name(index: int) -> str:
    """The Ray name of sandbox worker `index` (the pool names them; reward actors find them by it)."""
    return f"{ACTOR_PREFIX}{index}"


BACKENDS = ("process", "docker", "unsafe_local")


@dataclass(frozen=True)
class SandboxSettings:
    """Mirrors `sandbox.*` of the train config (rl/config/schema.py SandboxConfig)."""

    backend: str = "process"
    num_workers: int = 0
    slots_per_worker: int = 2
    num_cpus_per_worker: float = 1.0
    resource: str | None = None
    docker_image: str = "rlpost-sandbox:bookworm"
    max_retries: int = 2


def make_backend(settings: SandboxSettings) -> Backend:
    """The configured backend; raises SandboxUnavailable (naming the fix) if the host lacks it."""
    if settings.backend == "process":
        from sandbox.process import ProcessBackend

        return ProcessBackend(slots=settings.slots_per_worker)
    if settings.backend == "docker":
        from sandbox.docker import DockerBackend

        return DockerBackend(image=settings.docker_image)
    if settings.backend == "unsafe_local":
        from sandbox.local import LocalBackend

        return LocalBackend(i_understand_this_is_unsafe=True)
    raise ValueError(f"sandbox.backend={settings.backend!r}: choose one of {', '.join(BACKENDS)}")


class SandboxWorker:
    """Actor body: one backend, `slots` jobs at a time."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.backend = make_backend(settings)
        self._threads = ThreadPoolExecutor(settings.slots_per_worker, thread_name_prefix="sandbox")
        self.jobs_run = 0

    def ready(self) -> str:
        return f"{self.backend.name}@{os.uname().nodename}"

    def where(self) -> dict:
        """This actor's process and Ray node (for placement reports and fault tests)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def run(self, jobs: list[Job]) -> list[Result]:
        results = list(self._threads.map(lambda job: run_job(job, self.backend), jobs))
        self.jobs_run += len(jobs)
        return results

    def count(self) -> int:
        """Jobs this worker has run (for tests and monitoring)."""
        return self.jobs_run

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.backend.close()


class SandboxPool:
    """Starts the named sandbox actors of this Ray job; `close()` ends them."""

    def __init__(self, settings: SandboxSettings, start_timeout_s: float | None = None,
                 deadlines: Deadlines | None = None) -> None:
        """`deadlines`: the run's (run.start_timeout_s bounds the start, run.call_timeout_s the
        calls of `where` and `jobs_run`); without them the start may take `start_timeout_s` or
        `_start_timeout(settings)`."""
        import ray

        if settings.num_workers < 1:
            raise ValueError(f"sandbox.num_workers={settings.num_workers}: a pool needs at least 1 worker")
        # Ray starts a worker again (same name) when its process dies; `run_jobs` resends its jobs.
        options: dict = {"num_cpus": settings.num_cpus_per_worker, "max_concurrency": 2, "max_restarts": -1}
        if settings.resource:
            options["resources"] = {settings.resource: 1}
        self.max_retries = settings.max_retries
        start_s = start_timeout_s or (deadlines.start_s if deadlines else _start_timeout(settings))
        setting = "run.start_timeout_s" if deadlines and not start_timeout_s else "the pool's start deadline"
        if deadlines is None:
            deadlines = Deadlines(start_s=start_s)
        self.group = ActorGroup(ray, SandboxWorker, settings.num_workers, role="sandbox worker",
                                args=lambda i: (settings,), options=options, deadlines=deadlines,
                                per_actor=[{"name": worker_name(i)} for i in range(settings.num_workers)],
                                niceness=UNTRUSTED_NICENESS)
        try:
            # A host without isolation fails here, with the backend's own message (a worker that
            # raised or died is reported once the others answered or the deadline passed).
            out = self.group.gather({i: w.ready.remote() for i, w in enumerate(self.workers)}, "start-up", start_s,
                                    propagate_raised=True, setting=setting)
            for i in out.keys:
                if i in out.died:
                    raise out.errors[i]
            self.placement = [out.results[i] for i in out.keys if i in out.results]
            if out.hung:
                i = next(iter(out.hung))
                where = f" advertising resource {settings.resource!r}" if settings.resource else ""
                raise ActorFailure(
                    self.group.name(i), "start-up",
                    f"not up after {start_s:.0f} s ({setting}): no node{where} with "
                    f"{settings.num_cpus_per_worker} free CPU(s) per worker; add such nodes "
                    "(`ray start --resources='{\"benchmark\": 4}'`) or change sandbox.resource / sandbox.num_workers")
        except ActorFailure:
            self.close()
            raise
        except ray.exceptions.RayActorError as exc:
            self.close()
            # A worker's backend refused to start (e.g. no isolation on its node): its own message.
            cause = getattr(exc, "cause", None) or exc
            raise RuntimeError(f"sandbox workers could not start: {cause}") from None
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> list:
        """The actors' handles, worker i named `worker_name(i)`."""
        return self.group.handles

    def run(self, jobs: list[Job]) -> list[Result]:
        return _dispatch(self.workers, jobs, self.max_retries)

    def where(self) -> list[dict]:
        """Where each worker runs now (a call's deadline: an ActorFailure names one that does not answer)."""
        return self.group.located()

    def jobs_run(self) -> int:
        return sum(self.group.ask("count"))

    def close(self, timeout_s: float = 10.0) -> None:
        """End the workers and wait (up to `timeout_s`) until Ray released their names: a pool
        started next in the same Ray (another run of one session) takes the same names."""
        import ray

        n = len(self.group)
        self.group.shutdown()
        deadline = time.monotonic() + timeout_s
        for i in range(n):
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(worker_name(i))
                except ValueError:  # dead: its name is free
                    break
                time.sleep(0.05)


def _start_timeout(settings: SandboxSettings) -> float:
    return 600.0 if settings.backend == "docker" else 120.0


def job_deadline_s(job: Job) -> float:
    """The longest a job can take within its own limits: compile, every test, the benchmark."""
    runs = len(job.tests) + len(job.hidden_tests)
    bench = 0.0
    if job.bench_stdin is not None:
        runs_measured = VALGRIND_SLOWDOWN if Method(job.method) is Method.INSTRUCTIONS else max(1, job.repeats)
        bench = job.limits.wall_s * runs_measured
    return COMPILE_LIMITS.wall_s + runs * job.limits.wall_s + bench


# How long a failed worker may take to be started again by Ray before its jobs are given up on.
RESTART_TIMEOUT_S = 120.0


def _dispatch(workers: list, jobs: list[Job], max_retries: int = 2) -> list[Result]:
    """Spread jobs over workers in contiguous chunks, results in input order. A worker that dies
    or overruns its jobs' own time limits (stopped, stuck) is killed, Ray starts it again (within
    RESTART_TIMEOUT_S), and its jobs are sent again, up to `max_retries` times; after that, or
    when it does not come back, they are `sandbox_error`s."""
    import ray

    if not jobs:
        return []
    calls = Calls.ray(ray)
    parts = min(len(workers), len(jobs))
    bounds = [len(jobs) * i // parts for i in range(parts + 1)]
    chunks = {i: jobs[bounds[i]:bounds[i + 1]] for i in range(parts)}
    results: dict[int, list[Result]] = {}
    lost: dict[int, str] = {}
    for attempt in range(1, max_retries + 2):
        refs = {i: workers[i].run.remote(chunk) for i, chunk in chunks.items()}
        deadline = 60 + max(sum(job_deadline_s(j) for j in chunk) for chunk in chunks.values())
        out = fan_out(refs, deadline, calls, propagate_raised=True, setting="its jobs' own time limits + 60 s",
                      kill=lambda i: ray.kill(workers[i], no_restart=False))
        results.update(out.results)
        if not out.failed:
            break
        if attempt > max_retries:
            lost.update({i: f"{why}; its jobs were tried {attempt} times" for i, why in out.failed.items()})
            break
        back = await_answers(lambda i: workers[i].ready.remote(), out.failed, RESTART_TIMEOUT_S, calls,
                             setting="sandbox.pool.RESTART_TIMEOUT_S")
        for i, why in out.failed.items():
            if i not in back.results:
                again = back.failed.get(i) or back.raised.get(i)
                lost[i] = f"{why}; Ray did not start it again: {again}; its jobs were tried {attempt} times"
        chunks = {i: chunks[i] for i in out.failed if i in back.results}
        if not chunks:
            break
    for i, why in lost.items():
        detail = f"sandbox worker {i} failed: {why}"
        results[i] = [Result(Status.SANDBOX_ERROR, detail=detail) for _ in range(bounds[i + 1] - bounds[i])]
    return [r for i in sorted(results) for r in results[i]]


def find_pool_workers() -> list:
    """The named sandbox actors of the current Ray job (empty without Ray or without a pool)."""
    try:
        import ray
    except ImportError:
        return []
    if not ray.is_initialized():
        return []
    workers = []
    while True:
        try:
            workers.append(ray.get_actor(worker_name(len(workers))))
        except ValueError:
            return workers


_local: dict[SandboxSettings, Backend] = {}
_local_lock = threading.Lock()


def run_jobs(jobs: list[Job], fallback: SandboxSettings = SandboxSettings()) -> list[Result]:
    """Run jobs on the pool of this Ray job if there is one, else in this process with the
    `fallback` backend (kept for the life of the process)."""
    workers = find_pool_workers()
    if workers:
        return _dispatch(workers, jobs, fallback.max_retries)
    with _local_lock:
        backend = _local.get(fallback)
        if backend is None:
            backend = _local[fallback] = make_backend(fallback)
    slots = max(1, fallback.slots_per_worker)
    with ThreadPoolExecutor(slots, thread_name_prefix="sandbox") as threads:
        return list(threads.map(lambda job: run_job(job, backend), jobs))
