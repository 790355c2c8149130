"""verifiers' multi-turn tasks (reward/agents/verifiers.py, issue 59.6): the `verifiers_multiturn`
taskset (examples/verifiers_multiturn, sums a user asks for one at a time) played with verifiers'
own user simulator (`env_id: user-sim`), the user's model a scripted endpoint of its own, the
policy a scripted one behind the real agent server and pool. Each episode is one token-exact
trajectory across the conversation (every call's prompt extends the previous prompt and
completion; the user's turns are observation tokens), its reward is the taskset's `@vf.reward` on
the assistant's replies, the sample's prompt text is the model's first rendered prompt, and an
exchange that a limit (the user's or the assistant's `max_turns`) ends before it is done is
truncated with its reward kept. A NaN reward names its `@vf.reward` function; an untrained role
without a model of its own is refused before any episode.

Full lane: making the verifiers environment downloads verifiers and its dependencies (~2 min)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from examples.calculator import calculator_tokenizer
from reward.agents.pool import AgentLimits, AgentPool
from reward.agents.runner import AgentRunner
from reward.agents.server import AgentServer
from reward.loader import RewardLoadError
from rl.data.types import GenerationRequest, Sample
from tests.conftest import endpoints

pytestmark = [pytest.mark.slow, pytest.mark.full]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = "reward.agents.verifiers:episode"
DONE = "###DONE###"  # user-sim's default done marker


@pytest.fixture(scope="module")
def verifiers_python() -> str:
    subprocess.run(["bash", "launch/agent_env.sh", "verifiers", "examples/verifiers_sum",
                    "examples/verifiers_multiturn"], cwd=ROOT, check=True, timeout=900)
    return os.path.join(ROOT, ".venv-verifiers", "bin", "python")


def _reply(tok, request: GenerationRequest, text: str) -> Sample:
    ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    return Sample(request.prompt_ids, ids, [-0.1] * len(ids), "stop", 0, "", text, 0, 0)


def _assistant(tok, wrong_after: int | None = None):
    """The policy: answers the last sum in its prompt (from its `wrong_after`th answer on, 0)."""
    def generate(request: GenerationRequest) -> Sample:
        prompt = tok.decode(request.prompt_ids, skip_special_tokens=False).replace(" ", "")
        a, b = map(int, re.findall(r"(\d)\+(\d)", prompt)[-1])
        answered = prompt.count("<|assistant|>") - 1
        return _reply(tok, request, "0" if wrong_after is not None and answered >= wrong_after else str(a + b))
    return generate


class UserModel:
    """The user simulator's model, scripted: an OpenAI-compatible chat endpoint of its own (as a
    user model would be, apart from the policy's) that asks its scenario's sums (in its system
    prompt) one per turn, then says the done marker. `url` is its base URL."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                messages = body["messages"]
                sums = re.findall(r"\d\+\d", messages[0]["content"]) if messages[0]["role"] == "system" else []
                asked = sum(m["role"] == "assistant" for m in messages)  # its own earlier turns
                text = sums[asked] if asked < len(sums) else DONE
                out = json.dumps({"id": f"user-{asked}", "object": "chat.completion", "created": 0,
                                  "model": body.get("model", "user"),
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "UserModel":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _NoRepairs:
    def repair(self) -> None:
        pass


def _play(verifiers_python, policy, rows: list[dict], kwargs: dict, *, user_args: dict | None = None,
          max_len: int = 256) -> list[Sample]:
    """Each row an episode through the real pool, agent server and runner; the user's model its own
    endpoint (`UserModel`)."""
    tok = calculator_tokenizer()
    with AgentServer(tok, policy, max_new_tokens=8, max_model_len=max_len) as server, UserModel() as users:
        env_args = {**kwargs.get("env_args", {}),
                    "user": {"model": "user", "client": {"base_url": users.url}, **(user_args or {})}}
        pool = AgentPool(AGENT, ROOT, 2, AgentLimits(90.0), {**kwargs, "env_args": env_args},
                         python=verifiers_python, endpoints=endpoints(server.url, users.url))
        runner = AgentRunner(server, pool, _NoRepairs(), name=AGENT, prompt_key="prompt", timeout_s=90.0, workers=2,
                             max_len=max_len, decode=tok.decode)
        try:
            return runner.run([GenerationRequest(prompt_ids=tok("task").input_ids, prompt_text=f"row {i}", group_id=i,
                                                 sample_index=0, seed=i, metadata=row) for i, row in enumerate(rows)])
        finally:
            runner.close()


def _answers(python: str, indices: list[int], sums: int) -> list[list[str]]:
    """The taskset's own answers for the tasks `indices`, read in the verifiers environment."""
    code = ("import json, itertools, reward.agents.verifiers as va\n"
            f"env = va.load('verifiers_multiturn', {{'sums': {sums}}})\n"
            f"tasks = list(itertools.islice(env.taskset, {max(indices) + 1}))\n"
            f"print(json.dumps([tasks[i].data.answers for i in {indices}]))\n")
    out = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


USER_SIM = {"environment": "verifiers_multiturn", "env_id": "user-sim"}


def test_a_user_simulator_conversation_trains_as_one_token_exact_episode(verifiers_python):
    """user-sim: the user asks 3 sums one at a time, the policy answers each; the episode is 3 model
    turns with the user's sums between them as observation tokens, one trajectory (no segment), the
    reward the taskset's share of right answers (1, and 2/3 when the third is wrong), the sample's
    prompt text the rendered first prompt (the system prompt and the user's first sum)."""
    tok = calculator_tokenizer()
    rows = [{"task_index": i} for i in (0, 5)]
    answers = _answers(verifiers_python, [0, 5], 3)
    kwargs = {**USER_SIM, "taskset_args": {"sums": 3}}
    for wrong_after, reward in ((None, 1.0), (2, 2 / 3)):
        samples = _play(verifiers_python, _assistant(tok, wrong_after), rows, kwargs)
        for s, want in zip(samples, answers):
            assert s.error is None and s.segments is None and not s.truncated, s.error
            model = [t for t in s.turns if t.role == "model"]
            observations = [t for t in s.turns if t.role == "observation"]
            assert [t.role for t in s.turns] == ["model", "observation"] * 2 + ["model"]
            replies = want[:2] + (["0"] if wrong_after == 2 else want[2:])
            assert [t.text for t in model] == replies
            for t, reply in zip(model, replies):  # the sampled ids, trained (mask 1)
                sampled = tok(reply, add_special_tokens=False).input_ids + [tok.eos_token_id]
                assert s.completion_ids[t.start:t.end] == sampled
                assert set(s.completion_mask[t.start:t.end]) == {1}
            for t in observations:  # the user's next sum, as the template's user turn (mask 0)
                assert set(s.completion_mask[t.start:t.end]) == {0}
                assert re.search(r"<\|user\|>\d\+\d<\|end\|><\|assistant\|>$",
                                 tok.decode(s.completion_ids[t.start:t.end], skip_special_tokens=False))
            assert abs(s.turns[-1].reward - reward) < 1e-9, (s.turns[-1].reward, reward)
            assert s.prompt_text == tok.decode(s.prompt_ids) and s.prompt_text.startswith("<bos><|system|>")
            assert s.prompt_text.endswith("<|end|><|assistant|>") and re.search(r"\d\+\d<\|end\|>", s.prompt_text)


def test_a_limit_that_ends_the_exchange_before_it_is_done_is_truncated_with_its_reward(verifiers_python):
    """The user's own max_turns (2, of 3 sums) ends the conversation before the done marker; the
    assistant's max_turns (1) refuses its second call (never sent to the agent server); the context
    fills at its third: each ends truncated, not an error, keeping the taskset's reward for what
    was answered."""
    tok = calculator_tokenizer()
    kwargs = {**USER_SIM, "taskset_args": {"sums": 3}}
    [user_cut] = _play(verifiers_python, _assistant(tok), [{"task_index": 1}], kwargs, user_args={"max_turns": 2})
    [assistant_cut] = _play(verifiers_python, _assistant(tok), [{"task_index": 1}],
                            {**kwargs, "env_args": {"assistant": {"max_turns": 1}}})
    # the context (24 tokens) full at the assistant's third call: the server refuses it, the harness
    # ends the segment there as the null harness does, and the episode keeps verifiers' reward
    [context_cut] = _play(verifiers_python, _assistant(tok), [{"task_index": 1}], kwargs, max_len=24)
    for s, turns in ((user_cut, 2), (assistant_cut, 1), (context_cut, 2)):
        assert s.error is None and s.truncated, s.error
        assert sum(t.role == "model" for t in s.turns) == turns
        assert abs(s.turns[-1].reward - turns / 3) < 1e-9
    [done] = _play(verifiers_python, _assistant(tok), [{"task_index": 1}], {**USER_SIM, "taskset_args": {"sums": 2}},
                   user_args={"max_turns": 3})  # done within its limit: not truncated
    assert done.error is None and not done.truncated and done.turns[-1].reward == 1.0


def _tool_policy(tok):
    """The policy for the tool taskset: calls the calculator on its prompt's expression, then answers
    with the tool's result."""
    from rl.data.tools import ToolCall, format_tool_call

    def generate(request: GenerationRequest) -> Sample:
        prompt = tok.decode(request.prompt_ids, skip_special_tokens=False).replace(" ", "")
        result = re.findall(r"<\|tool\|>(-?\d+)<\|end\|>", prompt)
        if result:
            return _reply(tok, request, result[-1])
        expression = re.findall(r"\d\*\d\+\d", prompt)[-1]
        return _reply(tok, request, format_tool_call(ToolCall("calculator", {"expression": expression})))
    return generate


def test_a_task_with_an_mcp_tool_plays_its_tool_calls_token_exact(verifiers_python):
    """verifiers_calculator: the task's calculator toolset is served over MCP per rollout; the
    harness lists it, runs the model's call on it and sends the result back: two model turns with
    the tool's result between them as observation tokens, one trajectory, reward 1 for the answer."""
    tok = calculator_tokenizer()
    code = ("import json, itertools, reward.agents.verifiers as va\n"
            "tasks = list(itertools.islice(va.load('verifiers_calculator').taskset, 4))\n"
            "print(json.dumps([[t.data.prompt, t.data.answer] for t in tasks]))\n")
    out = subprocess.run([verifiers_python, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    tasks = json.loads(out.stdout.strip().splitlines()[-1])
    with AgentServer(tok, _tool_policy(tok), max_new_tokens=40, max_model_len=256) as server:
        pool = AgentPool(AGENT, ROOT, 2, AgentLimits(120.0), {"environment": "verifiers_calculator"},
                         python=verifiers_python, endpoints=endpoints(server.url))
        runner = AgentRunner(server, pool, _NoRepairs(), name=AGENT, prompt_key="prompt", timeout_s=120.0, workers=2,
                             max_len=256, decode=tok.decode)
        try:
            samples = runner.run([GenerationRequest(prompt_ids=tok("x").input_ids, prompt_text="x", group_id=i,
                                                    sample_index=0, seed=i, metadata={"task_index": i})
                                  for i in (0, 3)])
        finally:
            runner.close()
    for s, (expression, answer) in zip(samples, (tasks[0], tasks[3])):
        assert s.error is None and s.segments is None and not s.truncated, s.error
        assert [t.role for t in s.turns] == ["model", "observation", "model"]
        call, result, reply = s.turns
        assert f'"expression":"{expression}"' in call.text.replace(" ", "") and reply.text == answer
        assert tok.decode(s.completion_ids[result.start:result.end], skip_special_tokens=False).replace(" ", "") == \
            f"<|tool|>{answer}<|end|><|assistant|>"
        assert s.turns[-1].reward == 1.0


NAN = '''
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str


class NanTask(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def broken_judge(self, trace: vf.Trace) -> float:
        return float("nan")


class HugeTask(NanTask):
    @vf.reward(weight=0.5)
    async def broken_judge(self, trace: vf.Trace) -> float:
        return 1e30


class NanConfig(vf.TasksetConfig):
    huge: bool = False


class NanTaskset(vf.Taskset[NanTask, NanConfig]):
    def load(self):
        for a in range(1, 10):
            cls = HugeTask if self.config.huge else NanTask
            yield cls(Data(prompt=f"x\\n{a}+1", answer=str(a + 1)), self.config.task)


__all__ = ["NanTaskset"]
'''


def test_a_nan_or_huge_reward_names_its_reward_function(verifiers_python, tmp_path):
    """A `@vf.reward` scoring NaN is an error sample naming that function; one whose score puts the
    reward beyond task.agent_reward_bound is refused naming the functions' parts."""
    (tmp_path / "nan_sum.py").write_text(NAN)
    (tmp_path / "by_row.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from reward.agents.verifiers import episode\n\n"
        "async def play(base_url, row, **kw):\n"
        "    return await episode(base_url, row, environment='nan_sum', taskset_args={'huge': row['huge']})\n")
    tok = calculator_tokenizer()
    with AgentServer(tok, _assistant(tok), max_new_tokens=8, max_model_len=256) as server:
        pool = AgentPool(f"{tmp_path}/by_row.py:play", ROOT, 2, AgentLimits(60.0), {}, python=verifiers_python,
                         endpoints=endpoints(server.url))
        runner = AgentRunner(server, pool, _NoRepairs(), name="by_row.py:play", prompt_key="prompt", timeout_s=60.0,
                             workers=2, max_len=256, decode=tok.decode)
        try:
            nan, huge = runner.run([GenerationRequest(prompt_ids=tok("x").input_ids, prompt_text="x", group_id=i,
                                                      sample_index=0, seed=i, metadata={"task_index": 2, "huge": h})
                                    for i, h in enumerate((False, True))])
        finally:
            runner.close()
    assert "verifiers reward function 'broken_judge' of task 2 scored nan" in nan.error, nan.error
    assert "task.agent_reward_bound" in huge.error and "broken_judge=5e+29" in huge.error, huge.error
    assert "exact=1.0" in huge.error


def test_an_untrained_user_without_a_model_of_its_own_is_refused_before_any_episode(verifiers_python):
    """user-sim's user is not trained: its calls through the policy's endpoint would be trained as the
    policy's, so a user without its own client is refused, naming the field."""
    with pytest.raises(RewardLoadError) as err:
        AgentPool(AGENT, ROOT, 1, AgentLimits(30.0), USER_SIM, python=verifiers_python).close()
    assert "env_args.user.client.base_url" in str(err.value) and "task.agent" in str(err.value), str(err.value)
    with pytest.raises(RewardLoadError) as err:
        AgentPool(AGENT, ROOT, 1, AgentLimits(30.0), {**USER_SIM, "env_id": "no-such-env"},
                  python=verifiers_python).close()
    assert "no-such-env" in str(err.value) and "not found" in str(err.value), str(err.value)


def test_two_training_steps_on_user_simulator_conversations(verifiers_python, tiny_calc, tmp_path):
    """task=verifiers_sum's settings on verifiers_multiturn with user-sim for 2 steps on the tiny chat
    model, the user's model a scripted endpoint the episodes reach (task.agent_endpoints): learner
    and engine agree on every model token at step 0 across the conversation (two_agent_steps), no
    episode fails, each logged episode is 2 model turns with the user's second sum between them, its
    reward the taskset's share of right replies, its prompt text the rendered first prompt."""
    import random

    from examples.verifiers_multiturn import write_data
    from tests.conftest import two_agent_steps

    out, _ = tiny_calc
    tok = calculator_tokenizer()
    with UserModel() as users:
        rows = two_agent_steps(
            ["task=verifiers_sum", f"model.path={out}/model", f"task.agent_python={verifiers_python}",
             "task.agent_kwargs.environment=verifiers_multiturn", "+task.agent_kwargs.env_id=user-sim",
             f'+task.agent_kwargs.env_args={{user: {{model: user, client: {{base_url: "{users.url}"}}}}}}',
             f"task.agent_endpoints=[{users.url}]"], write_data, tmp_path)
    for r in rows:  # the taskset's sums for the row's task, drawn as verifiers_multiturn draws them (seed 0)
        rng = random.Random(r["data"]["task_index"])
        answers = [str(rng.randint(1, 9) + rng.randint(1, 9)) for _ in range(2)]
        assert r["error"] is None and not r["truncated"] and "segments" not in r, r
        assert [t["role"] for t in r["turns"]] == ["model", "observation", "model"], r["turns"]
        replies = [t["text"].strip() for t in r["turns"] if t["role"] == "model"]
        assert r["reward"] == sum(a == b for a, b in zip(replies, answers)) / 2, (r["reward"], replies, answers)
        assert r["prompt_text"].startswith("<bos><|system|>") and r["prompt_text"].endswith("<|assistant|>")
