"""The agent server (`reward.agents.server`) and its episodes (`rl.data.agent_calls`): agents written
with the plain `openai` client, served by the real SmolLM2-135M-Instruct through `HFEngine` (fp32,
CPU), give token-exact trajectories whose log-probs the model itself reproduces.

SmolLM2-135M does not call tools by itself, so the agent here appends a tool result after every
turn anyway (the observation path); the tool-call round trip (`tool_calls` returned, sent back,
prefix reused) is checked with a scripted policy that writes a fixed tool call.

Agents are untrusted: hostile and broken clients (wrong keys, off-policy sampling fields, token ids
out of the vocabulary, huge, deep, malformed or slow bodies, silent connections) are sent over real
HTTP to a server in front of a fake policy that answers at once, each refusal checked for its
status and the field it names, and for nothing reaching the engine or the record.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
import torch

from rl.config.schema import ModelConfig, RolloutConfig
from rl.data.agent_calls import RecordedCall, episode_sample
from rl.data.types import GenerationRequest, Sample
from reward.agents.chat import split_tool_calls
from reward.agents.server import MAX_HEADER_BYTES, AgentServer, RequestRejected
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
def model_path(smollm2) -> str:
    """The prepared folder where there is one, else the session's (converted from the installed
    package in the background once the session's tests are collected: tests/prebuild.py)."""
    return MODEL if os.path.exists(os.path.join(MODEL, "config.json")) else smollm2


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

    with AgentServer(engine.tokenizer, generate, max_new_tokens=16, temperature=1.0, max_model_len=1024) as s:
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

@pytest.mark.slow  # the real model (module fixture `engine`, ~30 s to load): outside the fast lane
@pytest.mark.full
def test_tool_conversation_is_token_exact_and_the_model_rescores_it(server, engine):
    """A 3-call agent through the openai client: the trajectory chains the calls token-exactly,
    observations are the template's tool turn tokenized once, versions date every token, and a
    plain forward pass reproduces every sampled token's log-prob within 1e-3."""
    tok = engine.tokenizer
    key, url = server.open_episode(seed_base=7, metadata={"answer": "46"}, temperature=TEMPERATURE)
    c = client(url)
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
    calls = server.close_episode(key)
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


@pytest.mark.slow  # the real model (module fixture `server` -> `engine`)
@pytest.mark.full
def test_an_agent_that_rewrites_its_history_gets_a_new_segment(server):
    key, url = server.open_episode(seed_base=1)
    c = client(url)
    first = [{"role": "user", "content": "Name a color."}]
    r = c.chat.completions.create(model="policy", messages=first, max_tokens=4)
    c.chat.completions.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": "Name a fruit."}, r.choices[0].message, {"role": "user", "content": "Another."}])
    calls = server.close_episode(key)
    sample = episode_sample(calls, prompt_text="", group_id=0, sample_index=0, metadata={})
    assert sample.error is None and len(sample.segments) == 1  # its edited history starts a segment (issue 59)
    first = sample.segments[0]
    assert first.prompt_ids == calls[0].prompt_ids and first.completion_ids == calls[0].completion_ids
    assert first.completion_mask == [1] * len(calls[0].completion_ids)
    assert sample.prompt_ids == calls[1].prompt_ids and sample.completion_ids == calls[1].completion_ids


@pytest.mark.slow  # the real model (module fixture `server` -> `engine`)
@pytest.mark.full
def test_two_episodes_from_two_threads_are_recorded_apart(server):
    topics = {"cats": "Say something about cats.", "rain": "Say something about rain."}
    episodes = {topic: server.open_episode(seed_base=i) for i, topic in enumerate(topics)}
    errors: list[BaseException] = []

    def agent(topic: str) -> None:
        try:
            c = client(episodes[topic][1])
            messages: list = [{"role": "user", "content": topics[topic]}]
            for _ in range(2):
                r = c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
                messages += [r.choices[0].message, {"role": "user", "content": f"More about {topic}."}]
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=agent, args=(topic,)) for topic in topics]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for topic, text in topics.items():
        calls = server.close_episode(episodes[topic][0])
        assert len(calls) == 2
        sample = episode_sample(calls, prompt_text=text, group_id=0, sample_index=0, metadata={})
        assert_chained(calls, sample)
        tok = server.tokenizer
        whole = tok.decode(sample.prompt_ids + sample.completion_ids)
        assert text in whole and f"More about {topic}." in whole
        assert all(other not in whole for other in topics.values() if other != text)


