"""The run's lifecycle pieces the loop calls (rl/run/checkpoint.py, rl/run/guards.py), with
hand-computed cases: when a checkpoint is due, which mode resumes rollouts in flight, when and
why a run stops at a step boundary, and a checkpoint found again with its config checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rl.config.schema import ConfigError
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
    checkpoint.save(str(run_dir), checkpoint.LoopState(2, 2), lambda d: None)
    path, state = checkpoint.find_resume(resumed, overrides=["run.resume=true", "run.steps=8"])
    assert state.next_step == 2 and path.endswith("step_000002")
    assert resumed.run.save_every == 5  # not given again: the saved value holds
    changed = OmegaConf.merge(resumed, {"algorithm": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"algorithm.lr \(1e-05 -> 0.1\)"):
        checkpoint.find_resume(changed)
    with pytest.raises(ConfigError, match="already finished step 2"):
        checkpoint.find_resume(OmegaConf.merge(resumed, {"run": {"steps": 2}}))
