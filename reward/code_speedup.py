"""The code speed-up reward: compile, test and benchmark each completion in the sandbox.

Dataset columns (one row per problem, see examples/code_speedup.py): `reference` (the slow correct
program), `harness` (trusted `main` built with the candidate, or None), `tests` and
`hidden_tests` (lists of {stdin, expected_stdout}), `bench_stdin`, `language`, `compile_flags`.

Reward of a completion:
- 0 if it fails to compile, fails any visible or hidden test, exceeds a limit, tries something
  the sandbox forbids (a process, a socket) or exits before the harness finishes;
- else `clip(correct_bonus + (1 - correct_bonus) * ln(speedup) / ln(max_speedup), 0, 1)`, where
  speedup = cost(reference) / cost(candidate), both measured by the same method on the same
  input in the same kind of sandbox. A copy of the reference scores `correct_bonus`.
- a sandbox failure (not the program's fault) is an error for that sample, never a 0.

Judgements are memoised per process by the job's content: instruction counts are deterministic,
so a completion the policy repeats is not benchmarked again (cpu_time results are not memoised).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sandbox.job import Job, Language, Method, Result, Status, TestCase
from sandbox.pool import SandboxSettings, run_jobs

# The harness prints this last; a program cannot print it without reading it (it is random per
# process and passed on stdin after the test input, which the harness has consumed).
_SENTINEL = "end-" + secrets.token_hex(8)
_CACHE_SIZE = 50_000
_cache: OrderedDict[str, Result] = OrderedDict()
_cache_lock = threading.Lock()


class SandboxFailure(RuntimeError):
    """The sandbox (not the program) failed; the sample is recorded as an error."""


@dataclass(frozen=True)
class Judgement:
    result: Result
    speedup: float | None = None   # set for correct programs with a measurement
    error: Exception | None = None


def speedup_to_reward(speedup: float, max_speedup: float = 100.0, correct_bonus: float = 0.2) -> float:
    """Bounded reward of a correct program: log-speed-up scaled so max_speedup earns 1."""
    if max_speedup <= 1:
        raise ValueError(f"max_speedup={max_speedup}: must be > 1")
    scaled = correct_bonus + (1 - correct_bonus) * math.log(speedup) / math.log(max_speedup)
    return min(max(scaled, 0.0), 1.0)


def make_job(source: str, row: dict[str, Any], method: str = "instructions", name: str = "") -> Job:
    """The sandbox job for `source` on the problem described by dataset `row`."""
    return Job(
        language=Language(row.get("language") or "c"),
        source=source,
        tests=_cases(row.get("tests")),
        hidden_tests=_cases(row.get("hidden_tests")),
        harness=row.get("harness"),
        sentinel=_SENTINEL if row.get("harness") else None,
        compile_flags=tuple(row.get("compile_flags") or ("-O2",)),
        bench_stdin=row.get("bench_stdin"),
        method=Method(method),
        name=name,
    )


def judge(
    completions: list[str],
    rows: list[dict[str, Any]],
    method: str = "instructions",
    backend: str = "process",
) -> list[Judgement]:
    """Judge every completion against its row's reference, running each distinct job once."""
    jobs = [make_job(c, row, method, name="candidate") for c, row in zip(completions, rows, strict=True)]
    refs = [make_job(row["reference"], row, method, name="reference") for row in rows]
    results = _run_memoised(jobs + refs, SandboxSettings(backend=backend))
    cand, ref = results[: len(jobs)], results[len(jobs):]
    return [_compare(c, r) for c, r in zip(cand, ref)]


