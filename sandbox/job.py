"""The data a sandbox takes and gives back: a `Job` in, a `Result` out (plain dataclasses).

A job is one untrusted program plus everything needed to judge it: how to build it, the test
cases it must pass, the limits it runs under and, optionally, an input to benchmark it on.
Nothing here runs anything; backends (`sandbox.process`, `sandbox.docker`) execute commands and
`sandbox.runner` turns their outcomes into a `Result`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class Language(str, enum.Enum):
    C = "c"
    CPP = "cpp"
    PYTHON = "python"


class Status(str, enum.Enum):
    OK = "ok"
    COMPILE_ERROR = "compile_error"
    WRONG_ANSWER = "wrong_answer"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    SANDBOX_ERROR = "sandbox_error"


class Method(str, enum.Enum):
    """How runtime is measured. `instructions`: callgrind instruction count (deterministic);
    `cpu_time`: min over k runs of user+sys CPU seconds, with the spread reported."""

    INSTRUCTIONS = "instructions"
    CPU_TIME = "cpu_time"


@dataclass(frozen=True)
class Limits:
    """Per-command limits. Memory is the address-space and cgroup cap (swap included)."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 256
    processes: int = 1            # tasks (processes + threads) the program itself may have
    output_bytes: int = 1 << 20   # stdout and stderr, each
    file_bytes: int = 16 << 20    # largest file the program may write (RLIMIT_FSIZE)
    open_files: int = 64
    workdir_mb: int = 64          # size cap of the per-run tmpfs work dir

    def scaled(self, factor: float) -> "Limits":
        """The same limits with wall and CPU time multiplied (e.g. for a run under valgrind)."""
        return Limits(**{**asdict(self), "wall_s": self.wall_s * factor, "cpu_s": self.cpu_s * factor})


# Compilers fork (cc1, as, ld) and need more memory than the programs they build.
COMPILE_LIMITS = Limits(wall_s=30.0, cpu_s=20.0, memory_mb=1024, processes=32, output_bytes=64 << 10,
                        file_bytes=64 << 20)


@dataclass(frozen=True)
class TestCase:
    """Feed `stdin` (and `args`) to the program; its stdout must equal `expected_stdout`
    after trailing whitespace is stripped from every line and from the end."""

    __test__ = False  # not a pytest test class

    stdin: str = ""
    expected_stdout: str = ""
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Job:
    """One untrusted program to build, test and (optionally) benchmark.

    `harness`: optional trusted source built together with `source` (C/C++: another translation
    unit holding `main`; Python: the main script, which imports the candidate as module
    `solution`). A harness must print `sentinel` as its last line after reading all input; a run
    whose output does not end with it exited early and is a runtime error.
    `bench_stdin`: the input measured by `method`; None skips benchmarking.
    `bench_expected_stdout`: what every measured run must print on `bench_stdin` (compared like a
    test's expected output); a run that prints anything else is a wrong answer, so a program
    cannot skip its work when it notices it is being measured. None: the output is not checked
    but recorded in `Result.bench_stdout` (run the reference that way to learn it).
    """

    language: Language
    source: str
    tests: tuple[TestCase, ...] = ()
    hidden_tests: tuple[TestCase, ...] = ()
    harness: str | None = None
    sentinel: str | None = None
    compile_flags: tuple[str, ...] = ("-O2",)
    limits: Limits = Limits()
    compile_limits: Limits = COMPILE_LIMITS
    bench_stdin: str | None = None
    method: Method = Method.INSTRUCTIONS
    repeats: int = 5              # runs for cpu_time (min is reported); instructions runs once
    name: str = ""
    bench_expected_stdout: str | None = None


@dataclass(frozen=True)
class Measurement:
    """Measured cost of the benchmark run. `value` is in `unit` (instructions or seconds);
    `spread` = (max - min) / min over `runs` runs (0 for a deterministic count)."""

    method: Method
    value: float
    unit: str
    runs: int = 1
    spread: float = 0.0


@dataclass
class Result:
    status: Status
    detail: str = ""              # why, in one line (e.g. "test 3 of 5 (hidden): expected 6, got 7")
    tests_passed: int = 0
    tests_total: int = 0
    stdout_tail: str = ""
    stderr_tail: str = ""
    compile_s: float = 0.0
    run_s: float = 0.0            # wall seconds spent running tests
    measurement: Measurement | None = None
    backend: str = ""
    # The benchmark run's output (end marker removed, normalised as tests compare it), recorded
    # for a job that gave no `bench_expected_stdout`; None otherwise.
    bench_stdout: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        if self.measurement is not None:
            d["measurement"]["method"] = self.measurement.method.value
        return d


@dataclass
class ExecOutcome:
    """What a backend reports for one command run inside the sandbox (before any judging)."""

    exit_code: int | None         # None when killed by a signal
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    wall_s: float = 0.0
    cpu_s: float = 0.0            # user + sys of everything the command ran
    timed_out: bool = False       # wall or CPU limit
    memory_exceeded: bool = False
    output_exceeded: bool = False  # stdout/stderr over limits.output_bytes or a file over file_bytes
    process_limit_hit: bool = False  # tried to create more tasks than limits.processes
    violation: str = ""           # e.g. "seccomp: socket" when a forbidden syscall killed it

