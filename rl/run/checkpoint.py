"""A run's lifecycle in one place: its checkpoints found (`find_resume`: the newest, and the config
checked against the saved one), the state the loop starts from (`loop_start`, the only reader of a
checkpoint: step, KL controller, curriculum, rollouts in flight, for a fresh run too; then
`LoopStart.restore_actors`: learner state and engine weights), and saved (`save_step` at a step
boundary; `save`, `latest` on disk).

Run-directory checkpoints are atomic on disk, found again by `latest`, pruned to the newest k.

A checkpoint is `<run>/checkpoints/step_<N>/` holding the learner's own state (written by the
learner into `learner/`), `loop.json` (the next step to run, which is also the policy version,
and the KL controller's and curriculum's states) and, with asynchronous rollouts,
`in_flight.pkl` (the batches already generated for later steps). It is written under a `.tmp`
name and renamed only when complete, and `latest` is replaced atomically after that, so a crash
at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable

from omegaconf import OmegaConf

from rl.algo.kl_control import KL_CONTROLLERS, AdaptiveKLController, FixedKLController, kl_controller_from_dict
from rl.config.schema import AlgorithmConfig, ConfigError, TrainConfig
from rl.data.curriculum import Curriculum

KLController = FixedKLController | AdaptiveKLController


@dataclass(frozen=True)
class LoopState:
    """`loop.json`: the next step to run (also the policy version: the updates so far)."""

    next_step: int
    kl_ctrl: dict | None = None  # the KL controller's state (its coefficient may adapt)
    curriculum: dict | None = None  # the prompt curriculum's state (rl/data/curriculum.py), if any

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> LoopState:
        """A `loop.json`; one written before the policy version was dropped (it always equalled
        `next_step`) still loads."""
        return cls(**{k: v for k, v in saved.items() if k != "policy_version"})


@dataclass(frozen=True)
class LoopStart:
    """Where `run_loop` starts, a fresh run's (step 0) or a resumed one's: made by `loop_start`
    alone, so nothing else unpacks a checkpoint."""

    step: int  # the next step to train; also the policy version (updates so far) the engines need
    kl_ctrl: KLController  # with the coefficient the checkpoint left (fresh: algorithm.kl_ctrl's)
    in_flight: dict[Any, Any]  # rollouts a checkpoint recorded as made ahead or streamed (fresh: none)
    checkpoint: str | None = None  # the checkpoint it came from (fresh: None)

    def restore_actors(self, learner: Any, policy_sync: Any, handover: Any, say: Callable[[str], None]) -> None:
        """A resumed run's actors put back (a fresh run's have nothing to restore): the learner's
        state, and the engines' weights (they started from model.path) synced to this version."""
        if self.checkpoint is None:
            return
        learner.load_checkpoint(os.path.join(self.checkpoint, "learner"))
        handover.to_sync()
        policy_sync.sync(self.step)
        stream = self.in_flight.get("streaming")
        ahead = (f" ({len(stream['ready'])} finished group(s) kept, {len(stream['pending'])} request(s) "
                 "in flight sent again)" if stream else
                 f" ({len(self.in_flight)} batch(es) generated ahead kept)" if self.in_flight else "")
        say(f"Resumed from {self.checkpoint}: next step {self.step + 1}{ahead}")


def loop_start(cfg: TrainConfig, found: tuple[str, LoopState] | None, curriculum: Curriculum | None) -> LoopStart:
    """The loop's state to start from: `found` (`find_resume`'s or `latest`'s checkpoint) put
    back, or a fresh run's (None). The curriculum (`data.curriculum`) gets its saved state, so the
    resumed run draws the prompts the uninterrupted one would; rollouts in flight resume only in
    the mode that recorded them."""
    if found is None:
        if curriculum is not None:  # a restart from step 1 after a failure: the stream from its start too
            curriculum.reset()
        return LoopStart(0, _new_kl_controller(cfg.algorithm), {})
    path, state = found
    in_flight = load_in_flight(path)
    check_in_flight_mode(in_flight, cfg.rollout.mode == "streaming")
    if curriculum is not None and state.curriculum is not None:
        curriculum.load(state.curriculum)
    elif curriculum is not None:  # a checkpoint of a run without one
        curriculum.reset()
    kl_ctrl = kl_controller_from_dict(state.kl_ctrl) if state.kl_ctrl else _new_kl_controller(cfg.algorithm)
    return LoopStart(state.next_step, kl_ctrl, in_flight, path)


