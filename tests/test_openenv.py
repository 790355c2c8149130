"""OpenEnv environments, unchanged (reward/agents/openenv.py): an environment written with
openenv-core's own `Environment`, server and `EnvClient` (examples/openenv_sum), served as its
authors serve it (uvicorn, in the OpenEnv virtual environment `launch/agent_env.sh openenv` makes),
played through the agent server token for token; the reward is the environment's own; a server
that hangs or is gone costs only its episode.

Full lane: making the OpenEnv environment downloads openenv-core and its dependencies (~2 min)."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import time

import pytest

from examples.calculator import calculator_tokenizer
from reward.agents.pool import AgentLimits, AgentPool
from rl.data.agent_calls import episode_sample
from rl.data.types import GenerationRequest, Sample
from reward.agents.server import AgentServer
from tests.conftest import endpoints, play_episodes

pytestmark = [pytest.mark.slow, pytest.mark.full]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = "examples.openenv_sum.client:SumEnv"


@pytest.fixture(scope="module")
def openenv_python() -> str:
    subprocess.run(["bash", "launch/agent_env.sh", "openenv"], cwd=ROOT, check=True, timeout=900)
    return os.path.join(ROOT, ".venv-openenv", "bin", "python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sum_server(openenv_python):
    """The sum environment's server as its authors start it: uvicorn on its FastAPI app."""
    port = _free_port()
    proc = subprocess.Popen([openenv_python, "-m", "uvicorn", "examples.openenv_sum.server:app", "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise AssertionError("the OpenEnv server did not start in 60 s")
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def _policy(tok, wrong_first: bool):
    """Reads the sum in its prompt; answers it (or, with `wrong_first`, 0 first, then the sum)."""
    def generate(request: GenerationRequest) -> Sample:
        prompt = tok.decode(request.prompt_ids, skip_special_tokens=False).replace(" ", "")
        a, b = map(int, re.findall(r"(\d)\+(\d)", prompt)[-1])
        tries = prompt.count("<|assistant|>") - 1
        text = "0" if wrong_first and tries == 0 else str(a + b)
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return Sample(request.prompt_ids, ids, [-0.1] * len(ids), "stop", 0, "", text, 0, 0)
    return generate


def test_an_openenv_environment_plays_token_exact_with_its_own_rewards(openenv_python, sum_server):
    tok = calculator_tokenizer()
    kwargs = {"client": CLIENT, "server_url": sum_server, "prompt_key": "prompt"}
    rows = [{"prompt": "", "seed": s} for s in range(4)]
    for wrong_first, reward, turns in ((False, 1.0, 1), (True, 1.0, 2)):
        with AgentServer(tok, _policy(tok, wrong_first), max_new_tokens=8, max_model_len=256) as server:
            pool = AgentPool("reward.agents.openenv:episode", ROOT, 2, AgentLimits(30.0), kwargs, python=openenv_python,
                             endpoints=endpoints(server.url, sum_server))
            try:
                outcomes, calls = play_episodes(server, pool, rows, 60)
            finally:
                pool.close()
        for i in range(len(rows)):
            assert outcomes[i].error is None and outcomes[i].value == reward, (outcomes[i], calls[i])
            assert len(calls[i]) == turns
            sample = episode_sample(calls[i], prompt_text="", group_id=0, sample_index=0, metadata={})
            assert sample.error is None
            # each later call continues the earlier ones' ids: the hint is an observation after them
            for before, after in zip(calls[i], calls[i][1:]):
                head = before.prompt_ids + before.completion_ids
                assert after.prompt_ids[: len(head)] == head


def test_a_url_alone_plays_through_openenv_s_generic_client(openenv_python, sum_server):
    """task.env=openenv:http://... : openenv-core's GenericEnvClient (actions and observations as
    dicts) plays the same environment, with the same rewards, as its own typed client."""
    tok = calculator_tokenizer()
    kwargs = {"client": "openenv.core.generic_client:GenericEnvClient", "server_url": sum_server,
              "action_field": "message", "max_turns": 2}
    rows = [{"prompt": "", "seed": s} for s in range(4)]
    with AgentServer(tok, _policy(tok, True), max_new_tokens=8, max_model_len=256) as server:
        pool = AgentPool("reward.agents.openenv:episode", ROOT, 2, AgentLimits(30.0), kwargs, python=openenv_python,
                         endpoints=endpoints(server.url, sum_server))
        try:
            outcomes, calls = play_episodes(server, pool, rows, 60)
        finally:
            pool.close()
    for i in range(len(rows)):  # wrong first (0), then right after the hint
        assert outcomes[i].error is None and outcomes[i].value == 1.0 and len(calls[i]) == 2, (outcomes[i], calls[i])


def test_a_server_that_hangs_or_is_gone_costs_only_its_episode(openenv_python, sum_server, tmp_path):
    """A row sent to a server that accepts but never answers (a hang: the episode's deadline ends
    it) or to a closed port (gone: the client raises) is an error; the other rows play."""
    tok = calculator_tokenizer()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections, never answers the WebSocket handshake
    hung_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    gone_url = f"http://127.0.0.1:{_free_port()}"
    (tmp_path / "by_row.py").write_text(
        "from reward.agents.openenv import episode\n\n"
        "async def play(base_url, row, **kw):\n"
        "    return await episode(base_url, row, **{**kw, 'server_url': row.get('server_url') or kw['server_url']})\n")
    rows = [{"prompt": "", "seed": 1}, {"prompt": "", "seed": 2, "server_url": hung_url},
            {"prompt": "", "seed": 3, "server_url": gone_url}, {"prompt": "", "seed": 4}]
    with AgentServer(tok, _policy(tok, False), max_new_tokens=8, max_model_len=256) as server:
        pool = AgentPool(f"{tmp_path}/by_row.py:play", str(tmp_path), 4, AgentLimits(8.0),
                         {"client": CLIENT, "server_url": sum_server}, python=openenv_python,
                         endpoints=endpoints(server.url, sum_server, hung_url, gone_url))
        try:
            t0 = time.monotonic()
            outcomes, _ = play_episodes(server, pool, rows, 30)
            took = time.monotonic() - t0
        finally:
            silent.close()
            pool.close()
    assert outcomes[0].value == 1.0 and outcomes[3].value == 1.0
    assert "did not return within task.agent_timeout_s=8 s" in outcomes[1].error
    assert outcomes[2].error and "onnect" in outcomes[2].error, outcomes[2].error
    assert took < 25


def test_two_training_steps_on_the_sum_environment(openenv_python, sum_server, tiny_calc, tmp_path):
    """task=openenv_sum for 2 steps on the tiny chat model: learner and engine agree on every
    model token's log-prob at step 0 (the episodes are token-exact across turns and hints), and
    each logged reward is the environment's own verdict (1 when an answer is a+b, within 2 tries)."""
    from examples.openenv_sum import write_data
    from tests.conftest import two_agent_steps

    out, _ = tiny_calc
    rows = two_agent_steps(["task=openenv_sum", f"model.path={out}/model", f"task.agent_python={openenv_python}",
                            f"task.env_kwargs.server_url={sum_server}"], write_data, tmp_path)
    for r in rows:  # the environment's question for the row's reset seed, as server.py draws it
        rng = random.Random(r["data"]["seed"])
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        answers = [t["text"].strip() for t in r["turns"] if t["role"] == "model"]
        assert r["reward"] == float(str(a + b) in answers[:2]), r


def test_an_episode_that_max_turns_ends_before_done_is_truncated_with_its_reward(openenv_python, sum_server):
    """max_turns=1 and a wrong first answer: the environment is not done (it offers a retry) when the
    turns run out, so the sample is truncated (its note tells the runner), not an error, keeping the
    environment's reward so far (0.0); with max_turns=2 the same episode is done and not truncated."""
    from reward.agents.runner import AgentRunner

    class NoRepairs:
        def repair(self) -> None:
            pass

    tok = calculator_tokenizer()
    samples = {}
    with AgentServer(tok, _policy(tok, True), max_new_tokens=8, max_model_len=256) as server:
        for max_turns in (1, 2):
            kwargs = {"client": CLIENT, "server_url": sum_server, "max_turns": max_turns}
            pool = AgentPool("reward.agents.openenv:episode", ROOT, 1, AgentLimits(30.0), kwargs, python=openenv_python,
                             endpoints=endpoints(server.url, sum_server))
            runner = AgentRunner(server, pool, NoRepairs(), name="reward.agents.openenv:episode", prompt_key="prompt",
                                 timeout_s=30.0, workers=1, max_len=256, decode=tok.decode)
            try:
                [samples[max_turns]] = runner.run([GenerationRequest(prompt_ids=tok("x").input_ids, prompt_text="",
                                                                     group_id=0, sample_index=0, seed=1,
                                                                     metadata={"seed": 3})])
            finally:
                runner.close()
    cut, done = samples[1], samples[2]
    assert cut.error is None and cut.truncated and cut.turns[-1].reward == 0.0, cut.error
    assert sum(t.role == "model" for t in cut.turns) == 1
    assert done.error is None and not done.truncated and done.turns[-1].reward == 1.0, done.error
