"""The agent server (`rollout.agent_server`) and its episodes (`rl.data.agent_calls`): agents written
with the plain `openai` client, served by the real SmolLM2-135M-Instruct through `HFEngine` (fp32,
CPU), give token-exact trajectories whose log-probs the model itself reproduces.

SmolLM2-135M does not call tools by itself, so the agent here appends a tool result after every
turn anyway (the observation path); the tool-call round trip (`tool_calls` returned, sent back,
prefix reused) is checked with a scripted policy that writes a fixed tool call.
"""

from __future__ import annotations

import json
import os
import threading

import httpx
import openai
import pytest
import torch

from rl.config.schema import ModelConfig, RolloutConfig
from rl.data.agent_calls import RecordedCall, episode_sample
from rl.data.types import GenerationRequest, Sample
from rollout.agent_server import AgentServer, split_tool_calls
from rollout.hf_engine import HFEngine
from rollout.protocol import RolloutSpec

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = os.path.join(ROOT, "artifacts", "smollm2-135m-instruct")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = ('You can use a calculator. Call it like <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "12+34"}}</tool_call> and wait for its answer.')
TEMPERATURE = 0.8


# ---- fixtures: the real model behind the server ----------------------------------------------------

@pytest.fixture(scope="module")
def model_path(request) -> str:
    if os.path.exists(os.path.join(MODEL, "config.json")):
        return MODEL
    return request.getfixturevalue("smollm2")  # converted from the installed package when not prepared


@pytest.fixture(scope="module")
def engine(model_path) -> HFEngine:
    rollout = RolloutConfig(backend="hf", temperature=1.0, top_p=1.0, max_new_tokens=16, max_model_len=1024)
    return HFEngine(RolloutSpec(ModelConfig(path=model_path, dtype="float32"), rollout, seed=0))


@pytest.fixture(scope="module")
def server(engine):
    lock = threading.Lock()  # HFEngine draws from torch's global RNG: one generate at a time

    def generate(request: GenerationRequest) -> Sample:
        with lock:
            return engine.generate([request])[0]

    with AgentServer(engine.tokenizer, generate, max_tokens_default=16, temperature_default=1.0,
                     max_model_len=1024) as s:
        yield s


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)


def rescored_logprobs(engine: HFEngine, ids: list[int], temperature: float) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one plain forward pass, at the sampling temperature."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def assert_chained(calls: list[RecordedCall], sample: Sample) -> list[list[int]]:
    """The sample is the calls chained: every model turn is a call's completion exactly as sampled,
    every observation the ids between one call's prompt + completion and the next prompt. Returns
    the observations."""
    assert sample.error is None, sample.error
    assert sample.prompt_ids == calls[0].prompt_ids
    assert sample.prompt_ids + sample.completion_ids == calls[-1].prompt_ids + calls[-1].completion_ids
    model = [t for t in sample.turns if t.role == "model"]
    assert [sample.completion_ids[t.start:t.end] for t in model] == [c.completion_ids for c in calls]
    assert [sample.logprobs[t.start:t.end] for t in model] == [c.logprobs for c in calls]
    observations = []
    for before, after in zip(calls, calls[1:]):
        head = before.prompt_ids + before.completion_ids
        assert after.prompt_ids[: len(head)] == head
        observations.append(after.prompt_ids[len(head):])
    kept = [i for i, m in zip(sample.completion_ids, sample.completion_mask) if m == 1]
    assert kept == [t for c in calls for t in c.completion_ids]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.completion_mask) if m == 0)
    return observations


# ---- the real model ---------------------------------------------------------------------------------

