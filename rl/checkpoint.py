"""Run-directory checkpoints: atomic on disk, found again by `latest`, pruned to the newest k.

A checkpoint is `<run>/checkpoints/step_<N>/` holding the learner's own state (written by the
learner into `learner/`) and `loop.json` (the next step to run and the policy version). It is
written under a `.tmp` name and renamed only when complete, and `latest` is replaced atomically
after that, so a crash at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(frozen=True)
class LoopState:
    next_step: int
    policy_version: int
    kl_ctrl: dict | None = None  # the KL controller's state (its coefficient may adapt)


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_dir: str, state: LoopState, save_learner: Callable[[str], None], keep: int = 2) -> str:
    """Write a checkpoint; `save_learner(dir)` writes the learner's state into `dir`."""
    root = checkpoint_root(run_dir)
    name = f"step_{state.next_step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_learner(os.path.join(tmp, "learner"))
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