@pytest.mark.slow  # the real model (module fixture `engine`)
@pytest.mark.full
def test_streaming_and_completions_are_recorded_too(server, engine):
    tok = engine.tokenizer
    key, url = server.open_episode(seed_base=2)
    c = client(url)
    chunks = list(c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=5, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    [call] = server.close_episode(key)
    assert text == call.completion_text and len(call.completion_ids) <= 5

    # /completions: a text prompt continued by the agent reuses the sampled ids, the rest tokenized once
    key, url = server.open_episode(seed_base=3)
    c = client(url)
    prompt = "The capital of France is"
    r1 = c.completions.create(model="policy", prompt=prompt, max_tokens=4, logprobs=1)
    follow = prompt + r1.choices[0].text + " Also,"
    r2 = c.completions.create(model="policy", prompt=follow, max_tokens=4)
    calls = server.close_episode(key)
    assert calls[0].prompt_ids == list(tok(prompt).input_ids)
    assert r1.choices[0].logprobs.token_logprobs == calls[0].logprobs
    assert r2.usage.prompt_tokens == len(calls[1].prompt_ids)
    sample = episode_sample(calls, prompt_text=prompt, group_id=0, sample_index=0, metadata={})
    [obs] = assert_chained(calls, sample)
    assert obs == list(tok(" Also,", add_special_tokens=False).input_ids)


@pytest.mark.slow  # the real model (module fixture `server` -> `engine`)
@pytest.mark.full
def test_errors_are_openai_json_naming_the_problem(server):
    key, base = server.open_episode(seed_base=0)
    c = client(base)
    hello = [{"role": "user", "content": "hello"}]
    for kwargs, param in (({"n": 2}, "n"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"stop": ["x"]}, "stop"),
                          ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
                          ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"),
                          ({"extra_body": {"top_k": 5}}, "top_k"), ({"max_tokens": 0}, "max_tokens")):
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
    with pytest.raises(openai.BadRequestError) as err:  # over max_model_len=1024
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi " * 1100}])
    assert err.value.code == "context_length_exceeded"
    assert server.close_episode(key) == []  # nothing above was sampled or recorded
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="policy", messages=hello)
    assert err.value.code == "episode_not_found" and key not in err.value.message
    with pytest.raises(openai.NotFoundError):
        c.models.list()
    with pytest.raises(KeyError):
        server.close_episode(key)


# ---- the server's bookkeeping, with a scripted policy ------------------------------------------------

CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'


@pytest.mark.slow  # the real model (module fixture `engine`)
@pytest.mark.full
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
        key, url = s.open_episode(seed_base=11)
        c = client(url)
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
        calls = s.close_episode(key)
    head = calls[0].prompt_ids + calls[0].completion_ids  # re-rendering the call would re-tokenize "compute"
    assert calls[0].completion_ids == sampled[0] and calls[1].prompt_ids[: len(head)] == head
    assert tok.decode(calls[1].prompt_ids[len(head):]) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
    sample = episode_sample(calls, prompt_text="", group_id=0, sample_index=0, metadata={})
    assert sample.error is None and sample.token_versions == [4] * len(sample.completion_ids)
    from rl.data.dataset import derive_seed
    assert seeds == [derive_seed(11, 0), 5]


@pytest.mark.slow  # the real model (module fixture `engine`)
@pytest.mark.full
def test_a_failing_fleet_is_a_500_and_records_nothing(engine):
    def broken(request: GenerationRequest) -> Sample:
        raise RuntimeError("rollout worker died")

    server = AgentServer(engine.tokenizer, broken)
    with pytest.raises(RuntimeError, match="start"):
        server.open_episode(seed_base=0)
    with server:
        key, url = server.open_episode(seed_base=0)
        c = client(url)
        with pytest.raises(openai.InternalServerError) as err:
            c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "generation_failed" and "rollout worker died" in err.value.message
        assert server.close_episode(key) == []


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
    assert cut.error is None and cut.segments[0].completion_ids == [3, 4]  # a new segment (issue 59), no cut
    assert cut.prompt_ids == [1, 9, 3, 4, 5] and cut.completion_ids == [6]
    calls = [_call([1, 2], [3, 4], 0), _call([1, 2, 3, 4, 5, 6], [7, 8], 1)]
    short = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=5)
    assert short.error is None and short.finish_reason == "length"
    assert (short.completion_ids, short.completion_mask, short.token_versions) == ([3, 4, 5], [1, 1, 0], [0, 0, 0])
    assert [(t.role, t.start, t.end) for t in short.turns] == [("model", 0, 2), ("observation", 2, 3)]
    over = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=1)
    assert "over max_len=1" in over.error and over.completion_ids == []
    with pytest.raises(ValueError, match="token versions"):
        RecordedCall([1], [2, 3], [0.0, 0.0], [0], "stop", "")


# ---- hostile and broken clients, against a fast fake policy over real HTTP -----------------------------

