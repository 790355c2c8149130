"""Run-directory checkpoints: atomic on disk, found again by `latest`, pruned to the newest k.

A checkpoint is `<run>/checkpoints/step_<N>/` holding the learner's own state (written by the
learner into `learner/`), `loop.json` (the next step to run and the policy version) and, with
asynchronous rollouts, `in_flight.pkl` (the batches already generated for later steps). It is
written under a `.tmp` name and renamed only when complete, and `latest` is replaced atomically
after that, so a crash at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class LoopState:
    next_step: int
    policy_version: int
    kl_ctrl: dict | None = None  # the KL controller's state (its coefficient may adapt)
    curriculum: dict | None = None  # the prompt curriculum's state (rl/data/curriculum.py), if any


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_dir: str, state: LoopState, save_learner: Callable[[str], None], keep: int = 2,
         in_flight: dict[int, Any] | None = None) -> str:
    """Write a checkpoint; `save_learner(dir)` writes the learner's state into `dir`; `in_flight`
    (batches made ahead, by step) is pickled beside it."""
    root = checkpoint_root(run_dir)
    name = f"step_{state.next_step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_learner(os.path.join(tmp, "learner"))
    if in_flight:
        with open(os.path.join(tmp, "in_flight.pkl"), "wb") as f:
            pickle.dump(in_flight, f)
    _write_atomic(os.path.join(tmp, "loop.json"), json.dumps(asdict(state)))
    shutil.rmtree(final, ignore_errors=True)  # a same-step checkpoint from an earlier attempt
    os.replace(tmp, final)
    _write_atomic(os.path.join(root, "latest"), name)
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def latest(run_dir: str) -> tuple[str, LoopState] | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = os.path.join(checkpoint_root(run_dir), "latest")
    if not os.path.exists(pointer):
        return None
    path = os.path.join(checkpoint_root(run_dir), open(pointer).read().strip())
    with open(os.path.join(path, "loop.json")) as f:
        return path, LoopState(**json.load(f))


def load_in_flight(path: str) -> dict[int, Any]:
    """The batches a checkpoint recorded as generated ahead (empty without asynchronous rollouts).
    Unpickled: only ever this run's own file."""
    file = os.path.join(path, "in_flight.pkl")
    if not os.path.exists(file):
        return {}
    with open(file, "rb") as f:
        return _Unpickler(f).load()


# Where the classes a checkpoint of an earlier layout pickled live now (rl/ was flat before it got
# sub-packages): a run checkpointed before the move resumes after it.
MOVED_MODULES = {"rl.types": "rl.data.types", "rl.episodes": "rl.data.episodes", "rl.batch": "rl.data.batch",
                 "rl.data": "rl.data.dataset", "rl.env": "rl.data.env", "rl.tools": "rl.data.tools"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)
