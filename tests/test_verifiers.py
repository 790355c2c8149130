"""verifiers environments, unchanged (reward/agents/verifiers.py): a `v1` taskset with its own reward
(examples/verifiers_sum, packaged as its authors package one) installed beside verifiers in the
virtual environment `launch/agent_env.sh verifiers` makes, played through verifiers' own
`run_episode` with our agent server as its model endpoint, token for token; the reward is the
trace's, as verifiers computed it; a taskset whose reward raises, hangs or is not a number (the
error names the function), an environment that is not installed and a task index out of range
each cost only their episode, and bad agent kwargs are refused before any episode.

Full lane: making the verifiers environment downloads verifiers and its dependencies (~2 min)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time

import pytest

from examples.calculator import calculator_tokenizer
from reward.agents.pool import AgentLimits, AgentPool
from reward.loader import RewardLoadError
from rl.data.agent_calls import episode_sample
from rl.data.types import GenerationRequest, Sample
from reward.agents.server import AgentServer
from tests.conftest import endpoints, play_episodes

pytestmark = [pytest.mark.slow, pytest.mark.full]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = "reward.agents.verifiers:episode"

# A taskset whose reward misbehaves as its config says: raises, hangs, or returns NaN.
HOSTILE = '''
import asyncio
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str
    mode: str


class HostileTask(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def judged(self, trace: vf.Trace) -> float:
        if self.data.mode == "raise":
            raise RuntimeError("the reward function broke")
        if self.data.mode == "hang":
            await asyncio.sleep(3600)
        if self.data.mode == "nan":
            return float("nan")
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0


class HostileConfig(vf.TasksetConfig):
    mode: str = "ok"


class HostileTaskset(vf.Taskset[HostileTask, HostileConfig]):
    def load(self):
        for a in range(1, 10):
            yield HostileTask(Data(prompt=f"x\\n{a}+1", answer=str(a + 1), mode=self.config.mode), self.config.task)


__all__ = ["HostileTaskset"]
'''


@pytest.fixture(scope="module")
def verifiers_python() -> str:
    subprocess.run(["bash", "launch/agent_env.sh", "verifiers", "examples/verifiers_sum"], cwd=ROOT, check=True,
                   timeout=900)
    return os.path.join(ROOT, ".venv-verifiers", "bin", "python")


def _policy(tok, wrong: bool = False):
    """Reads the sum in its prompt and answers it (or, with `wrong`, answers 0)."""
    def generate(request: GenerationRequest) -> Sample:
        prompt = tok.decode(request.prompt_ids, skip_special_tokens=False).replace(" ", "")
        a, b = map(int, re.findall(r"(\d)\+(\d)", prompt)[-1])
        text = "0" if wrong else str(a + b)
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return Sample(request.prompt_ids, ids, [-0.1] * len(ids), "stop", 0, "", text, 0, 0)
    return generate


def _answers(python: str, n: int) -> list[str]:
    """The taskset's own answers for its first `n` tasks, read in the verifiers environment."""
    code = ("import json, itertools, reward.agents.verifiers as va\n"
            f"env = va.load('verifiers_sum')\n"
            f"print(json.dumps([t.data.answer for t in itertools.islice(env.taskset, {n})]))\n")
    out = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_verifiers_environment_plays_token_exact_with_its_own_rewards(verifiers_python):
    """verifiers' run_episode calls our endpoint once per task; the recorded completion is the ids
    the policy sampled; the reward is verifiers' exact_answer on that reply (1 right, 0 wrong)."""
    tok = calculator_tokenizer()
    rows = [{"prompt": "", "task_index": i} for i in (0, 3, 7, 11)]
    answers = _answers(verifiers_python, 12)
    for wrong in (False, True):
        policy = _policy(tok, wrong)
        with AgentServer(tok, policy, max_new_tokens=8, max_model_len=256) as server:
            pool = AgentPool(AGENT, ROOT, 2, AgentLimits(60.0), {"environment": "verifiers_sum"},
                             python=verifiers_python, endpoints=endpoints(server.url))
            try:
                outcomes, calls = play_episodes(server, pool, rows, 90)
            finally:
                pool.close()
        for i, row in enumerate(rows):
            assert outcomes[i].error is None, outcomes[i]
            assert len(calls[i]) == 1
            call = calls[i][0]
            text = "0" if wrong else answers[row["task_index"]]
            assert call.completion_ids == tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
            prompt = tok.decode(call.prompt_ids, skip_special_tokens=False).replace(" ", "")
            a, b = map(int, re.findall(r"(\d)\+(\d)", prompt)[-1])
            assert str(a + b) == answers[row["task_index"]]  # the task the row named was the one played
            assert outcomes[i].value == float(text == answers[row["task_index"]])
            assert episode_sample(calls[i], prompt_text="", group_id=0, sample_index=0, metadata={}).error is None


