"""A verifiers environment, unchanged: `verifiers_sum/` is a verifiers `v1` taskset packaged as its
authors package one (`pyproject.toml`; installed into .venv-verifiers by
`bash launch/agent_env.sh verifiers examples/verifiers_sum`). `task=verifiers_sum` plays its tasks
through `reward.agents.verifiers` in that virtual environment; this module only writes the rows
that say which task each episode plays.
"""

from __future__ import annotations

from pathlib import Path

from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/verifiers_sum"


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, n_train: int = 2000) -> list[str]:
    """OUT/data/train.jsonl: one row per episode, its `task_index` the taskset's task it plays (the
    model's prompt comes from the task, the row's `prompt` only names it; the taskset's own `n`,
    2000 by default, must be at least `n_train`). `seed` is the builders' common argument: the
    taskset draws its sums with its own seed."""
    rows = ({"prompt": f"verifiers_sum task {i}", "task_index": i} for i in range(n_train))
    return [write_jsonl(Path(out_dir) / "data" / "train.jsonl", rows)]