def _new_kl_controller(a: AlgorithmConfig) -> KLController:
    """The controller algorithm.kl_ctrl names, built from the settings its registration declares."""
    return KL_CONTROLLERS.get(a.kl_ctrl)(**KL_CONTROLLERS.settings(a.kl_ctrl, a))


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
        return path, LoopState.from_json(json.load(f))


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


# Keys that may change when a run is resumed (extend it with more steps, watch it differently,
# let it survive more faults); every other one must equal the saved run's. Those not given again
# on the resuming command line keep their saved values.
RESUMABLE_CHANGES = ("run.steps", "run.resume", "run.progress", "run.save_every", "run.keep_checkpoints",
                     "run.max_restarts", "run.call_timeout_s", "run.call_timeout_factor", "run.start_timeout_s",
                     "rollout.max_restarts", "rollout.max_retries", "sandbox.max_retries", "reward.max_failed_steps")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def find_resume(cfg: Any, overrides: list[str] | None = None) -> tuple[str, LoopState]:
    """`run.resume=true`: the run's newest checkpoint, once its config is checked to be the saved
    one (ConfigError naming what differs). `overrides` (the command line's): a resumable key not
    among them takes its saved value (a run saved every 5 steps keeps saving every 5); None: take
    `cfg` (an OmegaConf config) as it is."""
    saved_path = os.path.join(cfg.run.dir, "config.yaml")
    found = latest(cfg.run.dir)
    if found is None or not os.path.exists(saved_path):
        raise ConfigError(f"run.resume=true but run.dir={cfg.run.dir} holds no checkpoint to resume from")
    saved = _flat(OmegaConf.to_container(OmegaConf.load(saved_path)))
    if overrides is not None:
        given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
        for key in RESUMABLE_CHANGES:
            if key not in given and key != "run.resume" and key in saved:
                OmegaConf.update(cfg, key, saved[key])
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise ConfigError(
            "run.resume=true with a config that differs from the saved run in: "
            + ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in changed)
            + f"; pass the original overrides again (see {saved_path}). Only {', '.join(RESUMABLE_CHANGES)} may change"
        )
    if found[1].next_step >= cfg.run.steps:
        raise ConfigError(f"run.steps={cfg.run.steps}: the run already finished step {found[1].next_step}; "
                          "raise run.steps to train further")
    return found


def check_in_flight_mode(in_flight: dict | None, streaming: bool) -> None:
    """Rollouts in flight resume only in the mode that recorded them."""
    if in_flight and streaming != ("streaming" in in_flight):
        was = "streaming" if "streaming" in in_flight else "batch"
        raise ValueError(f"the checkpoint holds rollouts in flight of rollout.mode={was}: resume it with "
                         f"rollout.mode={was}")


def due(run: Any, done: int) -> bool:
    """A checkpoint after `done` steps: every `run.save_every` steps and after the last (0: none)."""
    return bool(run.save_every) and (done % run.save_every == 0 or done == run.steps)


def save_step(run_dir: str, next_step: int, kl_ctrl: KLController, curriculum: Curriculum | None, learner: Any,
              rollouts: Any, handover: Any, keep: int, with_in_flight: bool = True) -> str:
    """The checkpoint at a step boundary (the policy version is the step): the learner's state
    (resident for it, when the GPU is shared), the KL controller's and the curriculum's, and the
    rollouts in flight (`with_in_flight=False`: the fleet is broken, so batches made ahead are
    made again on resume)."""
    state = LoopState(next_step, kl_ctrl.to_dict(), curriculum.to_dict() if curriculum is not None else None)
    ahead = rollouts.in_flight(whole=with_in_flight)
    with handover.learner_resident() if with_in_flight else nullcontext():
        return save(run_dir, state, learner.save_checkpoint, keep, in_flight=ahead)