def test_tool_conversation_is_token_exact_and_the_model_rescores_it(server, engine):
    """A 3-call agent through the openai client: the trajectory chains the calls token-exactly,
    observations are the template's tool turn tokenized once, versions date every token, and a
    plain forward pass reproduces every sampled token's log-prob within 1e-3."""
    tok = engine.tokenizer
    c = client(server.open_episode("conv", seed_base=7, metadata={"answer": "46"}))
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12+34?"}]
    responses = []
    try:
        for turn in range(3):
            engine.version = turn  # a weight sync between calls: each call's tokens carry their version
            r = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=TEMPERATURE,
                                          max_tokens=16, logprobs=True)
            responses.append(r)
            msg = r.choices[0].message
            # agents send the message back as the object itself or as a dict: both are matched
            messages.append(msg if turn == 0 else msg.model_dump())
            for tc in msg.tool_calls or [None]:  # no tool call from this model: a tool result anyway
                messages.append({"role": "tool", "content": "46", **({"tool_call_id": tc.id} if tc else {})})
    finally:
        engine.version = 0
    calls = server.close_episode("conv")
    assert len(calls) == 3
    sample = episode_sample(calls, prompt_text="What is 12+34?", group_id=3, sample_index=1,
                            metadata={"answer": "46"}, decode=tok.decode)
    observations = assert_chained(calls, sample)
    assert [t.role for t in sample.turns] == ["model", "observation"] * 2 + ["model"]
    assert (sample.group_id, sample.sample_index, sample.metadata) == (3, 1, {"answer": "46"})

    # the first prompt is the template's rendering; each observation is its tool turn (after the
    # EOS the template closes a cut-off turn with, as an observation token)
    first = tok.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert calls[0].prompt_ids == list(first)
    for call, obs in zip(calls, observations):
        assert call.completion_ids[-1] == tok.eos_token_id or call.finish_reason == "length"
        assert (obs[0] == tok.eos_token_id) == (call.finish_reason == "length")
        assert tok.decode(obs).endswith("<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n")

    # what the agent was told is what was recorded
    for r, call in zip(responses, calls):
        assert r.usage.prompt_tokens == len(call.prompt_ids) and r.usage.completion_tokens == len(call.completion_ids)
        assert [x.logprob for x in r.choices[0].logprobs.content] == call.logprobs
        if not r.choices[0].message.tool_calls:  # (this model does not call tools: nothing cut out)
            assert r.choices[0].message.content == call.completion_text

    # versions: each model token its call's, each observation token the version before it
    expected = []
    for turn, call in enumerate(calls):
        expected += [turn] * len(call.completion_ids) + ([turn] * len(observations[turn]) if turn < 2 else [])
    assert sample.token_versions == expected and sample.policy_version == 0

    # the learner's view: one forward pass over the whole trajectory at the sampling temperature
    ids = sample.prompt_ids + sample.completion_ids
    rescored = rescored_logprobs(engine, ids, TEMPERATURE)[len(sample.prompt_ids) - 1:]
    diffs = [abs(a - b) for a, b, m in zip(rescored, sample.logprobs, sample.completion_mask) if m == 1]
    assert len(diffs) == sum(len(c.completion_ids) for c in calls)
    print("finish reasons:", [c.finish_reason for c in calls], "max |logprob diff|:", max(diffs))
    assert max(diffs) < 1e-3, max(diffs)


def test_an_agent_that_rewrites_its_history_gets_an_error_sample(server):
    c = client(server.open_episode("rewrite", seed_base=1))
    first = [{"role": "user", "content": "Name a color."}]
    r = c.chat.completions.create(model="policy", messages=first, max_tokens=4)
    c.chat.completions.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": "Name a fruit."}, r.choices[0].message, {"role": "user", "content": "Another."}])
    calls = server.close_episode("rewrite")
    sample = episode_sample(calls, prompt_text="", group_id=0, sample_index=0, metadata={})
    assert sample.error is not None and "rewrote its history" in sample.error and "call 1" in sample.error
    assert sample.prompt_ids == calls[0].prompt_ids and sample.completion_ids == calls[0].completion_ids
    assert sample.completion_mask == [1] * len(calls[0].completion_ids)


