"""Faults injected into real runs of `python -m launch.train` (a real local Ray, vLLM, DeepSpeed):
processes are killed and stopped from the test, mid-run, and the run's outcome is checked."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from launch.supervise import command
from rl.actors.faults import ActorFailure, Deadlines
from rl.log.run_log import read_metrics

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


# ---- fast: the pieces ----------------------------------------------------------------------

def test_deadline_is_generous_first_then_follows_the_work():
    d = Deadlines(floor_s=10, factor=3, start_s=900)
    assert d.of("generate") == 900  # the first call may include lazy set-up
    d.record("generate", 2.0)
    assert d.of("generate") == 10  # floor
    d.record("generate", 7.0)
    d.record("generate", 1.0)
    assert d.of("generate") == 21  # 3 x the slowest seen
    assert d.of("train_step") == 900


def test_actor_failure_names_actor_phase_and_step():
    err = ActorFailure("learner rank 1 (pid 42)", "train_step", "its process died").at_step(6)
    assert str(err) == "learner rank 1 (pid 42) failed during train_step at step 7: its process died"


def test_resume_command_keeps_the_overrides_but_dir_and_resume():
    cmd = command(["algorithm=ppo", "run.dir=/old", "run.resume=false", "reward.functions=[{fn: a.py:f}]"],
                  "run.dir=/runs/x", "run.resume=true")
    assert shlex.split(cmd) == ["python", "-m", "launch.train", "algorithm=ppo", "reward.functions=[{fn: a.py:f}]",
                                "run.dir=/runs/x", "run.resume=true"]


# ---- slow: real runs -----------------------------------------------------------------------

class Run:
    """`python -m launch.train` in a subprocess; its output is collected in a file."""

    def __init__(self, args: list[str], out_path: str):
        self.out_path = out_path
        self.file = open(out_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.train", *args], cwd=ROOT, stdout=self.file,
                                     stderr=subprocess.STDOUT, env=env)

    @property
    def output(self) -> str:
        with open(self.out_path) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout_s: float = 300) -> re.Match:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            found = re.search(pattern, self.output)
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in the run's output:\n{self.output[-4000:]}")

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.file.close()


def pid_of(run_dir: str, role: str, index: int = 0) -> int:
    with open(os.path.join(run_dir, "actors.json")) as f:
        return next(a["pid"] for a in json.load(f) if a["role"] == role and a["index"] == index)


@pytest.fixture
def base_args(tiny_dir):
    return [f"model.path={tiny_dir}/model", f"task.train_files=[{tiny_dir}/data/train.jsonl]", "run.progress=false",
            "task.prompts_per_step=8", "run.save_final_model=false"]


@pytest.mark.slow
def test_rollout_worker_killed_then_stopped_is_replaced_and_the_run_completes(base_args, tmp_path):
    """kill -9 the rollout worker while a generate call waits on it, later SIGSTOP its
    replacement: each time a new worker starts, rejoins the weight-sync group, gets the current
    weights and generates the unfinished requests; all steps complete (a reward worker killed
    near the end does not stop the run either)."""
    run_dir = str(tmp_path / "run")
    # a reward that takes 0.3 s per step: on a fast host a step takes 0.1 s, and the run ended
    # before the SIGSTOP sent on "step 4/6" (read every 0.2 s) could land
    slow_reward = tmp_path / "slow_reward.py"
    slow_reward.write_text(SLOW_EXACT_ANSWER)
    run = Run([*base_args, f"run.dir={run_dir}", "run.steps=6", "run.call_timeout_s=10",
               "run.call_timeout_factor=3",
               f'reward.functions=[{{fn: "{slow_reward}:exact_answer"}}, {{fn: "reward.builtin:format_number", weight: 0.1}}]'],
              str(tmp_path / "out.txt"))
    try:
        run.wait_for(r"step 2/6")
        first = pid_of(run_dir, "rollout")
        os.kill(first, signal.SIGSTOP)  # the next step's generate call now waits on it...
        time.sleep(2)
        os.kill(first, signal.SIGKILL)  # ...and it dies with the requests unfinished
        second = int(run.wait_for(r"Replaced: rollout worker 0 \(pid (\d+)\) up").group(1))
        assert second != first
        run.wait_for(r"step 4/6")
        os.kill(second, signal.SIGSTOP)  # a hang: never resumed
        started = time.monotonic()
        run.wait_for(r"rollout worker 0 \(pid %d\) failed during [\w -]+: no answer in" % second, timeout_s=120)
        noticed_s = time.monotonic() - started
        run.wait_for(r"step 5/6")
        os.kill(pid_of(run_dir, "reward"), signal.SIGKILL)  # Ray starts it again; the run goes on
        assert run.finish() == 0, run.output[-4000:]
    finally:
        run.finish(timeout_s=5) if run.proc.poll() is None else None
    out = run.output
    print(out[-3000:])
    # (on a quiet machine a step takes 0.2 s: the stop may also land in the weight sync)
    assert re.search(rf"rollout worker 0 \(pid {first}\) failed during (generate|weight sync): its process died", out)
    assert noticed_s < 60  # max(run.call_timeout_s=10, 3 x the slowest generate) and a margin
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(6))
    # the replacements sample from the learner's current weights, not the start model's
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics[1:]), [m["sync/logprob_abs_diff"] for m in metrics]
    assert metrics[4]["actor/kl_nats"] > 0
    # the rollout faults cost no reward; the reward worker killed in step 6 may cost that step's
    # samples (recorded as errors, as designed), nothing more
    assert all(m["reward/errors_count"] == 0 for m in metrics[:5]), [m["reward/errors_count"] for m in metrics]
    # the run's report, drawn inside the Hydra app, holds the config diff (composed beside Hydra's state)
    assert "warning: no report" not in out
    with open(os.path.join(run_dir, "report.md")) as f:
        assert "- `run.steps`: 60 -> 6" in f.read()


SLOW_REWARD = '''
import time

def wait_1s(prompts, completions, **kwargs):
    time.sleep(1.0)
    return [0.0] * len(completions)
'''


@pytest.mark.slow
@pytest.mark.full  # a long fault case: a restart from the checkpoint, then a second loss
def test_lost_learner_rank_restarts_the_run_from_its_checkpoint_then_names_itself(base_args, tmp_path):
    """kill -9 the learner rank: with run.max_restarts=1 the run restarts itself from its latest
    checkpoint; killed again, it ends with one line naming the rank, phase and step, and the
    command that resumes it."""
    run_dir = str(tmp_path / "run")
    # a step of the tiny model takes 0.1 s: a weight-0 reward that waits 1 s makes sure the kill,
    # sent when "step 3/5" is printed, lands in step 4 and not after it
    slow = tmp_path / "slow.py"
    slow.write_text(SLOW_REWARD)
    rewards = ("reward.functions=[{fn: reward.builtin:exact_answer}, {fn: reward.builtin:format_number, weight: 0.1},"
               f' {{fn: "{slow}:wait_1s", weight: 0.0}}]')
    run = Run([*base_args, f"run.dir={run_dir}", "run.steps=5", "run.save_every=2", "run.max_restarts=1", rewards],
              str(tmp_path / "out.txt"))
    run.wait_for(r"step 3/5")
    first = pid_of(run_dir, "learner")
    os.kill(first, signal.SIGKILL)
    run.wait_for(r"Resumed .* next step 3")
    run.wait_for(r"(?s)Resumed .*step 3/5")
    second = pid_of(run_dir, "learner")
    assert second != first
    os.kill(second, signal.SIGKILL)
    assert run.finish() == 1
    out = run.output
    print(out[-3000:])
    assert "Restarting the run from its checkpoint before step 3 (restart 1 of run.max_restarts=1)" in out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, errors  # one line per failure
    for pid, line in zip((first, second), errors):
        assert re.match(rf"error: learner rank 0 \(pid {pid}\) failed during \w+ at step 4: its process died", line), line
    resume = re.search(r"Resume with: (python -m launch\.train .*)", out).group(1)
    assert f"run.dir={run_dir}" in resume and "run.resume=true" in resume and "run.max_restarts=1" in resume
    assert "Traceback" not in out
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(3))
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps_run"] == 3 and "learner rank 0" in summary["ended_early"]


ALWAYS_FAILS = '''
def broken(prompts, completions, **kwargs):
    raise KeyError("answer_column")
'''


@pytest.mark.slow
def test_rewards_that_all_fail_stop_the_run_with_the_error_and_a_summary(make_config, tmp_path):
    from launch.train import train
    from rl.actors.faults import RewardsFailing

    reward_file = tmp_path / "broken.py"
    reward_file.write_text(ALWAYS_FAILS)
    cfg = make_config("run.steps=10", "task.prompts_per_step=4", f'reward.functions=[{{fn: "{reward_file}:broken"}}]')
    with pytest.raises(RewardsFailing, match=r"3 steps in a row .*first error: broken: KeyError: 'answer_column'"):
        train(cfg)
    assert len(read_metrics(cfg.run.dir)) == 3
    summary = json.load(open(os.path.join(cfg.run.dir, "summary.json")))
    assert summary["steps_run"] == 3 and summary["first_steps_reward_mean"] is None
    assert "RewardsFailing" in summary["ended_early"]
    from rl.run.checkpoint import latest

    assert latest(cfg.run.dir)[1].next_step == 3  # a fixed reward file resumes from here


SLOW_EXACT_ANSWER = '''
import time

from reward.builtin import exact_answer as _exact_answer


def exact_answer(prompts, completions, **kwargs):
    time.sleep(0.3)
    return _exact_answer(prompts, completions, **kwargs)
'''


def _critic_state(run_dir: str, step: int) -> dict:
    import glob

    import torch

    (path,) = glob.glob(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "learner", "critic", "state",
                                     "*model_states.pt"))
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


@pytest.mark.slow
@pytest.mark.full  # ~3 min, three runs; the default lane resumes in tests/test_e2e.py's mechanics runs
def test_sigterm_stops_at_a_step_with_a_checkpoint_and_the_resumed_run_matches_an_uninterrupted_one(
        base_args, make_config, tmp_path):
    """PPO (policy + critic), lock-step: SIGTERM mid-run finishes the step, writes a checkpoint,
    prints the resume command and exits 143; resumed (keeping the saved run.save_every), it
    reproduces a run that was never stopped (nor laid out hybrid): the same metrics at every step,
    the same policy and critic weights. The run never stopped is also the default lane's lock-step
    mechanics check (samples scored, learner = vLLM after every sync, the saved model loads)."""
    import torch
    from safetensors.torch import load_file

    from launch.train import train
    from launch.checks import check_run_dir
    from tests.test_e2e import _assert_saved_model_loads_and_moved
    from rl.run.checkpoint import latest
    from rl.config.schema import ConfigError

    # a reward that takes 0.3 s per step: the SIGTERM sent on "step 2/4" lands in step 3 on any
    # host (a step took 0.2 s, CI once saw the run end before the signal came; the hybrid layout's
    # offloads below add ~2 s more on a 2-core host)
    slow_reward = tmp_path / "slow_reward.py"
    slow_reward.write_text(SLOW_EXACT_ANSWER)
    # the layout fixed: `auto` chooses trees or packed rows by this host's measured speed and planning
    # time, so two runs under different load may lay a micro-batch out differently and then agree
    # to fp32 rounding (~1e-6, which Adam's first updates can magnify), not bit for bit
    common = ["algorithm=ppo", "run.steps=4", "run.save_every=5", "run.save_final_model=true",
              "trainer.shared_prefix=on",
              f'reward.functions=[{{fn: "{slow_reward}:exact_answer"}}, {{fn: "reward.builtin:format_number", weight: 0.1}}]']
    straight = make_config(*common, "task.prompts_per_step=8", f"run.dir={tmp_path}/straight")
    summary = train(straight)
    # The default lane's lock-step mechanics run: every step's samples scored, every step's weights
    # reached vLLM (learner and vLLM agree after each sync, on a policy that moved), the model saved.
    a = read_metrics(straight.run.dir)
    assert [m["policy/version_count"] for m in a] == [1, 2, 3, 4]
    assert all(m["reward/errors_count"] == 0 and 0 <= m["reward/mean"] and m["sync/logprob_abs_diff"] < 1e-3
               for m in a), [(m["reward/errors_count"], m["sync/logprob_abs_diff"]) for m in a]
    assert all(m["sync/weights_mb"] > 0 for m in a[1:])  # (that the policy moved: the saved model, below)
    _assert_saved_model_loads_and_moved(summary["final_model"], straight.model.path)

    # The stopped run is laid out hybrid (learner rank 0 and rollout worker 0 in one bundle): its
    # learner moves policy, critic and reference states to the host and back around every
    # rollout and checkpoint (DeepSpeed offload_states), which must change nothing.
    run_dir = str(tmp_path / "stopped")
    args = [*base_args, *common, f"run.dir={run_dir}", "cluster.placement_mode=hybrid"]
    run = Run(args, str(tmp_path / "out1.txt"))
    run.wait_for(r"step 2/4")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM
    out = run.output
    assert "(PACK, hybrid): rollout worker i and learner rank i share bundle i" in out
    stopped = re.search(r"Stopped by SIGTERM after step (\d+), checkpoint written\. Resume with: (.*)", out)
    assert stopped, out[-3000:]
    next_step = int(stopped.group(1))
    assert next_step in (2, 3) and latest(run_dir)[1].next_step == next_step
    assert len(read_metrics(run_dir)) == next_step
    assert json.load(open(os.path.join(run_dir, "summary.json")))["steps_run"] == next_step
    assert "Traceback" not in out

    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(make_config(*common, f"run.dir={run_dir}"))
    with pytest.raises(ConfigError, match="algorithm.lr"):
        check_run_dir(make_config(*common, "run.resume=true", "algorithm.lr=0.1", f"run.dir={run_dir}"))

    resume = [a for a in shlex.split(stopped.group(2))[3:] if not a.startswith("run.save_every=")]
    run = Run(resume, str(tmp_path / "out2.txt"))  # run.save_every not given: the saved 5 holds
    assert run.finish() == 0, run.output[-3000:]
    from omegaconf import OmegaConf

    assert OmegaConf.load(os.path.join(run_dir, "config.yaml")).run.save_every == 5
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", f"step_{next_step:06d}",
                                                                          "step_000004"]

    b = read_metrics(run_dir)
    assert [m["step"] for m in b] == [0, 1, 2, 3]  # no step lost, none repeated
    for key in ("reward/mean", "rollout/completion_len_tokens", "policy/version_count"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    for key in ("actor/loss_nats", "critic/value_loss"):
        assert [m.get(key) for m in a] == pytest.approx([m.get(key) for m in b], abs=1e-6), key
    policy_a = load_file(os.path.join(straight.run.dir, "final_model", "model.safetensors"))
    policy_b = load_file(os.path.join(run_dir, "final_model", "model.safetensors"))
    assert policy_a.keys() == policy_b.keys()
    for name in policy_a:
        torch.testing.assert_close(policy_b[name], policy_a[name], rtol=0, atol=1e-6, msg=name)
    critic_a, critic_b = _critic_state(straight.run.dir, 4), _critic_state(run_dir, 4)
    assert critic_a.keys() == critic_b.keys() and critic_a
    for name in critic_a:
        torch.testing.assert_close(critic_b[name], critic_a[name], rtol=0, atol=1e-6, msg=name)


def test_first_signal_asks_for_a_stop_and_a_second_stops_at_once():
    from launch.supervise import stop_on_signals
    from rl.actors.faults import StopRequest

    stop, said = StopRequest(), []
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under `cmd &` in a script
    with stop_on_signals(stop, said.append):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.reason == "SIGINT" and "stops after this step" in said[0]
        with pytest.raises(SystemExit) as exited:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_checkpoint_pickled_before_rl_had_sub_packages_still_loads(tmp_path):
    """`in_flight.pkl` of a run checkpointed when the types lived in the flat `rl.types` loads
    after the move to `rl.data.types` (rl.run.checkpoint.MOVED_MODULES)."""
    import pickle

    from rl.data.types import GenerationRequest
    from rl.run.checkpoint import load_in_flight

    ahead = {7: [GenerationRequest(prompt_ids=[1, 2], prompt_text="2+2", group_id=0, sample_index=1, seed=11)]}
    old_layout = pickle.dumps(ahead, protocol=0).replace(b"rl.data.types", b"rl.types")
    assert b"rl.data.types" not in old_layout and b"rl.types" in old_layout
    (tmp_path / "in_flight.pkl").write_bytes(old_layout)
    assert load_in_flight(str(tmp_path)) == ahead


HUGE_REWARD = '''
def huge(prompts, completions, **kwargs):
    return [1e30 if i % 2 else -1e30 for i in range(len(completions))]
'''


@pytest.mark.slow
def test_a_run_whose_every_update_is_skipped_stops_naming_the_cause(make_config, tmp_path, capfd):
    """Issue 47: rewards of +-1e30 under dr_grpo (no std normalization) make every update's gradients
    overflow; DeepSpeed skips each step, saying so only in its log. The step line says so, and after
    trainer.max_skipped_steps such steps the run stops with NotLearning (before: rc=0, nothing learned)."""
    from launch.train import train
    from rl.actors.faults import NotLearning

    reward_file = tmp_path / "huge.py"
    reward_file.write_text(HUGE_REWARD)
    cfg = make_config("run.steps=4", "task.prompts_per_step=4", "algorithm=dr_grpo", "trainer.max_skipped_steps=2",
                      "reward.bound=1e30",  # past the default bound the samples would be errors instead
                      f'reward.functions=[{{fn: "{reward_file}:huge"}}]')
    with pytest.raises(NotLearning, match=r"skipped every update for 2 steps in a row \(trainer.max_skipped_steps=2\)"):
        train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2 and all(m["actor/skipped_updates_count"] == m["actor/updates_count"] for m in metrics)
    assert "updates skipped (gradients not finite)" in capfd.readouterr().out
