"""Multi-turn verifiers environments, unchanged: `verifiers_multiturn/` holds verifiers `v1` tasksets
packaged as their authors package them (`pyproject.toml`; installed into .venv-verifiers by
`bash launch/agent_env.sh verifiers examples/verifiers_multiturn`): `verifiers_multiturn`, sums a
user asks for one at a time (played with verifiers' `user-sim` env: `task.agent_kwargs.env_id:
user-sim`, the user's model in `env_args.user`), and `verifiers_calculator`, expressions worked
out with a calculator tool its task serves over MCP. This module only writes the rows that say
which task each episode plays.
"""

from __future__ import annotations

from pathlib import Path

from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/verifiers_multiturn"


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, n_train: int = 1000) -> list[str]:
    """OUT/data/train.jsonl: one row per episode, its `task_index` the taskset's task it plays (the
    taskset's own `n`, 1000 by default, must be at least `n_train`; the row's `prompt` only names
    the task: the model's prompt is the conversation). `seed` is the builders' common argument:
    the taskset draws its sums with its own seed."""
    rows = ({"prompt": f"verifiers_multiturn task {i}", "task_index": i} for i in range(n_train))
    return [write_jsonl(Path(out_dir) / "data" / "train.jsonl", rows)]