def test_two_episodes_from_two_threads_are_recorded_apart(server):
    topics = {"cats": "Say something about cats.", "rain": "Say something about rain."}
    urls = {key: server.open_episode(key, seed_base=i) for i, key in enumerate(topics)}
    errors: list[BaseException] = []

    def agent(key: str) -> None:
        try:
            c = client(urls[key])
            messages: list = [{"role": "user", "content": topics[key]}]
            for _ in range(2):
                r = c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
                messages += [r.choices[0].message, {"role": "user", "content": f"More about {key}."}]
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=agent, args=(key,)) for key in topics]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for key, text in topics.items():
        calls = server.close_episode(key)
        assert len(calls) == 2
        sample = episode_sample(calls, prompt_text=text, group_id=0, sample_index=0, metadata={})
        assert_chained(calls, sample)
        tok = server.tokenizer
        whole = tok.decode(sample.prompt_ids + sample.completion_ids)
        assert text in whole and f"More about {key}." in whole
        assert all(other not in whole for other in topics.values() if other != text)


def test_streaming_and_completions_are_recorded_too(server, engine):
    tok = engine.tokenizer
    c = client(server.open_episode("stream", seed_base=2))
    chunks = list(c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=5, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    [call] = server.close_episode("stream")
    assert text == call.completion_text and len(call.completion_ids) <= 5

    # /completions: a text prompt continued by the agent reuses the sampled ids, the rest tokenized once
    c = client(server.open_episode("text", seed_base=3))
    prompt = "The capital of France is"
    r1 = c.completions.create(model="policy", prompt=prompt, max_tokens=4, logprobs=1)
    follow = prompt + r1.choices[0].text + " Also,"
    r2 = c.completions.create(model="policy", prompt=follow, max_tokens=4)
    calls = server.close_episode("text")
    assert calls[0].prompt_ids == list(tok(prompt).input_ids)
    assert r1.choices[0].logprobs.token_logprobs == calls[0].logprobs
    assert r2.usage.prompt_tokens == len(calls[1].prompt_ids)
    sample = episode_sample(calls, prompt_text=prompt, group_id=0, sample_index=0, metadata={})
    [obs] = assert_chained(calls, sample)
    assert obs == list(tok(" Also,", add_special_tokens=False).input_ids)


def test_errors_are_openai_json_naming_the_problem(server):
    base = server.open_episode("errs", seed_base=0)
    c = client(base)
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.NotFoundError) as err:
        client(server.base_url("nobody")).chat.completions.create(model="policy", messages=hello)
    assert err.value.code == "episode_not_found" and "unknown episode 'nobody'" in err.value.message
    for kwargs, param in (({"n": 2}, "n"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"stop": ["x"]}, "stop"),
                          ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
                          ({"top_p": 0.5}, "top_p"), ({"extra_body": {"top_k": 5}}, "top_k"),
                          ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="policy", messages=hello, **kwargs)
        assert err.value.param == param and param in err.value.message, (kwargs, err.value.message)
        assert err.value.body["type"] == "invalid_request_error"
    raw = httpx.post(f"{base}/chat/completions", json={"model": "policy"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "messages"
    raw = httpx.post(f"{base}/chat/completions", content=b"{not json")
    assert raw.status_code == 400 and "not JSON" in raw.json()["error"]["message"]
    raw = httpx.post(f"{base}/completions", json={"prompt": ["a", "b"]})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"
    raw = httpx.get(f"{server.url}/v1/models")
    assert raw.status_code == 404 and "error" in raw.json()
    with pytest.raises(openai.BadRequestError) as err:  # over max_model_len=1024
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi " * 1100}])
    assert err.value.code == "context_length_exceeded"
    assert server.close_episode("errs") == []  # nothing above was sampled or recorded
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="policy", messages=hello)
    assert err.value.code == "episode_closed" and "closed" in err.value.message
    with pytest.raises(openai.NotFoundError):
        c.models.list()
    with pytest.raises(KeyError):
        server.close_episode("errs")
    with pytest.raises(ValueError, match="episode key"):
        server.open_episode("a/b", seed_base=0)


# ---- the server's bookkeeping, with a scripted policy ------------------------------------------------

CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'


def test_tool_calls_are_returned_and_their_message_reuses_the_sampled_ids(engine):
    """A policy that writes a fixed tool call (in ids that are not the text's own tokenization),
    then an answer: the agent gets OpenAI tool_calls, sends the message back (with ids, arguments
    as JSON text), and the next prompt is the sampled ids + the tool turn, never the call
    re-rendered. Seeds derive from (seed_base, call index) unless the body gives one."""
    tok = engine.tokenizer
    pieces = [["Let me comp", "ute. ", CALL_TEXT], ["It is 46."]]  # "comp"+"ute": not how "compute" tokenizes
    sampled = [[t for p in parts for t in tok(p, add_special_tokens=False).input_ids] + [tok.eos_token_id]
               for parts in pieces]
    assert sampled[0][:-1] != list(tok("".join(pieces[0]), add_special_tokens=False).input_ids)
    seeds: list[int] = []

    def scripted(request: GenerationRequest) -> Sample:
        seeds.append(request.seed)
        ids = sampled[len(seeds) - 1]
        return Sample(request.prompt_ids, ids, [-0.5] * len(ids), "stop", 4, "", "".join(pieces[len(seeds) - 1]),
                      0, 0)

    with AgentServer(tok, scripted) as s:
        c = client(s.open_episode("tools", seed_base=11))
        messages: list = [{"role": "user", "content": "What is 12+34?"}]
        r = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me compute."
        [tc] = msg.tool_calls
        assert tc.type == "function" and tc.function.name == "calculator"
        assert json.loads(tc.function.arguments) == {"expression": "12+34"}
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "46"}]
        r2 = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, seed=5)
        assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
        calls = s.close_episode("tools")
    head = calls[0].prompt_ids + calls[0].completion_ids  # re-rendering the call would re-tokenize "compute"
    assert calls[0].completion_ids == sampled[0] and calls[1].prompt_ids[: len(head)] == head
    assert tok.decode(calls[1].prompt_ids[len(head):]) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
    sample = episode_sample(calls, prompt_text="", group_id=0, sample_index=0, metadata={})
    assert sample.error is None and sample.token_versions == [4] * len(sample.completion_ids)
    from rl.data.dataset import derive_seed
    assert seeds == [derive_seed(11, 0), 5]


