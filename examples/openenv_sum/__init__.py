"""A sum-guessing environment written with OpenEnv's own base classes, as its authors would write
it for any OpenEnv trainer: `models.py` (its Action and Observation), `server.py` (its
`Environment` and the FastAPI app openenv-core makes of it: `uvicorn examples.openenv_sum.server:app`)
and `client.py` (its `EnvClient`). Nothing here knows about this trainer; `task=openenv_sum` trains
it through `reward.agents.openenv` in the OpenEnv virtual environment (`launch/agent_env.sh openenv`).
"""

from __future__ import annotations

from pathlib import Path

from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/openenv_sum"
PROMPT = "Answer with just the number."


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, n_train: int = 2000) -> list[str]:
    """OUT/data/train.jsonl: one row per episode, its `seed` the environment's reset seed (the
    question comes from the environment, the prompt is the instruction before it)."""
    rows = ({"prompt": PROMPT, "seed": seed * 1_000_000 + i} for i in range(n_train))
    return [write_jsonl(Path(out_dir) / "data" / "train.jsonl", rows)]
