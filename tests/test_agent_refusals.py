"""Issue 59: every refusal of the agent server reaches the agent's client as a readable answer and
the episode's error with its reason and limit.

A body over the limit (413), a call past `task.agent_max_calls` (429) and a field the server does
not serve (400: `response_format`, the Agents SDK's `output_type`) are sent through the real sync
and async `openai` clients, straight to the server and through an episode's byte relay (the pool
relays every connection of a sandboxed agent: reward/agents/relay.py). Each must raise openai's
APIStatusError with the status and the message naming the limit, never `APIConnectionError:
Connection error.` (before: the server closed its connection over the unread body, the kernel
reset it, and the relay, its write to the server failing, dropped the answer too). Then real agent
files in the real pool, run by `AgentRunner`: the refusal is named in the sample's error even when
the agent turned it into another exception, and logged.
"""

from __future__ import annotations

import asyncio
import logging
import textwrap
import time

import openai
import pytest

from examples.calculator import calculator_tokenizer
from rl.data.types import GenerationRequest, Sample
from reward.agents.relay import Relay, tcp_connector, tcp_listener
from reward.agents.server import AgentServer

BIG = "x" * (2 << 20)  # a 2 MiB observation: over the default 1 MiB limit
TRIES = 4  # each refusal this many times per client and path: the reset it got before was a race


def _generate(tok):
    token = tok("5", add_special_tokens=False).input_ids[0]

    def generate(request: GenerationRequest) -> Sample:
        return Sample(request.prompt_ids, [token], [-0.5], "stop", 0, "", "5", 0, 0)
    return generate


@pytest.fixture(scope="module")
def tok():
    return calculator_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    with AgentServer(tok, _generate(tok), max_new_tokens=4, max_model_len=256, max_calls=1) as s:
        yield s


@pytest.fixture(scope="module")
def relay(server):
    """An episode's relay, as its worker and the pool run it: a listener relayed to the server."""
    listener = tcp_listener("127.0.0.1", 0)
    r = Relay([(listener, tcp_connector(server.host, server.port))]).start("test-relay")
    yield listener.getsockname()[1]
    r.close()


_MESSAGE = [{"role": "user", "content": "2+3"}]
# (status, what its message must say, the call's arguments): 413, 400, then 429 (the episode has
# made its one call first)
REFUSALS: list[tuple[int, str, dict]] = [
    (413, "is over this server's limit of 1 MiB (1048576 bytes: max(1 MiB, 64 bytes x rollout.max_model_len))",
     {"messages": [{"role": "user", "content": BIG}]}),
    (400, "response_format: structured output is not served", {"messages": _MESSAGE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}}),
    (429, "made over task.agent_max_calls=1 calls", {"messages": _MESSAGE})]


def _status(err: openai.APIError) -> int | str:
    """The status openai's client read, or its error's name when it read none (a connection error)."""
    return err.status_code if isinstance(err, openai.APIStatusError) else f"{type(err).__name__}: {err.__cause__!r}"


@pytest.mark.parametrize("through", ["direct", "relay"])
def test_every_refusal_is_an_api_status_error_for_the_sync_and_async_clients(server, relay, through):
    """413 (a 2 MiB body), 400 (response_format), 429 (task.agent_max_calls), each TRIES times by
    each client, straight and through a relay: APIStatusError with the status and the message
    naming the limit every time (before: through the relay, APIConnectionError, by chance)."""
    key, url = server.open_episode(seed_base=0)
    if through == "relay":
        url = url.replace(f":{server.port}/", f":{relay}/")
    sync = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    assert sync.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}]).choices
    got: list[tuple[str, int, str]] = []

    async def async_calls() -> None:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        for status, _, args in REFUSALS:
            for _ in range(TRIES):
                try:
                    await client.chat.completions.create(model="policy", **args)
                except openai.APIError as err:
                    got.append(("async", _status(err), str(err)))
        await client.close()

    for status, _, args in REFUSALS:
        for _ in range(TRIES):
            start = time.monotonic()
            try:
                sync.chat.completions.create(model="policy", **args)
            except openai.APIError as err:
                got.append(("sync", _status(err), str(err)))
            assert time.monotonic() - start < 10
    asyncio.run(async_calls())
    expected = [(who, status, says) for who in ("sync", "async") for status, says, _ in REFUSALS
                for _ in range(TRIES)]
    assert [(who, status) for who, status, _ in got] == [(who, status) for who, status, _ in expected], got
    for (_, _, text), (_, _, says) in zip(got, expected):
        assert says in text, text
    assert "refused call 2: 429" in server.refusal(key)  # the last one, naming the call
    assert len(server.close_episode(key)) == 1