def test_a_failing_fleet_is_a_500_and_records_nothing(engine):
    def broken(request: GenerationRequest) -> Sample:
        raise RuntimeError("rollout worker died")

    server = AgentServer(engine.tokenizer, broken)
    with pytest.raises(RuntimeError, match="start"):
        server.open_episode("early", seed_base=0)
    with server:
        c = client(server.open_episode("down", seed_base=0))
        with pytest.raises(openai.InternalServerError) as err:
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "generation_failed" and "rollout worker died" in err.value.message
        assert server.close_episode("down") == []


@pytest.mark.parametrize("text,content,calls", [
    ("plain answer", "plain answer", []),
    (CALL_TEXT, None, [("calculator", {"expression": "12+34"})]),
    ('a <tool_call> {"name": "f", "arguments": "{\\"x\\": 1}"} </tool_call> b <tool_call>{"name": "g"}</tool_call>',
     "a  b", [("f", {"x": 1}), ("g", {})]),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # malformed: raw text
    ('<tool_call>{"name": "f", "arguments"', '<tool_call>{"name": "f", "arguments"', []),  # cut off
])
def test_split_tool_calls(text, content, calls):
    got_content, got = split_tool_calls(text)
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls


# ---- episode_sample on recorded calls -----------------------------------------------------------------

def _call(prompt: list[int], completion: list[int], version: int, finish: str = "stop") -> RecordedCall:
    return RecordedCall(prompt, completion, [-0.1] * len(completion), [version] * len(completion), finish,
                        f"t{version}", version)


