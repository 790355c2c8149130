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

from rl.run.actor_group import ActorGroup
from rl.run.faults import Calls, fan_out
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

    def __init__(self, settings: SandboxSettings, start_timeout_s: float | None = None) -> None:
        import ray

        if settings.num_workers < 1:
            raise ValueError(f"sandbox.num_workers={settings.num_workers}: a pool needs at least 1 worker")
        # Ray starts a worker again (same name) when its process dies; `run_jobs` resends its jobs.
        options: dict = {"num_cpus": settings.num_cpus_per_worker, "max_concurrency": 2, "max_restarts": -1}
        if settings.resource:
            options["resources"] = {settings.resource: 1}
        self.max_retries = settings.max_retries
        self.group = ActorGroup(ray, SandboxWorker, settings.num_workers, role="sandbox worker",
                                args=lambda i: (settings,), options=options,
                                per_actor=[{"name": worker_name(i)} for i in range(settings.num_workers)])
        try:
            # A host without isolation fails here, with the backend's own message (at once: a
            # list's ray.get raises the first error, where a fan-out would wait for them all).
            self.placement = ray.get([w.ready.remote() for w in self.workers], timeout=start_timeout_s or _start_timeout(settings))
        except ray.exceptions.GetTimeoutError as exc:
            self.close()
            where = f" advertising resource {settings.resource!r}" if settings.resource else ""
            raise RuntimeError(
                f"sandbox workers did not start: no node{where} with {settings.num_cpus_per_worker} free CPU(s) "
                "per worker; add such nodes (`ray start --resources='{\"benchmark\": 4}'`) or change "
                "sandbox.resource / sandbox.num_workers") from exc
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
        import ray

        return ray.get([w.where.remote() for w in self.workers])

    def jobs_run(self) -> int:
        import ray

        return sum(ray.get([w.count.remote() for w in self.workers]))

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


def _dispatch(workers: list, jobs: list[Job], max_retries: int = 2) -> list[Result]:
    """Spread jobs over workers in contiguous chunks, results in input order. A worker that dies
    or overruns its jobs' own time limits (stopped, stuck) is killed, Ray starts it again, and
    its jobs are sent again, up to `max_retries` times; after that they are `sandbox_error`s."""
    import ray

    if not jobs:
        return []
    parts = min(len(workers), len(jobs))
    bounds = [len(jobs) * i // parts for i in range(parts + 1)]
    chunks = {i: jobs[bounds[i]:bounds[i + 1]] for i in range(parts)}
    results: dict[int, list[Result]] = {}
    failed: dict[int, str] = {}
    for _ in range(max_retries + 1):
        refs = {i: workers[i].run.remote(chunk) for i, chunk in chunks.items()}
        deadline = 60 + max(sum(job_deadline_s(j) for j in chunk) for chunk in chunks.values())
        out = fan_out(refs, deadline, Calls.ray(ray), propagate_raised=True,
                      kill=lambda i: ray.kill(workers[i], no_restart=False))
        results.update(out.results)
        failed = out.failed
        if not failed:
            break
        for i in failed:
            _wait_restarted(workers[i])
        chunks = {i: chunks[i] for i in failed}
    for i, why in failed.items():
        detail = f"sandbox worker {i} failed: {why}; its jobs were tried {max_retries + 1} times"
        results[i] = [Result(Status.SANDBOX_ERROR, detail=detail) for _ in chunks[i]]
    return [r for i in sorted(results) for r in results[i]]


def _wait_restarted(worker, timeout_s: float = 120.0) -> None:
    """Until Ray has started the worker again (or gave up on it: then the retry fails too)."""
    import time

    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ray.get(worker.ready.remote(), timeout=max(1.0, end - time.monotonic()))
            return
        except ActorUnavailableError:
            time.sleep(0.5)
        except (RayActorError, GetTimeoutError):
            return


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
