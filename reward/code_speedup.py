"""The code speed-up reward: compile, test and benchmark each completion in the sandbox.

Dataset columns (one row per problem, see examples/code_speedup.py): `reference` (the slow correct
program), `harness` (trusted `main` built with the candidate, or None), `tests` and
`hidden_tests` (lists of {stdin, expected_stdout}), `bench_stdin`, `language`, `compile_flags`.

Reward of a completion:
- 0 if it fails to compile, fails any visible or hidden test, exceeds a limit, tries something
  the sandbox forbids (a process, a socket) or exits before the harness finishes;
- 0 if its measured (benchmark) run does not print what the reference's printed on the same
  input: a program that notices it is measured cannot skip the work there;
- else `clip(correct_bonus + (1 - correct_bonus) * ln(speedup) / ln(max_speedup), 0, 1)`, where
  speedup = cost(reference) / cost(candidate), both measured by the same method on the same
  input in the same kind of sandbox. A copy of the reference scores `correct_bonus`.
- a sandbox failure (not the program's fault) is an error for that sample, never a 0; so is a
  reference that fails, or prints nothing on the benchmark input (nothing to check against).

The reference of a problem seen for the first time runs before its candidates (their jobs carry
its benchmark output as `bench_expected_stdout`); later calls know that output and run
candidates and references together.

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
# reference job key -> what the reference printed on the benchmark input (under _cache_lock)
_bench_outputs: OrderedDict[str, str] = OrderedDict()


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


def make_job(source: str, row: dict[str, Any], method: str = "instructions", name: str = "",
             bench_expected_stdout: str | None = None) -> Job:
    """The sandbox job for `source` on the problem described by dataset `row`; a candidate's
    `bench_expected_stdout` is the reference's benchmark output."""
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
        bench_expected_stdout=bench_expected_stdout,
    )


def judge(
    completions: list[str],
    rows: list[dict[str, Any]],
    method: str = "instructions",
    backend: str = "process",
) -> list[Judgement]:
    """Judge every completion against its row's reference, running each distinct job once."""
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions for {len(rows)} rows")
    settings = SandboxSettings(backend=backend)
    refs = [make_job(row["reference"], row, method, name="reference") for row in rows]
    keys = [_key(job, backend) for job in refs]
    # A problem seen for the first time: its reference runs first, for the benchmark output its
    # candidates must print (and, under instructions, is then memoised like any job).
    with _cache_lock:
        unseen = {k: job for k, job in zip(keys, refs) if k not in _bench_outputs}
    early = dict(zip(unseen, _run_memoised(list(unseen.values()), settings)))
    with _cache_lock:
        for k, res in early.items():
            if res.status is Status.OK and res.bench_stdout:
                _bench_outputs[k] = res.bench_stdout
        for k in keys:
            if k in _bench_outputs:
                _bench_outputs.move_to_end(k)
        while len(_bench_outputs) > _CACHE_SIZE:
            _bench_outputs.popitem(last=False)
        expected = [_bench_outputs.get(k) for k in keys]
    # Candidates of a reference that failed or printed nothing are not run: that is an error. A
    # copy of the reference is not run either: the reference's own result is its result.
    cand_at = [i for i, e in enumerate(expected) if e is not None and completions[i] != rows[i]["reference"]]
    ref_at = [i for i, k in enumerate(keys) if k not in early]
    jobs = [make_job(completions[i], rows[i], method, name="candidate", bench_expected_stdout=expected[i])
            for i in cand_at]
    results = _run_memoised(jobs + [refs[i] for i in ref_at], settings)
    ref = {i: early[k] for i, k in enumerate(keys) if k in early} | dict(zip(ref_at, results[len(jobs):]))
    cand = {i: ref[i] for i, e in enumerate(expected) if e is not None} | dict(zip(cand_at, results[: len(jobs)]))
    return [_compare(cand.get(i), ref[i], expected[i]) for i in range(len(rows))]


def _compare(cand: Result | None, ref: Result, expected: str | None) -> Judgement:
    if ref.status is not Status.OK or ref.measurement is None:
        why = ref.detail or ref.status.value
        return _error(cand, f"the reference solution did not pass: {ref.status.value}: {why}")
    if expected is None:
        return _error(cand, "the reference printed nothing on the benchmark input (bench_stdin): "
                            "a candidate's benchmark run could not be checked")
    if ref.bench_stdout is not None and ref.bench_stdout != expected:
        return _error(cand, "the reference printed something else on the benchmark input than in an earlier run")
    assert cand is not None  # run whenever the reference's benchmark output is known
    if cand.status is Status.SANDBOX_ERROR:
        return Judgement(cand, error=SandboxFailure(cand.detail))
    if cand.status is not Status.OK:
        return Judgement(cand)
    assert cand.measurement is not None  # ok + bench_stdin always measures
    if cand.measurement.method != ref.measurement.method:
        return Judgement(cand, error=SandboxFailure("candidate and reference measured by different methods"))
    return Judgement(cand, speedup=ref.measurement.value / max(cand.measurement.value, 1e-12))


def _error(cand: Result | None, why: str) -> Judgement:
    return Judgement(cand or Result(Status.SANDBOX_ERROR, detail=f"not run: {why}"), error=SandboxFailure(why))


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
              [(t.stdin, t.expected_stdout, t.args) for t in job.tests + job.hidden_tests], repr(job.limits),
              job.bench_expected_stdout]
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
