"""Compile, test and benchmark one `Job` in a box of any backend, and judge it into a `Result`.

Every step runs inside the sandbox, the compiler included. Tests stop at the first failure
(the remaining ones cannot turn a failure into a pass). The benchmark runs only for programs
that passed every test, on `job.bench_stdin`, with `job.method`:
- `instructions`: one run under callgrind; the count is deterministic for the same binary,
  input and environment, so it is the same under load and across machines of one kind.
- `cpu_time`: min over `job.repeats` runs of user+sys CPU seconds; `spread` says how noisy.

A measured run is judged like a test: it must finish the harness and, given
`job.bench_expected_stdout`, print exactly that (every repeat), so a program that notices it is
measured (valgrind in its maps, a bigger input) cannot skip the work. Without an expectation its
output is recorded in `Result.bench_stdout`. Every measured run also starts from the work dir as
built: whatever a test run or an earlier repeat left there (a cached answer, a precomputed
table) is deleted first, and a build output it changed (`prog`, a Python source) is a runtime error.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import replace

from sandbox.backend import Backend, Box
from sandbox.job import ExecOutcome, Job, Language, Limits, Measurement, Method, Result, Status

TAIL_CHARS = 2000
# callgrind writes its report into the work dir at exit; a random name keeps the program from
# planting or removing it in advance.
CALLGRIND_PREFIX = ".callgrind-"
# callgrind runs ~50x slower than native and needs room for its own tables.
VALGRIND_SLOWDOWN = 60.0
VALGRIND_EXTRA_MB = 512
_TOTAL = re.compile(rb"^(?:summary|totals):\s*(\d+)", re.MULTILINE)

# Run inside the box before every measured run: deletes everything in the work dir but the build
# outputs named in argv (with their sha256), checks those are what was built, then execs the rest
# of argv, if any (so under callgrind the reset costs no sandbox run of its own and no counted
# instruction; ~20 ms). `python3 -I -S` imports nothing from the work dir. A failure is reported
# on stderr behind argv[1], a random tag the program cannot know: it runs only after the check.
_RESET_WORKDIR = r"""
import hashlib, os, stat, sys
def fail(why):
    sys.stderr.write(sys.argv[1] + why + "\n")
    sys.stderr.flush()
    os._exit(2)