def test_a_broken_taskset_or_row_costs_only_its_episode(verifiers_python, tmp_path):
    """A reward that raises, hangs (the episode's deadline ends it) or is NaN, an environment that
    is not installed and a task index out of range are errors of their own rows; the good rows on
    either side play and score 1."""
    (tmp_path / "hostile_sum.py").write_text(HOSTILE)
    (tmp_path / "by_row.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from reward.agents.verifiers import episode\n\n"
        "async def play(base_url, row, **kw):\n"
        "    env = row.get('env', kw['environment'])\n"
        "    args = {'mode': row['mode']} if 'mode' in row else kw.get('taskset_args')\n"
        "    return await episode(base_url, row, **{**kw, 'environment': env, 'taskset_args': args})\n")
    rows = [{"task_index": 1},
            {"task_index": 1, "env": "hostile_sum", "mode": "raise"},
            {"task_index": 1, "env": "hostile_sum", "mode": "hang"},
            {"task_index": 1, "env": "hostile_sum", "mode": "nan"},
            {"task_index": 1, "env": "not_an_installed_env"},
            {"task_index": 5000},
            {"task_index": "one"},
            {"task_index": 2, "env": "hostile_sum", "mode": "ok"}]
    tok = calculator_tokenizer()
    with AgentServer(tok, _policy(tok), max_new_tokens=8, max_model_len=256) as server:
        pool = AgentPool(f"{tmp_path}/by_row.py:play", ROOT, 4, AgentLimits(15.0),
                         {"environment": "verifiers_sum"}, python=verifiers_python, endpoints=endpoints(server.url))
        try:
            t0 = time.monotonic()
            outcomes, _ = play_episodes(server, pool, rows, 60)
            took = time.monotonic() - t0
        finally:
            pool.close()
    assert outcomes[0].value == 1.0 and outcomes[7].value == 1.0, (outcomes[0], outcomes[7])
    assert "the reward function broke" in outcomes[1].error, outcomes[1]
    assert "did not return within task.agent_timeout_s=15 s" in outcomes[2].error, outcomes[2]
    nan = outcomes[3]  # verifiers passes NaN on; the episode names the reward function that scored it
    assert "verifiers reward function 'judged' of task 1 scored nan" in nan.error, nan
    assert "not_an_installed_env" in outcomes[4].error and "not found" in outcomes[4].error, outcomes[4]
    assert "has fewer tasks than that" in outcomes[5].error, outcomes[5]
    assert "expected a task index" in outcomes[6].error, outcomes[6]
    assert took < 50


@pytest.mark.parametrize("kwargs, says", [
    ({"environment": "not_an_installed_env"}, "taskset 'not_an_installed_env' not found"),
    ({"environment": "verifiers_sum", "taskset_args": {"n": "many"}}, "taskset_args"),
    ({"environment": "verifiers_sum", "harness": "no_such_harness"}, "harness 'no_such_harness' not found"),
    ({"environment": "verifiers_sum", "sampling": {"temperature": 0.3}}, "rollout.temperature"),
    ({"environment": "verifiers_sum", "index_key": ""}, "index_key"),
    ({"environment": "verifiers_sum", "seed": 3}, "does not take"),
    ({}, "environment"),
])
def test_bad_agent_kwargs_are_refused_before_any_episode(verifiers_python, kwargs, says):
    with pytest.raises(RewardLoadError) as err:
        AgentPool(AGENT, ROOT, 1, AgentLimits(30.0), kwargs, python=verifiers_python).close()
    assert says in str(err.value) and "task.agent" in str(err.value), str(err.value)


def test_two_training_steps_on_the_verifiers_environment(verifiers_python, tiny_calc, tmp_path):
    """task=verifiers_sum for 2 steps on the tiny chat model: learner and engine agree on every
    model token's log-prob at step 0 (the episodes are token-exact), no episode fails, each logged
    reward is verifiers' verdict on that completion (1 when it is the task's sum), and each logged
    prompt is the one the model saw."""
    from examples.verifiers_sum import write_data
    from tests.conftest import two_agent_steps

    out, _ = tiny_calc
    rows = two_agent_steps(["task=verifiers_sum", f"model.path={out}/model", f"task.agent_python={verifiers_python}"],
                           write_data, tmp_path)
    for r in rows:  # the taskset's sum for the row's task, drawn as verifiers_sum draws it (seed 0)
        rng = random.Random(r["data"]["task_index"])
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        replies = [t["text"].strip() for t in r["turns"] if t["role"] == "model"]
        assert len(replies) == 1 and r["reward"] == float(replies[0] == str(a + b)), r
        # the prompt the model saw (the task's, rendered), not the row's column that names the task
        assert r["prompt_text"].startswith("<bos><|user|>")
        assert r["prompt_text"].endswith(f"{a}+{b}<|end|><|assistant|>")
