"""The run's lifecycle pieces the loop calls (rl/run/checkpoint.py, rl/run/guards.py), with
hand-computed cases: when a checkpoint is due, which mode resumes rollouts in flight, when and
why a run stops at a step boundary, a checkpoint found again with its config checked, and the
state a run starts from (`loop_start`) equal to the one its checkpoint saved."""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rl.algo.kl_control import AdaptiveKLController, FixedKLController
from rl.config.schema import ConfigError, TrainConfig
from rl.data.curriculum import Curriculum
from rl.data.types import Sample, ScoredSample
from rl.run import checkpoint
from rl.actors.faults import NotLearning, RewardsFailing, RunStopped, StopRequest
from rl.run.guards import StopGuards


def test_a_checkpoint_is_due_every_save_every_steps_and_after_the_last():
    run = SimpleNamespace(save_every=3, steps=7)
    assert [d for d in range(1, 8) if checkpoint.due(run, d)] == [3, 6, 7]
    assert not any(checkpoint.due(SimpleNamespace(save_every=0, steps=7), d) for d in range(1, 8))


def test_rollouts_in_flight_resume_only_in_the_mode_that_recorded_them():
    checkpoint.check_in_flight_mode({}, streaming=True)  # nothing in flight: any mode
    checkpoint.check_in_flight_mode({3: "batch"}, streaming=False)
    checkpoint.check_in_flight_mode({"streaming": {}}, streaming=True)
    with pytest.raises(ValueError, match="rollout.mode=streaming: resume it with rollout.mode=streaming"):
        checkpoint.check_in_flight_mode({"streaming": {}}, streaming=False)
    with pytest.raises(ValueError, match="resume it with rollout.mode=batch"):
        checkpoint.check_in_flight_mode({3: "batch"}, streaming=True)


def _cfg(steps=10, max_failed=3, max_skipped=2):
    return SimpleNamespace(reward=SimpleNamespace(max_failed_steps=max_failed),
                           trainer=SimpleNamespace(max_skipped_steps=max_skipped), run=SimpleNamespace(steps=steps))


def _scored(error: str | None) -> list[ScoredSample]:
    sample = Sample([1], [2], [-0.1], "stop", 0, "", "x", 0, 0)
    return [ScoredSample(sample, 0.0 if error is None else None, {}, error)]


def test_guards_stop_on_failing_rewards_skipped_updates_and_signals_in_a_row_only():
    guards = StopGuards(_cfg(), None)
    ok = {"actor/updates_count": 1.0, "actor/skipped_updates_count": 0.0, "actor/grad_norm": 0.5, "reward/mean": 0.25}
    skipped = {"actor/updates_count": 2.0, "actor/skipped_updates_count": 2.0}
    guards.record(ok, _scored("boom"))
    guards.record(ok, _scored("boom"))
    guards.record(ok, _scored(None))  # a good step breaks the run of failing ones
    assert guards.stopping(3) is None
    for done in (4, 5):
        guards.record(ok, _scored(f"bad {done}"))
    assert guards.stopping(5) is None
    guards.record(ok, _scored("bad 6"))
    failing = guards.stopping(6)
    assert isinstance(failing, RewardsFailing) and "bad 4" in str(failing)

    guards = StopGuards(_cfg(), None)
    guards.record(ok, _scored(None))
    half = {**skipped, "actor/skipped_updates_count": 1.0, "actor/grad_norm": 0.75, "reward/mean": 0.5}
    guards.record(half, _scored(None))  # 1 of 2 updates applied: still learning
    guards.record(skipped, _scored(None))
    assert guards.stopping(3) is None
    guards.record(skipped, _scored(None))
    stopped = guards.stopping(4)
    assert isinstance(stopped, NotLearning) and "max_skipped_steps=2" in str(stopped)
    assert "actor/grad_norm 0.75, reward/mean 0.5" in str(stopped)  # the last step that learned

    stop = StopRequest()
    guards = StopGuards(_cfg(steps=4), stop)
    guards.record(ok, _scored(None))
    assert guards.stopping(1) is None
    stop.reason = "SIGTERM"
    assert isinstance(guards.stopping(2), RunStopped)
    assert guards.stopping(4) is None  # the last step: the run is done, not stopped