MAX_NEW = 8
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer and chat template: the prepared folder's, else read straight from the
    installed package's GGUF file, as the conversion reads it (~5 s; converting the whole model
    for its tokenizer took ~30 s of the fast lane)."""
    from transformers import AutoTokenizer

    from examples.smollm2 import gguf_file

    if os.path.exists(os.path.join(MODEL, "config.json")):
        return AutoTokenizer.from_pretrained(MODEL)
    source = gguf_file()
    return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)


class FakePolicy:
    """`generate` answering at once with as many tokens as it may (`request.max_tokens`), keeping
    every request it got; `fault` makes it fail: "raise" (the fleet), "reject" (the engine refuses
    the parameters), "bug" (returns nothing: the server's own code then fails)."""

    def __init__(self, tokenizer):
        self.token = tokenizer.encode("ok", add_special_tokens=False)[0]
        self.requests: list[GenerationRequest] = []
        self.fault: str | None = None

    def __call__(self, request: GenerationRequest) -> Sample:
        self.requests.append(request)
        if self.fault == "raise":
            raise RuntimeError("rollout worker died")
        if self.fault == "reject":
            raise RequestRejected("temperature must be finite")
        if self.fault == "bug":
            return None  # type: ignore[return-value]
        ids = [self.token] * request.max_tokens
        return Sample(request.prompt_ids, ids, [-0.5] * len(ids), "length", 0, "", "ok" * len(ids), 0, 0)


@pytest.fixture(scope="module")
def fake(tokenizer):
    """The server with short deadlines in front of a FakePolicy (its `generate`). It keeps more
    unclaimed connections than the 322 of the deadline test, so there the deadlines close them,
    not the connection budget (tested on its own: test_a_connection_flood_costs_only_the_flooder...)."""
    with AgentServer(tokenizer, FakePolicy(tokenizer), max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0,
                     max_model_len=1024, read_timeout_s=1.0, keep_alive_s=0.5, max_unclaimed_connections=1024) as s:
        yield s


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_episode_keys_are_secret_and_every_wrong_key_gets_the_same_404(fake):
    """Keys are unguessable; a key that never existed, a closed one, a malformed one, the old counter
    keys and any other path all get the same bytes, /v1/models included; an agent whose episode is
    closed reaches no other episode, whose record stays as it was."""
    (mine, my_url), (other, other_url) = fake.open_episode(seed_base=0), fake.open_episode(seed_base=1)
    assert len(mine) >= 32 and mine != other and fake.open_count() >= 2
    assert httpx.post(f"{other_url}/completions", json={"prompt": [1, 2]}).status_code == 200
    assert httpx.get(f"{my_url}/models").json()["data"][0]["id"] == "policy"
    fake.close_episode(mine)
    answers = {httpx.get(f"{fake.url}/episodes/{key}/v1/models").content
               for key in (mine, "g0-s1-2", "nobody", "%00", "a" * 5000, mine[:-1])}
    answers |= {httpx.get(f"{fake.url}{path}").content for path in ("/v1/models", "/episodes//v1/models", "/")}
    # what an agent of a closed episode might try; the near miss differs from `other` in its last
    # character (a fixed "x" was `other` itself whenever `other` ended in x: 1 run in ~64 failed)
    near_miss = other[:-1] + ("y" if other.endswith("x") else "x")
    for key in (mine, "g0-s1-2", near_miss):
        r = httpx.post(f"{fake.url}/episodes/{key}/v1/chat/completions", json={"messages": HELLO})
        assert r.status_code == 404
        answers.add(r.content)
    assert len(answers) == 1
    [body] = answers
    assert json.loads(body)["error"]["code"] == "episode_not_found" and mine.encode() not in body
    [call] = fake.close_episode(other)
    assert call.prompt_ids == [1, 2]
    with pytest.raises(KeyError):
        fake.close_episode(other)


def _chat(**fields) -> dict:
    return {"messages": HELLO, **fields}


def _raw(fields: bytes, messages: bytes = b'[{"role": "user", "content": "x"}]') -> bytes:
    """A chat body as JSON text, for what a JSON encoder would not write (NaN, lone surrogates)."""
    return b'{"messages": ' + messages + (b", " + fields if fields else b"") + b"}"


TOOL_ARGUMENTS = b'"{\\"a\\": \\"\\\\ud800\\"}"'  # '{"a": "\ud800"}' as a JSON string in JSON

# (id, endpoint, body: a dict or the raw bytes, status, the `param` the error names)
HOSTILE = [
    ("temperature NaN", "chat/completions", _raw(b'"temperature": NaN'), 400, "temperature"),
    ("temperature inf", "chat/completions", _raw(b'"temperature": Infinity'), 400, "temperature"),
    ("temperature 3", "chat/completions", _chat(temperature=3), 400, "temperature"),
    ("temperature 0", "chat/completions", _chat(temperature=0), 400, "temperature"),
    ("temperature '1'", "chat/completions", _chat(temperature="1"), 400, "temperature"),
    ("temperature true", "chat/completions", _chat(temperature=True), 400, "temperature"),
    ("temperature the run's", "chat/completions", _chat(temperature=1), 200, None),
    ("top_p 0.9", "chat/completions", _chat(top_p=0.9), 400, "top_p"),
    ("top_p the run's", "completions", {"prompt": [1], "top_p": 1.0}, 200, None),
    ("top_k 5", "chat/completions", _chat(top_k=5), 400, "top_k"),
    ("top_k off", "chat/completions", _chat(top_k=-1), 200, None),
    ("min_p", "chat/completions", _chat(min_p=0.1), 400, "min_p"),
    ("presence_penalty", "chat/completions", _chat(presence_penalty=0.5), 400, "presence_penalty"),
    ("repetition_penalty", "completions", {"prompt": [1], "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("logit_bias", "chat/completions", _chat(logit_bias={"1": 100}), 400, "logit_bias"),
    ("logprobs_mode", "completions", {"prompt": [1], "logprobs_mode": "raw_logits"}, 400, "logprobs_mode"),
    ("top_logprobs", "chat/completions", _chat(logprobs=True, top_logprobs=5), 400, "top_logprobs"),
    ("n 2", "chat/completions", _chat(n=2), 400, "n"),
    ("n nested", "chat/completions", _chat(n=json.loads("[" * 500 + "]" * 500)), 400, "n"),
    ("best_of 2", "completions", {"prompt": [1], "best_of": 2}, 400, "best_of"),
    ("stop", "chat/completions", _chat(stop=["\n"]), 400, "stop"),
    ("unknown field", "chat/completions", _chat(ignore_eos=True), 400, "ignore_eos"),
    ("seed not int", "chat/completions", _chat(seed=1.5), 400, "seed"),
    ("token id -5", "completions", {"prompt": [1, -5]}, 400, "prompt[1]"),
    ("token id 10**9", "completions", {"prompt": [10**9]}, 400, "prompt[0]"),
    ("token id bool", "completions", {"prompt": [1, True]}, 400, "prompt[1]"),
    ("no token", "completions", {"prompt": []}, 400, "prompt"),
    ("max_tokens 1.5", "chat/completions", _chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens true", "completions", {"prompt": [1], "max_tokens": True}, 400, "max_tokens"),
    ("max_completion_tokens '4'", "chat/completions", _chat(max_completion_tokens="4"), 400, "max_completion_tokens"),
    ("deep JSON", "chat/completions", b"[" * 100_000, 400, None),
    ("deep inside", "chat/completions", _chat(metadata=json.loads("[" * 70 + "]" * 70)), 400, "metadata" + "[0]" * 64),
    ("NaN in metadata", "chat/completions", _raw(b'"metadata": {"a": NaN}'), 400, "metadata.a"),
    ("lone surrogate in content", "chat/completions", _raw(b"", b'[{"role": "user", "content": "a\\ud800"}]'),
     400, "messages[0].content"),
    ("lone surrogate in prompt", "completions", b'{"prompt": "\\udfff"}', 400, "prompt"),
    ("lone surrogate in a name", "chat/completions", _raw(b"", b'[{"role": "user", "name": "\\ud800", "content": ""}]'),
     400, "messages[0].name"),
    ("lone surrogate in tool arguments", "chat/completions", _raw(b"", b'[{"role": "user", "content": "x"}, {"role": '
     b'"assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '
     + TOOL_ARGUMENTS + b"}}]}]"), 400, "messages[1].tool_calls[0].function.arguments.a"),
    ("lone surrogate in a field name", "chat/completions", _raw(b'"\\ud800": 1'), 400, "the body"),
    ("stream_options", "chat/completions", _chat(stream=True, stream_options=[1]), 400, "stream_options"),
    ("not JSON", "chat/completions", b"{not json", 400, None),
    ("not an object", "completions", b"[1, 2]", 400, None),
]


@pytest.mark.parametrize("endpoint,body,status,param", [case[1:] for case in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_requests_are_refused_naming_the_field_and_nothing_reaches_the_engine(fake, endpoint, body, status,
                                                                                        param):
    key, url = fake.open_episode(seed_base=0)
    fake.generate.requests.clear()
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/{endpoint}", headers={"content-type": "application/json"}, **kwargs)
    calls = fake.close_episode(key)
    assert r.status_code == status, r.text
    if status == 200:
        assert len(calls) == 1 and [(q.temperature, q.max_tokens) for q in fake.generate.requests] == [(1.0, MAX_NEW)]
        return
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param is None or param in error["message"] or param == "the body"
    assert calls == [] and fake.generate.requests == []


def test_sampling_is_the_episodes_and_max_tokens_is_capped_through_the_openai_client(fake):
    """max_tokens over the cap is cut to max_new_tokens (silently); streaming works; an episode
    opened greedy (evaluation) samples at 0.0 and refuses the run's temperature."""
    key, url = fake.open_episode(seed_base=0)
    c = client(url)
    fake.generate.requests.clear()
    r = c.completions.create(model="policy", prompt=[1, 2, 3], max_tokens=10**6)
    assert r.usage.completion_tokens == MAX_NEW
    chunks = list(c.chat.completions.create(model="policy", messages=HELLO, stream=True, max_tokens=3,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "ok" * 3
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="policy", messages=HELLO, temperature=3)
    assert err.value.param == "temperature" and "send 1.0" in err.value.message
    assert [len(call.completion_ids) for call in fake.close_episode(key)] == [MAX_NEW, 3]
    assert [(q.temperature, q.max_tokens) for q in fake.generate.requests] == [(1.0, MAX_NEW), (1.0, 3)]

    key, url = fake.open_episode(seed_base=0, temperature=0.0)
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model="policy", messages=HELLO, temperature=1.0)
    assert err.value.param == "temperature" and "send 0.0" in err.value.message
    client(url).chat.completions.create(model="policy", messages=HELLO, temperature=0)
    assert len(fake.close_episode(key)) == 1 and fake.generate.requests[-1].temperature == 0.0


def test_faults_answer_on_a_connection_that_stays_usable(fake):
    """A 500 (the fleet failed, or the server's own code did) is a complete response on a
    keep-alive connection: the next request on the same connection is served. The engine refusing
    the parameters is a 400. Nothing of these is recorded."""
    key, url = fake.open_episode(seed_base=0)
    with httpx.Client() as c:
        def post(fault: str | None) -> httpx.Response:
            fake.generate.fault = fault
            try:
                return c.post(f"{url}/completions", json={"prompt": [1, 2]})
            finally:
                fake.generate.fault = None

        ok = post(None)
        addr = ok.extensions["network_stream"].get_extra_info("client_addr")
        for fault, status, code in (("raise", 500, "generation_failed"), ("bug", 500, "internal_error"),
                                    ("reject", 400, "request_rejected")):
            r = post(fault)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
            assert "connection" not in r.headers
            again = post(None)
            assert again.status_code == 200
            assert again.extensions["network_stream"].get_extra_info("client_addr") == addr  # the same connection
    assert len(fake.close_episode(key)) == 4


def test_close_episode_never_waits_and_calls_in_flight_are_bounded(tokenizer):
    """At most max_concurrent_calls calls wait on generate; an episode's calls take turns without
    holding a worker thread, so an agent flooding its own episode leaves room for the others.
    close_episode returns at once with calls in flight; they answer the same 404, unrecorded."""
    release, lock = threading.Event(), threading.Lock()
    running = [0, 0]  # now, most ever

    def slow(request: GenerationRequest) -> Sample:
        with lock:
            running[0] += 1
            running[1] = max(running)
        release.wait(10)
        with lock:
            running[0] -= 1
        return Sample(request.prompt_ids, [5], [-0.1], "stop", 0, "", "x", 0, 0)

    with AgentServer(tokenizer, slow, max_concurrent_calls=2, max_pending_per_episode=8) as s:
        (flooder, flood_url), (other, other_url), (kept, kept_url) = (s.open_episode(seed_base=i) for i in range(3))
        answers: dict[str, list[int]] = {flooder: [], other: [], kept: []}

        def call(key: str, url: str) -> None:
            answers[key].append(httpx.post(f"{url}/completions", json={"prompt": [1]}, timeout=20).status_code)

        threads = [threading.Thread(target=call, args=(flooder, flood_url)) for _ in range(6)]
        threads += [threading.Thread(target=call, args=(key, url)) for key, url in ((other, other_url),
                                                                                      (kept, kept_url))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while running[0] < 2 and time.monotonic() < deadline:  # the flooder's one call + another episode's
            time.sleep(0.01)
        start = time.monotonic()
        assert s.close_episode(flooder) == [] and s.close_episode(other) == []
        assert time.monotonic() - start < 0.1 and s.open_count() == 1
        release.set()
        for t in threads:
            t.join(timeout=20)
        assert answers == {flooder: [404] * 6, other: [404], kept: [200]} and running[1] == 2
        assert len(s.close_episode(kept)) == 1


def _serve_rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_a_30_mb_body_is_refused_at_once_without_being_read(fake):
    """A Content-Length over max_body_bytes is a 413 before anything is read; a chunked body is read
    to the limit only. Memory stays flat (the body is never held) and the answer is immediate."""
    key, url = fake.open_episode(seed_base=0)
    size = 30 * 2**20

    def body():  # streamed: the client does not hold 30 MB either
        for _ in range(size // 2**16):
            yield b" " * 2**16

    rss = _serve_rss_mb()
    for headers in ({"content-length": str(size)}, {}):  # declared, then chunked
        start = time.monotonic()
        r = httpx.post(f"{url}/chat/completions", content=body(), headers=headers)
        took = time.monotonic() - start
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["connection"] == "close"
        print(f"30 MB body ({'chunked' if not headers else 'content-length'}): 413 in {took * 1000:.1f} ms")
        assert took < 1.0
    growth = _serve_rss_mb() - rss
    print(f"RSS growth over both: {growth:.1f} MB")
    assert growth < 50
    assert fake.close_episode(key) == []


def test_idle_half_sent_and_excess_connections_are_bounded(fake, tokenizer):
    """300 connections left silent and 20 that stop inside their headers do not keep others from
    being served; the server closes the silent ones after keep_alive_s and the others after
    read_timeout_s. A body that stops coming is a 408 after read_timeout_s; headers over the cap
    a 400; requests past max_connections a 503 at once."""
    (key, url), (slow_key, _) = fake.open_episode(seed_base=0), fake.open_episode(seed_base=1)
    address = (fake.host, fake.port)
    start = time.monotonic()
    silent = [socket.create_connection(address) for _ in range(300)]
    partial = [socket.create_connection(address) for _ in range(20)]
    for sock in partial:
        sock.sendall(b"POST /episodes/x/v1/completions HTTP/1.1\r\nHost: a\r\n")
    slow = socket.create_connection(address)
    slow.sendall(f"POST /episodes/{slow_key}/v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{{"
                 .encode())
    served = time.monotonic()
    assert httpx.post(f"{url}/completions", json={"prompt": [1]}).status_code == 200  # meanwhile, at once
    assert time.monotonic() - served < 0.5
    closed = _closed_after(silent + partial + [slow], start, timeout_s=5)
    assert all(0.4 < t < 1.5 for t, _ in closed[:300]), closed[:300]  # keep_alive_s=0.5
    assert all(0.9 < t < 2.5 and data == b"" for t, data in closed[300:320])  # read_timeout_s=1.0
    t, data = closed[320]
    assert 0.9 < t < 2.5 and data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data
    print(f"idle connections closed after {max(t for t, _ in closed[:300]):.2f} s, half-sent headers after "
          f"{max(t for t, _ in closed[300:320]):.2f} s")

    with socket.create_connection(address) as sock:  # headers still incomplete past MAX_HEADER_BYTES
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1))
        assert sock.recv(100).startswith(b"HTTP/1.1 400 ")
    assert len(fake.close_episode(key)) == 1 and fake.close_episode(slow_key) == []

    with AgentServer(tokenizer, fake.generate, max_connections=4) as s:
        key, url = s.open_episode(seed_base=0)
        held = [socket.create_connection((s.host, s.port)) for _ in range(4)]
        start = time.monotonic()
        r = httpx.post(f"{url}/completions", json={"prompt": [1]})
        assert r.status_code == 503 and time.monotonic() - start < 1.0
        for sock in held:
            sock.close()


def _closed_after(socks: list[socket.socket], start: float, timeout_s: float) -> list[tuple[float, bytes]]:
    """(seconds after `start` each socket's server closed it, what it sent first), in order."""
    out: dict[socket.socket, tuple[float, bytes]] = {}
    data: dict[socket.socket, bytes] = {sock: b"" for sock in socks}
    end = time.monotonic() + timeout_s
    while len(out) < len(socks) and time.monotonic() < end:
        ready, _, _ = select.select([s for s in socks if s not in out], [], [], 0.05)
        for sock in ready:
            chunk = sock.recv(65536)
            data[sock] += chunk
            if not chunk:
                out[sock] = (time.monotonic() - start, data[sock])
                sock.close()
    assert len(out) == len(socks), f"{len(socks) - len(out)} connections still open after {timeout_s} s"
    return [out[sock] for sock in socks]


def test_a_thinking_template_s_conversation_continues_token_exactly(caplog):
    """An agent on a Qwen3-style template (earlier reasoning dropped once a new user turn
    follows) sends the conversation back, the model's `<think>` reply included. The next prompt
    is the previous prompt + the sampled ids + the new turn's own tokens (the server does not
    render the history again, which would drop the reasoning the model actually saw), so the
    episode is one trajectory. Before, such a template left the server unable to extend any call:
    every multi-call episode was flagged as rewritten and never trained."""
    from tests.arch_zoo import thinking_tokenizer

    tok = thinking_tokenizer()
    turn = tok("<think>\nr r\n</think>\n\n46", add_special_tokens=False).input_ids + [tok.eos_token_id]

    def policy(request: GenerationRequest) -> Sample:
        return Sample(request.prompt_ids, turn, [-0.5] * len(turn), "stop", 0, "", tok.decode(turn[:-1]), 0, 0)

    with AgentServer(tok, policy, max_new_tokens=32, max_model_len=256, observation_role="user") as server:
        key, url = server.open_episode(seed_base=1)
        c = client(url)
        messages: list = [{"role": "user", "content": "12+34"}]
        for _ in range(2):
            r = c.chat.completions.create(model="policy", messages=messages, max_tokens=32)
            messages += [r.choices[0].message, {"role": "user", "content": "ok"}]
        calls = server.close_episode(key)
    sample = episode_sample(calls, prompt_text="12+34", group_id=0, sample_index=0, decode=tok.decode)
    (observation,) = assert_chained(calls, sample)
    think = tok.convert_tokens_to_ids("<think>")
    assert calls[1].prompt_ids == calls[0].prompt_ids + turn + observation and calls[1].prompt_ids.count(think) == 1
    assert tok.decode(observation) == tok.decode(tok("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n",
                                                     add_special_tokens=False).input_ids)
    assert "rendered afresh" not in caplog.text


def test_an_ended_episode_refuses_later_calls_and_records_nothing(fake):
    """Issue 47: the pool ends an episode on the server as its agent returns (end_episode), before the
    driver closes it: a late call (a thread the agent left) gets a 404 and changes nothing."""
    key, url = fake.open_episode(seed_base=0)
    assert httpx.post(f"{url}/completions", json={"prompt": [1, 2]}).status_code == 200
    fake.end_episode(key)
    late = [httpx.post(f"{url}/completions", json={"prompt": [1, 2, 3]}).status_code for _ in range(3)]
    assert late == [404] * 3
    [call] = fake.close_episode(key)
    assert call.prompt_ids == [1, 2]


class GatedPolicy(FakePolicy):
    """A FakePolicy whose calls with the prompt [9] wait for `release` (a slow generate): the call
    an agent leaves in flight when it returns."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, request: GenerationRequest) -> Sample:
        if request.prompt_ids == [9]:
            self.started.set()
            assert self.release.wait(20)
        return super().__call__(request)


def _leave_a_call_in_flight(url: str) -> tuple[threading.Thread, list]:
    """What an agent that returns too early leaves: a call through the openai client, in a thread,
    whose generate has begun; the list gets its answer or its error."""
    got: list = []

    def call() -> None:
        try:
            got.append(client(url).completions.create(model="policy", prompt=[9], max_tokens=2))
        except openai.APIStatusError as err:
            got.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    return thread, got


def test_a_call_in_flight_when_the_episode_ends_is_not_recorded(tokenizer):
    """Issue 58: an episode closes when its agent returns. A call still running on the fleet then
    (a slow generate) is answered with the closed episode's 404 and is not in close_episode's
    record; the calls completed before it are."""
    policy = GatedPolicy(tokenizer)
    with AgentServer(tokenizer, policy, max_new_tokens=MAX_NEW, max_model_len=1024) as s:
        key, url = s.open_episode(seed_base=0)
        done = [client(url).completions.create(model="policy", prompt=p, max_tokens=2) for p in ([1, 2], [3])]
        thread, got = _leave_a_call_in_flight(url)
        assert policy.started.wait(10)
        s.end_episode(key)  # the agent returned
        policy.release.set()
        thread.join(timeout=20)
        [err] = got
        assert isinstance(err, openai.NotFoundError) and err.body["code"] == "episode_not_found"
        calls = s.close_episode(key)
    assert [c.prompt_ids for c in calls] == [[1, 2], [3]]
    assert [c.completion_text for c in calls] == [r.choices[0].text for r in done]


def test_calls_finishing_after_the_agent_returned_are_dropped_when_its_end_comes_late(tokenizer):
    """Issue 58, as a user found it: the pool learns that an agent returned a while after it did
    (0.42 s in the field), and a call the agent left in flight finished in between and was recorded.
    end_episode(key, at=) takes when the agent returned, `time.monotonic()` in the agent's own
    process (one clock for the host: a subprocess here): the calls recorded from then on are
    dropped, those before are kept, and later calls get the 404."""
    policy = GatedPolicy(tokenizer)
    with AgentServer(tokenizer, policy, max_new_tokens=MAX_NEW, max_model_len=1024) as s:
        key, url = s.open_episode(seed_base=0)
        agent = client(url)
        first = agent.completions.create(model="policy", prompt=[1, 2], max_tokens=2)
        thread, got = _leave_a_call_in_flight(url)
        assert policy.started.wait(10)
        before = time.monotonic()
        returned_at = float(subprocess.run([sys.executable, "-c", "import time; print(time.monotonic())"],
                                           capture_output=True, text=True, check=True, timeout=60).stdout)
        assert before <= returned_at <= time.monotonic()  # the agent's process reads the server's clock
        policy.release.set()  # the call left in flight finishes before the pool reports the return
        thread.join(timeout=20)
        assert got[0].choices[0].text == "ok" * 2  # answered: the server did not know yet
        s.end_episode(key, at=returned_at)
        with pytest.raises(openai.NotFoundError):
            agent.completions.create(model="policy", prompt=[1, 2, 3], max_tokens=2)
        [call] = s.close_episode(key)
    assert call.prompt_ids == [1, 2] and call.completion_text == first.choices[0].text
    assert len(policy.requests) == 2  # the dropped call did reach the fleet


def test_fair_share_caps_calls_and_requests_per_episode_and_logs_once(tokenizer, caplog):
    """Issue 47: past max_calls (task.agent_max_calls) a 429 naming the field, and the episode's
    refusal says so; past max_pending_per_episode requests at once a 429 at once, while another
    episode is served; each episode's refusals are logged once, not per request."""
    release = threading.Event()

    def slow(request: GenerationRequest) -> Sample:
        release.wait(10)
        return Sample(request.prompt_ids, [5], [-0.1], "stop", 0, "", "x", 0, 0)

    with AgentServer(tokenizer, slow, max_calls=2, max_pending_per_episode=2) as s:
        release.set()
        (key, url), (flooder, flood_url), (other, other_url) = (s.open_episode(seed_base=i) for i in range(3))
        codes = [httpx.post(f"{url}/completions", json={"prompt": [1] * (i + 1)}).status_code for i in range(5)]
        assert codes == [200, 200, 429, 429, 429]
        assert "task.agent_max_calls=2" in s.refusal(key) and len(s.close_episode(key)) == 2
        release.clear()
        answers: list[int] = []
        threads = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{flood_url}/completions", json={"prompt": [1]}, timeout=20).status_code)) for _ in range(10)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while answers.count(429) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(answers) == [429] * 8  # at once, the 2 admitted still waiting on generate
        release.set()
        assert httpx.post(f"{other_url}/completions", json={"prompt": [1]}).status_code == 200
        for t in threads:
            t.join(timeout=20)
        assert sorted(answers) == [200] * 2 + [429] * 8 and "requests in flight" in s.refusal(flooder)
    refusals = [r for r in caplog.records if "further refusals are not logged" in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in refusals]


def first_bytes(sock: socket.socket) -> bytes:
    """The first 12 bytes the server sent on `sock`, b"" if it closed the connection instead. A
    connection evicted as the oldest idle while its request still sat unread in the server's
    socket buffer is closed with a reset (the kernel's answer to unread data), not a FIN: under
    load that is what "closed meanwhile" looks like to the client."""
    try:
        return sock.recv(12)
    except ConnectionResetError:
        return b""


_CYCLING_FLOOD = """
import socket, sys
sys.path.insert(0, sys.argv[3])
from reward.agents.relay import hand_over, tcp_listener
listener = tcp_listener("127.0.0.1", 0)
kept = hand_over(sys.argv[1], listener)  # as an episode's worker does: the server accepts there
port, n = listener.getsockname()[1], int(sys.argv[2])
listener.close()
def burst():
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
held = burst()
print("first", flush=True); sys.stdin.readline()
for s in held:
    s.close()
sys.stdin.readline()
held = burst()
print("second", flush=True); sys.stdin.readline()
"""


def test_a_cycling_flood_from_one_episode_never_evicts_anothers_new_connection(tokenizer):
    """Issue 58: a flood that closes its connections and opens new ones made a well-behaved
    client's new connection, its request still on the way, the oldest idle one, closed under it
    (CI: `RemoteProtocolError: Server disconnected` for an honest call). Eviction now takes the
    oldest idle connection of the source holding the most: the flood's own (a source: the episode
    whose listener a connection came on, handed over by its worker; else the client's host)."""
    def generate(request: GenerationRequest) -> Sample:
        return Sample(request.prompt_ids, [5], [-0.1], "stop", 0, "", "x", 0, 0)

    with AgentServer(tokenizer, generate, max_unclaimed_connections=8, keep_alive_s=30.0) as s:
        key, url = s.open_episode(seed_base=0)
        flood = subprocess.Popen([sys.executable, "-c", _CYCLING_FLOOD, s.handoff_path, "8", ROOT],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout.readline().strip() == "first"
            good = socket.create_connection((s.host, s.port), timeout=10)  # opened, its request not sent yet
            time.sleep(0.3)
            flood.stdin.write("\n"); flood.stdin.flush()  # the flood closes its 8 ...
            time.sleep(0.5)
            flood.stdin.write("\n"); flood.stdin.flush()  # ... and opens 8 new ones
            assert flood.stdout.readline().strip() == "second"
            time.sleep(0.3)
            assert s.listening() == 1
            path = url.split(str(s.port), 1)[1]
            body = b'{"prompt": [1, 2]}'
            good.sendall(f"POST {path}/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            assert first_bytes(good) == b"HTTP/1.1 200"
            good.close()
        finally:
            flood.kill()
            flood.wait()
        deadline = time.monotonic() + 5
        while s.listening() and time.monotonic() < deadline:  # its worker gone: the listener is closed
            time.sleep(0.05)
        assert s.listening() == 0
        assert len(s.close_episode(key)) == 1


def test_a_connection_flood_costs_only_the_flooder_and_is_logged_once(tokenizer, caplog):
    """Issue 47: 600 connections that name no live episode, on a server of 200 slots, leave another
    episode's calls answered (before: a 503, as 4 agents opening 1,000 each made of 5 good episodes
    in 8): such connections are kept apart, the oldest idle closed past `max_unclaimed_connections`.
    An episode already holding `max_connections_per_episode` gets a 429 on one more, named in its
    refusal; the flood's evictions are logged once, not per connection."""
    def generate(request: GenerationRequest) -> Sample:
        return Sample(request.prompt_ids, [5], [-0.1], "stop", 0, "", "x", 0, 0)

    with AgentServer(tokenizer, generate, max_connections=200, max_unclaimed_connections=32,
                     max_connections_per_episode=2, keep_alive_s=30.0) as s:
        (good, good_url), (flooder, flood_url) = s.open_episode(seed_base=0), s.open_episode(seed_base=1)
        idle = [socket.create_connection((s.host, s.port), timeout=5) for _ in range(300)]
        wrong = [socket.create_connection((s.host, s.port), timeout=5) for _ in range(300)]
        ask = (b"POST /episodes/nope/v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: 14\r\n\r\n{\"prompt\": [1]}")
        try:
            for sock in wrong:  # keep-alive connections that only asked a wrong key
                sock.sendall(ask)
            answers = {first_bytes(sock) for sock in wrong}
            assert answers <= {b"HTTP/1.1 404", b""}, answers  # b"": closed meanwhile, as the oldest idle
            assert httpx.post(f"{good_url}/completions", json={"prompt": [1, 2]}, timeout=10).status_code == 200
            clients = [httpx.Client(timeout=10) for _ in range(3)]  # one connection each, kept alive
            codes = [c.post(f"{flood_url}/completions", json={"prompt": [1]}).status_code for c in clients]
            assert codes == [200, 200, 429], codes
            assert "connections open at once" in s.refusal(flooder) and s.refusal(good) is None
            assert httpx.post(f"{good_url}/completions", json={"prompt": [1, 2, 3]}, timeout=10).status_code == 200
            for c in clients:
                c.close()
        finally:
            for sock in idle + wrong:
                sock.close()
        assert len(s.close_episode(good)) == 2 and len(s.close_episode(flooder)) == 2
    evictions = [r for r in caplog.records if "oldest idle ones of the source holding the most" in r.getMessage()]
    assert len(evictions) == 1, [r.getMessage() for r in evictions]