AGENTS = '''
import asyncio

import openai

BIG = "x" * (2 << 20)


def big(base_url, row):
    """A tool result over the limit, through the async client as reward/agents/openenv.py sends it."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": BIG}]
    asyncio.run(client.chat.completions.create(model="policy", messages=messages))
    return 1.0


def hides(base_url, row):
    """Turns the 413 into an error of its own (or a client that saw only a connection error)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": BIG}])
    except openai.APIError:
        raise ConnectionError("the model is unreachable") from None
    return 1.0


def sdk(base_url, row):
    """An Agents SDK agent with structured output (output_type)."""
    from agents import Agent, Runner, set_default_openai_api, set_default_openai_client, set_tracing_disabled
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    set_default_openai_client(openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0),
                              use_for_tracing=False)
    set_default_openai_api("chat_completions")
    set_tracing_disabled(True)
    result = Runner.run_sync(Agent(name="calc", model="policy", output_type=Answer), row["prompt"])
    return float(result.final_output.value == int(row["answer"]))


def solve(base_url, row):
    return {"big": big, "hides": hides, "sdk": sdk}[row["kind"]](base_url, row)
'''


class _NoRepairs:
    def repair(self) -> None:
        pass


@pytest.mark.slow  # the real agent pool (a zygote importing openai and the Agents SDK)
def test_a_refusal_reaches_the_episode_s_error_and_the_log(tok, tmp_path, caplog):
    pytest.importorskip("agents")
    from reward.agents.pool import AgentLimits, AgentPool
    from reward.agents.runner import AgentRunner

    (tmp_path / "refused_agents.py").write_text(textwrap.dedent(AGENTS))
    expected = {"big": ["APIStatusError: Error code: 413", "(the agent server refused call 1)"],
                "hides": ["ConnectionError", "before that, the agent server refused call 1: 413 the request body"],
                "sdk": ["BadRequestError", "400 - response_format: structured output is not served",
                        "Agent.output_type", "(the agent server refused call 1)"]}
    with AgentServer(tok, _generate(tok), max_new_tokens=4, max_model_len=256) as server:
        pool = AgentPool("refused_agents.py:solve", str(tmp_path), 3, AgentLimits(timeout_s=60),
                         endpoints=[(server.host, server.port, server.handoff_path)])
        runner = AgentRunner(server, pool, _NoRepairs(), name="refused_agents.py:solve", prompt_key="prompt",
                             timeout_s=60, workers=3, max_len=256, decode=tok.decode)
        try:
            with caplog.at_level(logging.WARNING, logger="reward.agents.server"):
                samples = runner.run([GenerationRequest(prompt_ids=tok("2+3").input_ids, prompt_text="2+3", group_id=0,
                                                        sample_index=i, seed=i, metadata={"answer": "5", "kind": kind})
                                      for i, kind in enumerate(expected)])
        finally:
            runner.close()
    for (kind, says), sample in zip(expected.items(), samples):
        print(f"{kind}: {sample.error}")
        assert sample.error is not None, sample
        for text in says:
            assert text in sample.error, (text, sample.error)
        if kind != "sdk":
            assert "is over this server's limit of 1 MiB" in sample.error and "Connection error" not in sample.error
    logged = [r.getMessage() for r in caplog.records if "was refused call 1" in r.getMessage()]
    assert len(logged) == 3 and sum("413" in m for m in logged) == 2 and \
        sum("response_format" in m for m in logged) == 1, logged