def test_a_resumed_run_finds_its_checkpoint_and_refuses_a_changed_config(tmp_path):
    run_dir = tmp_path / "run"
    saved = OmegaConf.create({"run": {"dir": str(run_dir), "steps": 4, "save_every": 5, "resume": False},
                              "algorithm": {"lr": 1e-5}})
    run_dir.mkdir()
    OmegaConf.save(saved, run_dir / "config.yaml")
    resumed = OmegaConf.create({"run": {"dir": str(run_dir), "steps": 8, "save_every": 2, "resume": True},
                                "algorithm": {"lr": 1e-5}})
    with pytest.raises(ConfigError, match="holds no checkpoint to resume from"):
        checkpoint.find_resume(resumed)
    checkpoint.save(str(run_dir), checkpoint.LoopState(2), lambda d: None)
    path, state = checkpoint.find_resume(resumed, overrides=["run.resume=true", "run.steps=8"])
    assert state.next_step == 2 and path.endswith("step_000002")
    assert resumed.run.save_every == 5  # not given again: the saved value holds
    changed = OmegaConf.merge(resumed, {"algorithm": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"algorithm.lr \(1e-05 -> 0.1\)"):
        checkpoint.find_resume(changed)
    with pytest.raises(ConfigError, match="already finished step 2"):
        checkpoint.find_resume(OmegaConf.merge(resumed, {"run": {"steps": 2}}))


class _Actors:
    """The learner, the weight sync and the GPU hand-over, recording what a save and a resume did."""

    def __init__(self):
        self.calls: list[tuple] = []

    def save_checkpoint(self, path):  # the learner
        os.makedirs(path)
        self.calls.append(("save", os.path.basename(path)))

    def load_checkpoint(self, path):
        self.calls.append(("load", os.path.relpath(path, os.path.dirname(os.path.dirname(path)))))

    def sync(self, version):  # the weight sync
        self.calls.append(("sync", version))

    def to_sync(self):  # the hand-over
        self.calls.append(("to_sync",))

    def learner_resident(self):
        return nullcontext()

    def in_flight(self, whole=True):  # the rollouts
        return {5: "batch 5 made ahead"} if whole else {}


def _config(run_dir, mode="batch"):
    cfg = TrainConfig()
    cfg.run.dir = str(run_dir)
    cfg.algorithm.kl_ctrl, cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon = \
        "adaptive", 0.1, 0.01, 100
    cfg.rollout.mode = mode
    return cfg


def test_loop_start_gives_back_the_state_a_checkpoint_saved(tmp_path):
    """Step, KL controller (its adapted coefficient), curriculum and rollouts in flight come back
    as saved; the actors are put back from the same checkpoint at that version."""
    cfg = _config(tmp_path)
    kl = AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
    kl.update(0.02, 50)  # error clipped to 0.2: 0.1 * (1 + 0.2 * 50 / 100) = 0.11
    assert kl.value == pytest.approx(0.11)
    curriculum = Curriculum(rows=10, rest_epochs=2, cursor=7, resting={3: 27}, drawn={1: 4})
    actors = _Actors()
    checkpoint.save_step(str(tmp_path), 4, kl, curriculum, actors, actors, actors, keep=2)
    assert json.load(open(tmp_path / "checkpoints/step_000004/loop.json")) == {
        "next_step": 4, "kl_ctrl": {"kind": "adaptive", "value": pytest.approx(0.11), "target_kl": 0.01,
                                    "horizon": 100.0},
        "curriculum": {"cursor": 7, "resting": {"3": 27}, "drawn": {"1": 4}}}

    fresh = Curriculum(rows=10, rest_epochs=2)
    start = checkpoint.loop_start(cfg, checkpoint.latest(str(tmp_path)), fresh)
    assert start.step == 4 and start.in_flight == {5: "batch 5 made ahead"}
    assert start.checkpoint == str(tmp_path / "checkpoints" / "step_000004")
    assert isinstance(start.kl_ctrl, AdaptiveKLController)
    assert (start.kl_ctrl.value, start.kl_ctrl.target_kl, start.kl_ctrl.horizon) == (pytest.approx(0.11), 0.01, 100)
    assert (fresh.cursor, fresh.resting, fresh.drawn) == (7, {3: 27}, {1: 4})

    said: list[str] = []
    start.restore_actors(actors, actors, actors, said.append)
    assert actors.calls[1:] == [("load", "step_000004/learner"), ("to_sync",), ("sync", 4)]
    assert said == [f"Resumed from {start.checkpoint}: next step 5 (1 batch(es) generated ahead kept)"]


def test_a_fresh_run_starts_from_the_same_place_at_step_0(tmp_path):
    cfg = _config(tmp_path)
    # a restart after a failure with no checkpoint yet: the curriculum the failed attempt advanced starts over
    curriculum = Curriculum(rows=10, rest_epochs=2, cursor=7, resting={3: 27}, drawn={1: 4})
    start = checkpoint.loop_start(cfg, None, curriculum)
    assert (start.step, start.in_flight, start.checkpoint) == (0, {}, None)
    assert isinstance(start.kl_ctrl, AdaptiveKLController) and start.kl_ctrl.value == 0.1  # algorithm.kl_coef
    assert (curriculum.cursor, curriculum.resting, curriculum.drawn) == (0, {}, {})
    cfg.algorithm.kl_ctrl = "fixed"
    assert isinstance(checkpoint.loop_start(cfg, None, None).kl_ctrl, FixedKLController)
    actors = _Actors()
    start.restore_actors(actors, actors, actors, lambda line: actors.calls.append(("said", line)))
    assert actors.calls == []  # nothing to put back


def test_loop_start_reads_older_checkpoints_and_checks_the_rollout_mode(tmp_path):
    """A `loop.json` from before the policy version was dropped (it equalled the step) and
    without a KL state still loads (the controller fresh from the config); rollouts in flight of
    another mode are refused before anything starts."""
    cfg = _config(tmp_path)
    actors = _Actors()
    path = checkpoint.save(str(tmp_path), checkpoint.LoopState(3), actors.save_checkpoint,
                           in_flight={"streaming": {"ready": [], "pending": []}})
    with open(os.path.join(path, "loop.json"), "w") as f:
        json.dump({"next_step": 3, "policy_version": 3, "kl_ctrl": None, "curriculum": None}, f)
    found = checkpoint.latest(str(tmp_path))
    assert found[1] == checkpoint.LoopState(3)
    with pytest.raises(ValueError, match="resume it with rollout.mode=streaming"):
        checkpoint.loop_start(cfg, found, None)
    start = checkpoint.loop_start(_config(tmp_path, mode="streaming"), found, None)
    assert start.step == 3 and start.kl_ctrl.value == 0.1 and start.in_flight["streaming"]["ready"] == []
