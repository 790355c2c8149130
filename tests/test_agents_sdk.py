"""An agent written with the OpenAI Agents SDK (`agents.Agent`, a function tool, `Runner`) runs
unchanged against the agent server, through the SDK's own chat-completions switch
(examples/calculator_agents_sdk.py): its tool call is parsed from the model's text and run by the
SDK, the tool's answer and the SDK's resent assistant message continue the recorded ids token
for token, and the episode's reward is the agent's verdict. The training run is in
tests/test_e2e.py (agent kinds)."""

from __future__ import annotations

import multiprocessing

import pytest

pytest.importorskip("agents")  # the test extra installs openai-agents (pyproject.toml)

from examples.calculator import calculator_tokenizer  # noqa: E402
from rl.data.agent_calls import episode_sample  # noqa: E402
from rl.data.tools import ToolCall, format_tool_call  # noqa: E402
from rl.data.types import GenerationRequest, Sample  # noqa: E402
from reward.agents.server import AgentServer  # noqa: E402


def _scripted(tok, turns: list[str]):
    """A policy that writes `turns` in order (each ending with EOS), keeping the requests."""
    requests: list[GenerationRequest] = []

    def generate(request: GenerationRequest) -> Sample:
        requests.append(request)
        text = turns[len(requests) - 1]
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return Sample(request.prompt_ids, ids, [-0.25] * len(ids), "stop", 3, "", text, 0, 0)

    return generate, requests


def _episodes(episodes: list[tuple[str, dict]], out) -> None:
    from examples.calculator_agents_sdk import solve

    for url, row in episodes:
        try:
            out.put(("ok", solve(url, row)))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            out.put(("error", f"{type(err).__name__}: {err}"))


def _run_agents(episodes: list[tuple[str, dict]], timeout_s: float = 60.0) -> list[tuple[str, object]]:
    """`solve` for each (base_url, row), in a process of their own, one after another (each
    episode's SDK defaults are set by `solve` itself)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_episodes, args=(episodes, out))
    proc.start()
    try:
        return [out.get(timeout=timeout_s) for _ in episodes]
    finally:
        proc.join(5)
        proc.kill()


@pytest.mark.slow  # a spawned process importing the SDK (~5 s)
def test_an_agents_sdk_agent_runs_unchanged_and_its_episode_is_token_exact() -> None:
    """Two episodes, a right and a wrong final answer after the same tool call."""
    tok = calculator_tokenizer()
    call = format_tool_call(ToolCall("calculator", {"expression": "2+3"}))
    answers = ["5", "6"]
    generate, requests = _scripted(tok, [call, answers[0], call, answers[1]])
    row = {"prompt": "2+3", "answer": "5"}
    with AgentServer(tok, generate, max_new_tokens=40, temperature=1.0, top_p=1.0, max_model_len=256) as server:
        opened = [server.open_episode(seed_base=i) for i in range(2)]
        outcomes = _run_agents([(url, row) for _, url in opened])
        recorded = [server.close_episode(key) for key, _ in opened]
    assert outcomes == [("ok", 1.0), ("ok", 0.0)]
    assert len(requests) == 4
    for answer, calls in zip(answers, recorded):
        assert len(calls) == 2
        # the first prompt is the user's question through the chat template, as the SDK sent it
        assert calls[0].prompt_ids == tok.apply_chat_template([{"role": "user", "content": "2+3"}],
                                                              add_generation_prompt=True, tokenize=True)["input_ids"]
        # the second: the sampled ids of the call, then the SDK's tool answer (the calculator ran: 5)
        head = calls[0].prompt_ids + calls[0].completion_ids
        assert calls[1].prompt_ids[: len(head)] == head
        assert tok.decode(calls[1].prompt_ids[len(head):]).replace(" ", "") == "<|tool|>5<|end|><|assistant|>"
        sample = episode_sample(calls, prompt_text="2+3", group_id=0, sample_index=0, metadata={})
        assert sample.error is None
        assert sample.completion_ids[-2:] == tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert sum(sample.completion_mask) == len(calls[0].completion_ids) + len(calls[1].completion_ids)


BROKEN_ON_EVEN = '''
from agents.exceptions import ModelBehaviorError

from examples.calculator_agents_sdk import solve as sdk_solve


def solve(base_url, row):
    """The SDK agent, except that on rows with an even answer the SDK fails (a framework error)."""
    if int(row["answer"]) % 2 == 0:
        raise ModelBehaviorError("the model's reply did not parse")
    return sdk_solve(base_url, row)
'''


@pytest.mark.slow
@pytest.mark.full  # two steps of streaming agent episodes (~2 min)
def test_an_agents_sdk_agent_trains_and_a_framework_error_costs_only_its_episode(tiny_calc, tmp_path):
    """task=calculator_agents_sdk for 2 steps on the tiny calculator model: learner and engine agree
    on every model token's log-prob at step 0 (the episodes are token-exact), each logged reward
    is the agent's own verdict on its final answer, and the episodes whose SDK run raised are error
    samples while the rest train."""
    import json

    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config

    out, _ = tiny_calc
    (tmp_path / "broken_agent.py").write_text(BROKEN_ON_EVEN)
    cfg = compose_config(["task=calculator_agents_sdk", f"task.agent={tmp_path}/broken_agent.py:solve",
                          f"model.path={out}/model", f"task.train_files=[{out}/data/train.jsonl]",
                          f"run.dir={tmp_path}/run", "run.progress=false", "run.steps=2", "task.prompts_per_step=4",
                          "run.save_every=0", "run.save_final_model=false", "run.log_samples_per_step=32"])
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2 and metrics[0]["sync/logprob_max_abs_diff"] < 1e-3
    rows = [json.loads(line) for line in open(f"{cfg.run.dir}/samples.jsonl")]
    broken = [r for r in rows if int(r["data"]["answer"]) % 2 == 0]
    fine = [r for r in rows if int(r["data"]["answer"]) % 2 == 1]
    assert broken and fine, "the test's rows need both kinds"
    assert all(r["reward"] is None and "ModelBehaviorError" in r["error"] for r in broken)
    for r in fine:
        assert r["error"] is None, r["error"]
        last = r["turns"][-1]
        verdict = float(last["role"] == "model" and "<tool_call>" not in last["text"]
                        and last["text"].strip() == str(r["data"]["answer"]))
        assert r["reward"] == verdict, r
    assert sum(m["reward/errors_count"] for m in metrics) == len([r for r in rows if r["error"]])