def test_episode_sample_chains_calls_and_dates_observations():
    calls = [_call([1, 2], [3, 4], 0), _call([1, 2, 3, 4, 5, 6], [7], 1), _call([1, 2, 3, 4, 5, 6, 7], [8, 9], 2)]
    s = episode_sample(calls, prompt_text="p", group_id=2, sample_index=5, metadata={"a": 1},
                       decode=lambda ids: ",".join(map(str, ids)))
    assert (s.prompt_ids, s.completion_ids) == ([1, 2], [3, 4, 5, 6, 7, 8, 9])
    assert s.completion_mask == [1, 1, 0, 0, 1, 1, 1]
    assert s.logprobs == [-0.1, -0.1, 0.0, 0.0, -0.1, -0.1, -0.1]
    assert s.token_versions == [0, 0, 0, 0, 1, 2, 2] and s.policy_version == 0
    assert [(t.role, t.start, t.end, t.text) for t in s.turns] == [
        ("model", 0, 2, "t0"), ("observation", 2, 4, "5,6"), ("model", 4, 5, "t1"), ("model", 5, 7, "t2")]
    assert (s.completion_text, s.finish_reason, s.error, s.group_id, s.sample_index) == ("t2", "stop", None, 2, 5)


def test_episode_sample_errors_and_max_len():
    empty = episode_sample([], prompt_text="p", group_id=0, sample_index=0, metadata={})
    assert "no model call" in empty.error and empty.completion_ids == []
    calls = [_call([1, 2], [3, 4], 0), _call([1, 9, 3, 4, 5], [6], 0)]
    cut = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={})
    assert "rewrote its history" in cut.error and "first difference at token 1" in cut.error
    assert cut.completion_ids == [3, 4]
    calls = [_call([1, 2], [3, 4], 0), _call([1, 2, 3, 4, 5, 6], [7, 8], 1)]
    short = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=5)
    assert short.error is None and short.finish_reason == "length"
    assert (short.completion_ids, short.completion_mask, short.token_versions) == ([3, 4, 5], [1, 1, 0], [0, 0, 0])
    assert [(t.role, t.start, t.end) for t in short.turns] == [("model", 0, 2), ("observation", 2, 3)]
    over = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=1)
    assert "over max_len=1" in over.error and over.completion_ids == []
    with pytest.raises(ValueError, match="token versions"):
        RecordedCall([1], [2, 3], [0.0, 0.0], [0], "stop", "")


# ---- the runner of task.agent episodes (rl/run/agents.py) over the real server ----------------------

def test_agent_runner_rewards_names_failures_and_drops_an_agent_past_its_deadline(server):
    """Each request runs the agent against its own base URL; its return value rewards the episode's
    last model turn; an agent that raises, and one that never returns (past task.agent_timeout_s),
    come back as error samples naming that, and the runner goes on."""
    import time

    from rl.data.episodes import with_episode_rewards
    from rl.run.agents import AgentRunner

    release = threading.Event()

    def agent(base_url: str, row: dict, bonus: float = 0.0) -> float:
        if row["kind"] == "raise":
            raise ValueError("tool crashed")
        reply = client(base_url).chat.completions.create(model="policy", messages=[
            {"role": "user", "content": row["prompt"]}], max_tokens=4)
        if row["kind"] == "hang":
            release.wait(30)  # an agent stuck on something else than the model
        return 0.5 + bonus + 0 * len(reply.choices)

    class NoFleet:
        repairs = 0

        def repair(self):
            self.repairs += 1

    runner = AgentRunner(server, agent, NoFleet(), prompt_key="prompt", workers=4, timeout_s=3.0, max_len=1024,
                         agent_kwargs={"bonus": 0.25})
    kinds = ["ok", "raise", "hang"]
    runner.submit([GenerationRequest([1], "What is 2+2?", 7, i, seed=i, metadata={"kind": k})
                   for i, k in enumerate(kinds)])
    got, end = {}, time.monotonic() + 60
    while len(got) < 3:
        assert time.monotonic() < end
        got.update({s.sample_index: s for s in runner.drain(0.2)})
    release.set()
    runner.repair()
    runner.close()
    ok, raised, hung = got[0], got[1], got[2]
    scored = with_episode_rewards([ok, raised, hung], None)
    assert ok.error is None and scored[0].reward == 0.75 and ok.metadata == {"kind": "ok"}
    assert ok.completion_ids and set(ok.completion_mask) == {1} and ok.turns[-1].reward == 0.75
    assert raised.error == "task.agent raised ValueError: tool crashed" and scored[1].reward is None
    assert "did not return within task.agent_timeout_s=3" in hung.error and scored[2].reward is None