cut = sys.argv.index("--")
keep = dict(zip(sys.argv[2:cut:2], sys.argv[3:cut:2]))
try:
    os.chmod(os.getcwd(), 0o700)
    todo, dirs = [n for n in os.listdir(".") if n not in keep], []
    while todo:
        path = todo.pop()
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, 0o700)
            dirs.append(path)
            todo += [os.path.join(path, n) for n in os.listdir(path)]
        else:
            os.unlink(path)
    for path in reversed(dirs):
        os.rmdir(path)
    for name, digest in keep.items():
        if not stat.S_ISREG(os.lstat(name).st_mode):
            fail(name + " is no longer the file built")
        os.chmod(name, 0o700)
        with open(name, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                fail(name + " was changed after it was built")
except OSError as e:
    fail(type(e).__name__ + ": " + str(e))
if sys.argv[cut + 1:]:
    os.execvp(sys.argv[cut + 1], sys.argv[cut + 1:])
"""
_RESET_LIMITS = Limits(wall_s=10.0, cpu_s=5.0, memory_mb=256)

_SOURCE_NAME = {Language.C: "solution.c", Language.CPP: "solution.cpp", Language.PYTHON: "solution.py"}
_HARNESS_NAME = {Language.C: "harness.c", Language.CPP: "harness.cpp", Language.PYTHON: "main.py"}
_COMPILER = {Language.C: "gcc", Language.CPP: "g++"}


def run_job(job: Job, backend: Backend) -> Result:
    """The judged result of one job. A failure of the sandbox machinery itself (not of the
    program) becomes `sandbox_error` with the reason, so callers never mistake it for a zero."""
    try:
        with backend.box() as box:
            result = _judge(job, box)
    except Exception as exc:  # noqa: BLE001 - reported as sandbox_error, never swallowed silently
        result = Result(Status.SANDBOX_ERROR, detail=f"{type(exc).__name__}: {exc}")
    result.backend = backend.name
    return result


def program_argv(language: Language, has_harness: bool) -> list[str]:
    """How the built program is started inside the box."""
    if language is Language.PYTHON:
        # -E -s: ignore PYTHON* env vars and user site-packages; -B: no .pyc writes.
        return ["python3", "-E", "-s", "-B", _HARNESS_NAME[language] if has_harness else _SOURCE_NAME[language]]
    return ["./prog"]


def _judge(job: Job, box: Box) -> Result:
    language = Language(job.language)
    box.write(_SOURCE_NAME[language], job.source.encode())
    if job.harness is not None:
        box.write(_HARNESS_NAME[language], job.harness.encode())

    started = time.monotonic()
    failure = _compile(job, language, box)
    compile_s = time.monotonic() - started
    if failure is not None:
        failure.compile_s = compile_s
        return failure

    argv = program_argv(language, job.harness is not None)
    # What the measured runs use, as built: taken before any test run could change it.
    built = _built_files(job, language, box) if job.bench_stdin is not None else {}
    tests = [(t, False) for t in job.tests] + [(t, True) for t in job.hidden_tests]
    started = time.monotonic()
    last: ExecOutcome | None = None
    for i, (test, hidden) in enumerate(tests):
        last = box.run(argv + list(test.args), _stdin(job, test.stdin), job.limits)
        label = f"test {i + 1} of {len(tests)}{' (hidden)' if hidden else ''}"
        failure, _ = _check(job, last, label, test.expected_stdout)
        if failure is not None:
            failure.tests_passed, failure.tests_total = i, len(tests)
            failure.compile_s, failure.run_s = compile_s, time.monotonic() - started
            return failure
    run_s = time.monotonic() - started

    result = Result(Status.OK, tests_passed=len(tests), tests_total=len(tests), compile_s=compile_s, run_s=run_s)
    if last is not None:
        result.stdout_tail, result.stderr_tail = _tail(last.stdout), _tail(last.stderr)
    if job.bench_stdin is not None:
        measured = _benchmark(job, box, argv, built)
        if isinstance(measured, Result):
            measured.tests_passed, measured.tests_total = result.tests_passed, result.tests_total
            measured.compile_s, measured.run_s = compile_s, run_s
            return measured
        result.measurement, output = measured
        if job.bench_expected_stdout is None:
            result.bench_stdout = output
    return result


def _compile(job: Job, language: Language, box: Box) -> Result | None:
    if language is Language.PYTHON:
        files = [_SOURCE_NAME[language]] + ([_HARNESS_NAME[language]] if job.harness is not None else [])
        argv = ["python3", "-E", "-s", "-c",
                "import ast,sys\nfor f in sys.argv[1:]: ast.parse(open(f).read(), f)", *files]
    else:
        sources = ([_HARNESS_NAME[language]] if job.harness is not None else []) + [_SOURCE_NAME[language]]
        argv = [_COMPILER[language], *job.compile_flags, "-o", "prog", *sources]
        if language is Language.C:
            argv.append("-lm")
    out = box.run(argv, b"", job.compile_limits)
    if out.exit_code == 0 and not (out.timed_out or out.memory_exceeded or out.output_exceeded):
        return None
    why = "compiler timed out" if out.timed_out else "compiler ran out of memory" if out.memory_exceeded else (
        "compiler output over the limit" if out.output_exceeded else f"exit code {out.exit_code}")
    return Result(Status.COMPILE_ERROR, detail=why, stdout_tail=_tail(out.stdout), stderr_tail=_tail(out.stderr))


def _stdin(job: Job, text: str) -> bytes:
    if job.sentinel is None:
        return text.encode()
    sep = "" if not text or text.endswith("\n") else "\n"
    return f"{text}{sep}{job.sentinel}\n".encode()


def _check(job: Job, out: ExecOutcome, label: str, expected: str | None) -> tuple[Result | None, str]:
    """(None when the run passed, else the failing Result with a one-line reason; the program's
    output, normalised, without the end marker). `expected` None: any output passes."""
    status, why = _run_status(out)
    stdout = out.stdout.decode(errors="replace")
    if status is Status.OK and job.sentinel is not None:
        lines = normalize_output(stdout).split("\n")
        if not lines or lines[-1] != job.sentinel:
            status, why = Status.RUNTIME_ERROR, "exited before the harness finished (no end marker)"
        else:
            stdout = "\n".join(lines[:-1])
    got = normalize_output(stdout)
    if status is Status.OK and expected is not None:
        want = normalize_output(expected)
        if got != want:
            status, why = Status.WRONG_ANSWER, f"expected {_short(want)}, got {_short(got)}"
    if status is Status.OK:
        return None, got
    return Result(status, detail=f"{label}: {why}", stdout_tail=_tail(out.stdout), stderr_tail=_tail(out.stderr)), got


def _run_status(out: ExecOutcome) -> tuple[Status, str]:
    if out.output_exceeded:
        return Status.OUTPUT_LIMIT, "output over the limit"
    if out.memory_exceeded:
        return Status.MEMORY_LIMIT, "memory limit exceeded"
    if out.timed_out:
        return Status.TIMEOUT, "time limit exceeded"
    if out.process_limit_hit:
        return Status.RUNTIME_ERROR, "tried to create a process (not allowed)"
    if out.violation:
        return Status.RUNTIME_ERROR, f"forbidden operation ({out.violation})"
    if out.signal is not None:
        return Status.RUNTIME_ERROR, f"killed by signal {out.signal}"
    if out.exit_code != 0:
        return Status.RUNTIME_ERROR, f"exit code {out.exit_code}"
    return Status.OK, ""


def _built_files(job: Job, language: Language, box: Box) -> dict[str, str]:
    """name -> sha256 of each file the program's runs use (the binary, or the Python sources)."""
    if language is Language.PYTHON:
        files = {_SOURCE_NAME[language]: job.source.encode()}
        if job.harness is not None:
            files[_HARNESS_NAME[language]] = job.harness.encode()
    else:
        prog = box.read("prog", job.compile_limits.file_bytes)
        if prog is None:
            raise RuntimeError("the compiler succeeded but left no ./prog")
        files = {"prog": prog}
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _reset_argv(built: dict[str, str], tag: str, then: list[str]) -> list[str]:
    return ["python3", "-I", "-S", "-c", _RESET_WORKDIR, tag, *(x for kv in built.items() for x in kv), "--", *then]


def _reset_failure(out: ExecOutcome, tag: str, label: str) -> Result | None:
    """The runtime error of a measured run whose work dir could not be reset to what was built."""
    head = out.stderr.decode(errors="replace")
    if not head.startswith(tag):
        return None
    why = head[len(tag):].split("\n", 1)[0]
    return Result(Status.RUNTIME_ERROR, detail=f"{label}: the work dir could not be reset to what was built ({why})",
                  stderr_tail=_tail(out.stderr))


def _benchmark(job: Job, box: Box, argv: list[str], built: dict[str, str]) -> tuple[Measurement, str] | Result:
    """(measurement, the program's output) or the failing Result. Every measured run must print
    `job.bench_expected_stdout` if given, else what the first repeat printed."""
    stdin = _stdin(job, job.bench_stdin or "")
    expected = job.bench_expected_stdout
    tag = f"reset-{secrets.token_hex(8)}: "
    if Method(job.method) is Method.INSTRUCTIONS:
        limits = job.limits.scaled(VALGRIND_SLOWDOWN)
        limits = replace(limits, memory_mb=limits.memory_mb + VALGRIND_EXTRA_MB)
        report_name = f"{CALLGRIND_PREFIX}{secrets.token_hex(8)}.out"
        # --command-line-only: a .valgrindrc the program planted in its work dir is not read.
        cmd = ["valgrind", "--tool=callgrind", "-q", "--command-line-only=yes", f"--callgrind-out-file={report_name}",
               "--dump-line=no", "--compress-strings=no", *argv]
        out = box.run(_reset_argv(built, tag, cmd), stdin, limits)
        failure = _reset_failure(out, tag, "benchmark run")
        if failure is None:
            failure, output = _check(job, out, "benchmark run", expected)
        if failure is not None:
            return failure
        report = box.read(report_name, 1 << 22)
        match = _TOTAL.search(report or b"")
        if match is None:
            raise RuntimeError(f"callgrind wrote no instruction total (stderr: {_tail(out.stderr, 300)!r})")
        return Measurement(Method.INSTRUCTIONS, float(match.group(1)), "instructions"), output
    # A run of its own resets the work dir before each repeat: its CPU time must not be measured.
    times: list[float] = []
    first: str | None = None
    repeats = max(1, job.repeats)
    reset_limits = replace(_RESET_LIMITS, workdir_mb=job.limits.workdir_mb)
    for i in range(repeats):
        label = "benchmark run" + (f" {i + 1} of {repeats}" if repeats > 1 else "")
        reset = box.run(_reset_argv(built, tag, []), b"", reset_limits)
        failure = _reset_failure(reset, tag, label)
        if failure is not None:
            return failure
        if reset.exit_code != 0:
            raise RuntimeError(f"resetting the work dir failed: {_run_status(reset)[1]} "
                               f"(stderr: {_tail(reset.stderr, 300)!r})")
        out = box.run(argv, stdin, job.limits)
        failure, output = _check(job, out, label, expected if expected is not None else first)
        if failure is not None:
            return failure
        first = output if first is None else first
        times.append(out.cpu_s)
    best = min(times)
    spread = (max(times) - best) / best if best > 0 else 0.0
    assert first is not None
    return Measurement(Method.CPU_TIME, best, "s", runs=len(times), spread=spread), first


def normalize_output(text: str) -> str:
    """Trailing whitespace of every line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.rstrip().split("\n"))


def _short(text: str, n: int = 60) -> str:
    flat = text.replace("\n", "\\n")
    return repr(flat if len(flat) <= n else flat[:n] + "...")


def _tail(data: bytes, n: int = TAIL_CHARS) -> str:
    return data[-n:].decode(errors="replace")


__all__ = ["run_job", "normalize_output", "program_argv", "Limits"]
