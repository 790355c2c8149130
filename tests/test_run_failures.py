"""Steps whose every sample failed (issue 58): an agent pool that can no longer run episodes stops
the run with an error naming the real cause, within reward.max_failed_steps steps (or at the run's
end), never exit code 0 with rewards of 0.000; the step line names the cause; the run's summary,
final line and report never let an earlier step's reward stand in for steps that had none, and
are computed from the rows the run wrote, not from whatever else was appended to metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from launch.report import reward_ends, step_reward, summary_table, write_report
from launch.train import print_summary, reward_trend
from reward.agents.runner import AgentRunner
from rl.data.types import GenerationRequest, Sample, ScoredSample
from rl.actors.faults import EpisodesFailing, Failures, RewardsFailing, common_cause, episode_cause, episode_error
from rl.run.guards import StopGuards
from rl.log.run_log import RunLog, summary_line
from rl.run.step_metrics import episode_metrics
from tests.episode_fakes import FakeEpisodeServer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ZYGOTE = "could not run: its zygote process (pid 4242) exited"
KILLED = "did not return within task.agent_timeout_s=8 s: killed"


def _episode(error: str | None, group: int = 0, index: int = 0) -> ScoredSample:
    sample = Sample([1], [2], [-0.1], "stop", 0, "2+2=", "4", group, index, completion_mask=[1], turns=[],
                    error=error)
    return ScoredSample(sample, 1.0 if error is None else None, {}, error)


def _agent_error(cause: str, group: int, index: int, tail: str = "") -> str:
    return episode_error("my_agent.py:solve", f"What is {group}+{index}?", group, index, cause, tail)


# ---- the cause of a step's failures ------------------------------------------------------

def test_the_cause_of_an_agent_error_leaves_out_what_differs_from_sample_to_sample():
    error = _agent_error(ZYGOTE, 3, 1, tail="Traceback ... pid 99")
    assert error == ("task.agent=my_agent.py:solve on prompt 'What is 3+1?' (group 3, sample 1): " + ZYGOTE
                     + " [its output ends: Traceback ... pid 99]")
    assert episode_cause(error) == f"task.agent=my_agent.py:solve: {ZYGOTE}"
    assert episode_cause("broken: KeyError: 'answer_column'") == "broken: KeyError: 'answer_column'"
    errors = [_agent_error(KILLED, 0, 0), *(_agent_error(ZYGOTE, g, i, tail=f"out {g}") for g in range(2)
                                            for i in range(3))]
    assert common_cause(errors) == (f"task.agent=my_agent.py:solve: {ZYGOTE}", 6)
    assert common_cause(["b", "a", "a", "b"]) == ("b", 2)  # equal counts: the first seen


def test_failures_of_a_step_and_its_line():
    scored = [_episode(_agent_error(ZYGOTE, g, i)) for g in range(8) for i in range(4)]
    failures = Failures.of(scored)
    assert failures == Failures(32, 32, f"task.agent=my_agent.py:solve: {ZYGOTE}", 32, True) and failures.every
    assert failures.line() == f"32 of 32 episodes failed: task.agent=my_agent.py:solve: {ZYGOTE}"
    mixed = Failures.of([_episode(None), _episode(_agent_error(KILLED, 0, 1)), _episode(_agent_error(ZYGOTE, 0, 2)),
                         _episode(_agent_error(ZYGOTE, 0, 3))])
    assert (mixed.failed, mixed.total, mixed.count, mixed.every) == (3, 4, 2, False)
    assert Failures.of([_episode(None)]) is None
    completion = ScoredSample(Sample([1], [2], [-0.1], "stop", 0, "", "x", 0, 0), None, {}, "f: ValueError: no")
    assert Failures.of([completion, completion]).line() == "2 of 2 samples failed: f: ValueError: no"
    assert Failures(3, 3, "f: boom", 2, False).line() == (
        "3 of 3 samples failed: f: boom (and 1 other errors: samples.jsonl)")


def test_the_step_line_names_the_cause_and_counts_only_the_pool_s_kills_as_timeouts():
    lost = "no outcome within 2 x (task.agent_timeout_s + 30 s)"
    samples = [s.sample for s in (_episode(_agent_error(lost, 0, i)) for i in range(3))]
    samples.append(_episode(_agent_error(KILLED, 0, 3)).sample)
    agents = episode_metrics(samples)
    assert agents["agent/errors_count"] == 4 and agents["agent/timeouts_count"] == 1  # before: 4 (blamed the timeout)
    scored = [_episode(_agent_error(ZYGOTE, 0, i)) for i in range(32)]
    metrics = {"reward/errors_count": 32.0, "reward/samples_count": 32.0, "agent/errors_count": 32.0,
               "agent/timeouts_count": 0.0, "time/step_s": 1.0}
    line = summary_line(2, 10, metrics, Failures.of(scored))
    assert line.startswith("step 3/10 | 1.0 s")
    assert f"| 32 of 32 episodes failed: task.agent=my_agent.py:solve: {ZYGOTE}" in line
    partial = {**metrics, "reward/errors_count": 2.0, "agent/errors_count": 2.0, "reward/mean": 0.5}
    line = summary_line(2, 10, partial, Failures.of([_episode(None), *scored[:2]]))
    assert line.endswith(f"2 reward errors (2 agents failed, 0 of them killed at task.agent_timeout_s); most often: "
                         f"task.agent=my_agent.py:solve: {ZYGOTE}")


def test_the_run_log_names_a_step_s_failures_on_its_line(tmp_path, capsys):
    log = RunLog(str(tmp_path / "run"), 4, progress=False, loggers=["jsonl"])
    scored = [_episode(_agent_error(ZYGOTE, 0, i)) for i in range(4)]
    log.samples(0, scored, keep=1)
    log.metrics(0, {"reward/errors_count": 4.0, "reward/samples_count": 4.0, "time/step_s": 1.0})
    log.metrics(1, {"reward/mean": 0.5, "reward/errors_count": 0.0, "time/step_s": 1.0})  # no samples logged
    log.close()
    first, second = capsys.readouterr().out.splitlines()
    assert first.endswith(f"| 4 of 4 episodes failed: task.agent=my_agent.py:solve: {ZYGOTE}"), first
    assert "failed" not in second


# ---- the guard -----------------------------------------------------------------------------

def _cfg(steps=10, max_failed=3):
    return SimpleNamespace(reward=SimpleNamespace(max_failed_steps=max_failed),
                           trainer=SimpleNamespace(max_skipped_steps=3), run=SimpleNamespace(steps=steps))


def test_episodes_that_all_fail_stop_the_run_naming_their_most_common_cause():
    guards = StopGuards(_cfg(max_failed=2), None)
    step = [_episode(_agent_error(KILLED, 0, 0)), *(_episode(_agent_error(ZYGOTE, 0, i)) for i in range(1, 4))]
    guards.record({}, step)
    assert guards.stopping(1) is None
    guards.record({}, step)
    stop = guards.stopping(2)
    assert isinstance(stop, EpisodesFailing) and isinstance(stop, RewardsFailing) and stop.next_step == 2
    assert str(stop) == ("every episode failed for 2 steps in a row (reward.max_failed_steps=2); the cause of 3 of "
                         f"the 4 episodes of the last step: task.agent=my_agent.py:solve: {ZYGOTE}")


def test_a_run_whose_last_steps_had_no_reward_ends_with_the_error_not_exit_0():
    guards = StopGuards(_cfg(steps=3, max_failed=3), None)
    guards.record({}, [_episode(None), _episode(_agent_error(ZYGOTE, 0, 1))])  # one good episode: goes on
    assert guards.stopping(1) is None
    guards.record({}, [_episode(_agent_error(ZYGOTE, 0, i)) for i in range(2)])
    assert guards.stopping(2) is None
    guards.record({}, [_episode(_agent_error(ZYGOTE, 0, i)) for i in range(2)])
    stop = guards.stopping(3)  # the run's last step: 2 failing steps, fewer than 3, still an error
    assert isinstance(stop, EpisodesFailing) and str(stop).startswith(
        "every episode failed in the run's last 2 step(s), where it ended (before reward.max_failed_steps=3); the "
        f"cause of 2 of the 2 episodes of the last step: task.agent=my_agent.py:solve: {ZYGOTE}")
    guards = StopGuards(_cfg(steps=2, max_failed=3), None)  # rewards (no episodes): RewardsFailing as before
    completion = ScoredSample(Sample([1], [2], [-0.1], "stop", 0, "", "x", 0, 0), None, {}, "f: KeyError: 'a'")
    guards.record({}, [completion])
    guards.record({}, [completion])
    stop = guards.stopping(2)
    assert type(stop) is RewardsFailing and "last 2 step(s)" in str(stop)
    assert "first error: f: KeyError: 'a'" in str(stop)
    guards = StopGuards(_cfg(steps=2, max_failed=3), None)
    guards.record({}, [completion])
    guards.record({}, [_episode(None)])
    assert guards.stopping(2) is None  # its last step had rewards: a finished run


# ---- the runner: the pool's reason -----------------------------------------------------------

class _Outcome:
    def __init__(self, error):
        self.value, self.error, self.log_tail = None, error, ""


class _BrokenPool:
    """A pool whose monitor is gone: it says why in `out_of_service` and hands back only the outcomes it had."""

    def __init__(self, outcomes: int):
        self.on_end, self.started, self.cancelled, self.outcomes = None, [], [], outcomes
        self.out_of_service = "could not run episodes: its monitor thread died (RuntimeError: boom)"

    def start(self, job_id, base_url, row):
        self.started.append(job_id)

    def results(self, wait_s):
        done = [(k, _Outcome(ZYGOTE)) for k in self.started[:self.outcomes]]
        self.started, self.outcomes = self.started[self.outcomes:], 0
        return done

    def cancel(self, job_id):
        self.cancelled.append(job_id)

    def close(self):
        pass


def test_a_broken_pool_s_reason_names_the_episodes_it_lost_without_waiting_for_deadlines():
    pool = _BrokenPool(outcomes=1)
    runner = AgentRunner(FakeEpisodeServer(), pool, SimpleNamespace(repair=lambda: None), name="my_agent.py:solve",
                         prompt_key="prompt", timeout_s=30.0, workers=2, max_len=64)
    requests = [GenerationRequest([1, 2], "2+2=", 0, i, seed=i) for i in range(3)]
    started = time.monotonic()
    samples = runner.run(requests)
    assert time.monotonic() - started < 10  # before: 3 x (30 + 30) s, then "no outcome within ..."
    assert [s.sample_index for s in samples] == [0, 1, 2] and len(pool.cancelled) == 2
    assert [episode_cause(s.error) for s in samples] == [  # the pool's outcome keeps its own error
        f"task.agent=my_agent.py:solve: {ZYGOTE}",
        *[f"task.agent=my_agent.py:solve: no outcome: the agent pool is out of service ({pool.out_of_service})"] * 2]


# ---- the summary ---------------------------------------------------------------------------

def _row(step: int, reward: float | None, **extra) -> dict:
    row = {"step": step, "reward/errors_count": 0.0 if reward is not None else 4.0, "reward/samples_count": 4.0,
           "time/step_s": 1.0, **extra}
    if reward is not None:
        row["reward/mean"] = reward
    return row


def test_a_step_without_rewards_never_stands_in_for_the_last_steps():
    assert step_reward(_row(0, 0.5)) == 0.5 and step_reward(_row(0, None)) is None
    assert step_reward({**_row(0, 0.5), "reward/mean": float("nan")}) is None
    assert step_reward({**_row(0, 0.5), "reward/mean": None}) is None  # written as null
    assert step_reward({**_row(0, 0.5), "reward/errors_count": 4.0}) is None  # no sample scored
    # 10 steps: rewards 0.1 .. 0.4 at first, then the pool broke: the last 5 had none (before: 0.25 -> 0.25)
    rows = [_row(i, 0.1 * (i + 1)) for i in range(4)] + [_row(i, None) for i in range(4, 10)]
    rows.append({"step": 10, "eval/pass_at_1": 0.5})  # the evaluation after the last step: not a step
    assert reward_ends(rows) == (5, pytest.approx(0.25), None)
    summary = reward_trend(rows)
    assert summary["steps_run"] == 10 and summary["steps_without_rewards"] == 6
    assert summary["first_steps_reward_mean"] == pytest.approx(0.25) and summary["last_steps_reward_mean"] is None
    table = dict(summary_table(rows, None))
    assert table["reward, first 5 steps"] == "0.2500" and table["reward, last 5 steps"] == "no step had rewards"
    # a step without rewards among the last ones leaves the mean to those with: (0.6 + 0.8) / 2
    rows = [_row(0, 0.2), _row(1, 0.4), _row(2, None), _row(3, 0.6), _row(4, None), _row(5, 0.8)]
    k, first, last = reward_ends(rows)
    assert (k, first, last) == (3, pytest.approx(0.3), pytest.approx(0.7))
    components = reward_trend([{**r, "reward/exact_mean": r.get("reward/mean")} for r in rows])["components"]
    assert components["exact"] == {"first_steps_mean": pytest.approx(0.3), "last_steps_mean": pytest.approx(0.7)}
    assert reward_ends([_row(0, None)]) == (1, None, None)


def test_the_final_line_says_when_the_last_steps_had_no_reward(capsys):
    rows = [_row(i, 0.1 * (i + 1)) for i in range(4)] + [_row(i, None) for i in range(4, 10)]
    print_summary(reward_trend(rows), "/runs/x")
    assert capsys.readouterr().out.splitlines()[0] == (
        "Reward mean: first 5 steps 0.250 -> last 5 steps (none had rewards). Run directory: /runs/x")
    print_summary(reward_trend([_row(0, 0.5), _row(1, 0.7)]), "/runs/x")
    assert "first 1 steps 0.500 -> last 1 steps 0.700." in capsys.readouterr().out
    print_summary(reward_trend([_row(0, None), _row(1, None)]), "/runs/x")
    assert capsys.readouterr().out.startswith("No step had a reward")


def test_the_summary_comes_from_the_rows_the_run_wrote_not_from_others_appended(tmp_path):
    run = str(tmp_path / "run")
    log = RunLog(run, 4, progress=False, loggers=["jsonl"])
    log.metrics(0, {"reward/mean": 0.2, "reward/errors_count": 0.0, "time/step_s": 1.0}, echo=False)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:  # an agent's rows, between the run's
        f.write(json.dumps({"step": 1, "reward/mean": 1.0, "time/step_s": 1.0}) + "\n")
        f.write(json.dumps({"step": 3, "reward/mean": 1.0, "time/step_s": 1.0}) + "\nnot json\n")
    log.metrics(1, {"reward/errors_count": 4.0, "reward/samples_count": 4.0, "reward/mean": math.nan,
                    "time/step_s": 1.0}, echo=False)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 1, "reward/mean": 1.0, "time/step_s": 1.0}) + "\n")
    rows = log.rows()
    log.close()
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["reward/mean"] is None
    assert reward_trend(rows)["last_steps_reward_mean"] is None  # from the file: 1.0
    _, md = write_report(run, rows)
    page = open(md).read()
    assert "| reward, first 1 steps | 0.2000 |" in page and "| reward, last 1 steps | no step had rewards |" in page
    # resumed at step 2: the steps before it as the file held them when the resumed run opened it
    run = str(tmp_path / "resumed")
    first = RunLog(run, 4, progress=False, loggers=["jsonl"])
    for step, reward in ((0, 0.2), (1, 0.4)):
        first.metrics(step, {"reward/mean": reward, "reward/errors_count": 0.0, "time/step_s": 1.0}, echo=False)
    first.close()
    again = RunLog(run, 4, progress=False, loggers=["jsonl"], resume=True, start_step=2)
    again.metrics(2, {"reward/mean": 0.6, "reward/errors_count": 0.0, "time/step_s": 1.0}, echo=False)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "reward/mean": 1.0, "time/step_s": 1.0}) + "\n")
    assert [(r["step"], r["reward/mean"]) for r in again.rows()] == [(0, 0.2), (1, 0.4), (2, 0.6)]
    again.close()


# ---- a real run ------------------------------------------------------------------------------

FAILING_AGENT = '''
def act(base_url, row):
    raise RuntimeError("the tool server at " + base_url.split("/")[2] + " is down")
'''


@pytest.mark.slow
def test_a_run_whose_agents_all_fail_exits_non_zero_naming_the_agent_s_error(tiny_calc, tmp_path):
    """`python -m launch.train` with an agent that raises in every episode: after
    reward.max_failed_steps=2 steps the run stops, exit code 1, with one error line naming the
    agent's own error; each step's line names it; the summary has no reward for the last steps."""
    out, _ = tiny_calc
    agent = tmp_path / "failing_agent.py"
    agent.write_text(FAILING_AGENT)
    run_dir = tmp_path / "run"
    args = ["task=calculator_agent", f"model.path={out}/model", f"task.train_files=[{out}/data/train.jsonl]",
            f"task.agent={agent}:act", "task.prompts_per_step=2", "rollout.n=2", "rollout.mode=batch",
            "algorithm.off_policy_steps=0", "reward.max_failed_steps=2", "run.steps=6", "run.save_every=0",
            "run.progress=false", "run.save_final_model=false", "eval.every_steps=0", f"run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    head = ("error: every episode failed for 2 steps in a row (reward.max_failed_steps=2); the cause of 4 of the 4 "
            "episodes of the last step: ")
    assert len(errors) == 1 and errors[0].startswith(f"{head}task.agent={agent}:act: "), output[-4000:]
    cause = errors[0].removeprefix(head)  # the agent's own error, as the pool reported it
    assert "raised RuntimeError: the tool server at 127.0.0.1:" in cause and "is down" in cause, cause
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(line.endswith(f"| 4 of 4 episodes failed: {cause}") for line in steps), steps
    assert "killed at task.agent_timeout_s" not in output
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1] and all(m["agent/timeouts_count"] == 0 for m in metrics)
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["last_steps_reward_mean"] is None and summary["steps_without_rewards"] == 2
    assert summary["ended_early"].startswith("EpisodesFailing: every episode failed for 2 steps in a row")