def _compare(cand: Result, ref: Result) -> Judgement:
    if ref.status is not Status.OK or ref.measurement is None:
        why = ref.detail or ref.status.value
        return Judgement(cand, error=SandboxFailure(f"the reference solution did not pass: {ref.status.value}: {why}"))
    if cand.status is Status.SANDBOX_ERROR:
        return Judgement(cand, error=SandboxFailure(cand.detail))
    if cand.status is not Status.OK:
        return Judgement(cand)
    assert cand.measurement is not None  # ok + bench_stdin always measures
    if cand.measurement.method != ref.measurement.method:
        return Judgement(cand, error=SandboxFailure("candidate and reference measured by different methods"))
    return Judgement(cand, speedup=ref.measurement.value / max(cand.measurement.value, 1e-12))


def _run_memoised(jobs: list[Job], settings: SandboxSettings) -> list[Result]:
    keys = [_key(job, settings.backend) for job in jobs]
    with _cache_lock:
        known = {k: _cache[k] for k in keys if k in _cache}
    todo: dict[str, Job] = {}
    for k, job in zip(keys, jobs):
        if k not in known and k not in todo:
            todo[k] = job
    if todo:
        fresh = dict(zip(todo, run_jobs(list(todo.values()), settings)))
        with _cache_lock:
            for k, job in todo.items():
                # Only deterministic, program-caused outcomes are remembered.
                if fresh[k].status is not Status.SANDBOX_ERROR and job.method is Method.INSTRUCTIONS:
                    _cache[k] = fresh[k]
                    _cache.move_to_end(k)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        known.update(fresh)
    return [known[k] for k in keys]


def _key(job: Job, backend: str) -> str:
    fields = [backend, job.language.value, job.source, job.harness, job.compile_flags, job.bench_stdin, job.method.value,
              [(t.stdin, t.expected_stdout, t.args) for t in job.tests + job.hidden_tests], repr(job.limits)]
    return hashlib.sha256(json.dumps(fields, default=list).encode()).hexdigest()


def _cases(items: Any) -> tuple[TestCase, ...]:
    return tuple(TestCase(stdin=t["stdin"], expected_stdout=t["expected_stdout"], args=tuple(t.get("args") or ()))
                 for t in items or ())


def _rows(n: int, columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    missing = [c for c in ("reference", "tests") if columns.get(c) is None]
    if missing:
        raise ValueError(f"the dataset has no column(s) {missing}; the code speed-up reward needs "
                         "reference, tests, hidden_tests, harness, bench_stdin (see examples/code_speedup.py)")
    return [{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n} for i in range(n)]


_ROW_COLUMNS = ("reference", "harness", "tests", "hidden_tests", "bench_stdin", "language", "compile_flags")


def _judged(completions: list[str], kwargs: dict[str, Any], method: str, backend: str) -> list[Judgement]:
    rows = _rows(len(completions), {c: kwargs.get(c) for c in _ROW_COLUMNS})
    return judge(completions, rows, method=method, backend=backend)


def speedup_reward(
    prompts: list[str],
    completions: list[str],
    max_speedup: float = 100.0,
    correct_bonus: float = 0.2,
    method: str = "instructions",
    backend: str = "process",
    **kwargs: Any,
) -> list[float | Exception]:
    """The reward (see module doc). `backend` is used only when no sandbox pool runs."""
    return [j.error if j.error else 0.0 if j.speedup is None else speedup_to_reward(j.speedup, max_speedup, correct_bonus)
            for j in _judged(completions, kwargs, method, backend)]


def measured_speedup(
    prompts: list[str], completions: list[str], method: str = "instructions", backend: str = "process", **kwargs: Any
) -> list[float | None | Exception]:
    """Measured speed-up of correct programs (None for incorrect ones): log it with weight 0."""
    return [j.error if j.error else j.speedup for j in _judged(completions, kwargs, method, backend)]


def passed_tests(
    prompts: list[str], completions: list[str], method: str = "instructions", backend: str = "process", **kwargs: Any
) -> list[float | Exception]:
    """1 if the program compiled and passed every test, else 0: log it with weight 0."""
    return [j.error if j.error else float(j.result.status is Status.OK) for j in _judged(completions, kwargs, method, backend)]
