"""verifiers environments (its `v1` API: an `Env` or `SingleAgentEnv` with a taskset and reward
functions), played as agent episodes: `task.agent=reward.agents.verifiers:episode`.

verifiers pins `openai < 3` and `mcp 2.0.0`, which conflict with ours, so the episode runs in a
virtual environment of its own (`task.agent_python`, made by `launch/agent_env.sh verifiers`, with
the environment's package installed beside verifiers, as `prime env install` would). Per episode,
as prime-rl drives a verifiers environment: the environment is loaded by its id
(`vf.load_environment`; `env_id` pairs the taskset with another `Env`, e.g. verifiers' `user-sim`,
and `env_args` sets that env's fields and roles), the row's `task_index` picks the task, and
`env.run_episode` plays it with a `ModelContext` whose client is the episode's base URL, which the
agent server records token for token (verifiers' own interception server sits between the
harness and that URL). The env's `run` says how many turns there are: the single-agent env plays
the task's prompt to the model's final reply; a multi-turn env (a user simulator, a game engine)
answers each reply with the next user turn (`Interaction.turn`) until it is done or a limit
(`max_turns`, a token budget) ends the exchange.

The reward is the trained traces' (`agent.trainable`; one per episode unless the env plays several
trainable agents, then their mean): the weighted sum of the task's `@vf.reward` functions, as
verifiers computed it. An episode verifiers reports as failed (`episode.ok` false) is an error
sample with its errors' text; a reward function whose score is NaN or infinite is one naming that
function. An agent the env does not train (verifiers' user simulator) must have a model of its own
(`env_args.<role>.client`): through the episode's base URL its calls would be trained as the
policy's. The episode's note (reward/agents/runner.py `EPISODE_NOTE`, its last output line) tells
the runner what its float cannot: its sample's prompt text is the model's first rendered prompt
(the row's column only names the task), its reward's parts by function (named when the reward is
beyond task.agent_reward_bound), and whether a limit cut it (truncated: the reward is kept).

The harness: verifiers' built-in `null` harness (the chat loop: the task's prompt, the model's
reply, its tool calls run on the task's MCP tool servers until a reply without one) prepares its
chat program with `uv` from the package index when each process starts, which an offline host
cannot do. `ChatHarness` below runs the same loop in-process, as verifiers' `Harness.launch` allows
("a harness may run its loop in-process ... as long as every model call goes through endpoint").
It resumes an exchange as the `null` harness does (verifiers relaunches it on the conversation so
far plus the user's turn), so every call's messages are the previous call's, the reply as it came
back, and the new tool results or user turn: the agent server extends the previous prompt and
completion token for token. It is the default for every role of the env; `harness` names another
installed one (e.g. `null` where `uv` and the index are reachable).

Runs where only the standard-library part of ours is importable. verifiers is imported at the top,
so the agent pool's zygote imports it once and every episode's fresh fork has it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import sys
import types
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
import verifiers.v1.harnesses  # noqa: F401 - resolving a plugin id imports these packages first (mcp:
import verifiers.v1.tasksets  # noqa: F401 - ~2.5 s): once, in the zygote, not in every episode
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.compaction import is_context_overflow
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

AsyncOpenAI(api_key="-", base_url="http://127.0.0.1:9").chat.completions  # noqa: B018 - the client's lazy imports (~0.8 s), in the zygote too

HARNESS_ID = "rlpost_chat_harness"  # verifiers imports a harness by a top-level module name
API_KEY_VAR = "RLPOST_VERIFIERS_API_KEY"  # the episode's URL is its credential; verifiers wants a variable
EPISODE_NOTE = "rlpost-episode-note: "  # reward/agents/runner.py EPISODE_NOTE (not importable here)
LIMITS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens")  # verifiers' RolloutLimits


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """verifiers' `null` harness's chat loop, in-process: the task's prompt (its system prompt as a
    system message) or the conversation so far, sent to verifiers' interception endpoint; each reply
    with tool calls answered by the task's MCP tool servers and sent again, until a reply without
    one ends the segment. A limit or `@stop` that refuses a call, or a full context, ends it too."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # verifiers' default resume(): relaunch on the conversation + the user's turn
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:  # the conversation so far, as verifiers' own chat program gets it
            messages += [message_to_wire(m) for m in prompt or []]
        async with AsyncExitStack() as stack:
            servers: dict = {}
            tools: list[dict] = []
            dispatch: dict = {}
            if mcp_urls:
                spec = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                       for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await asyncio.wait_for(connect_mcp(spec, stack), 60)
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0))
            while True:
                try:
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                 **({"tools": tools} if tools else {}))
                except APIStatusError as err:
                    # refused by a limit or @stop (verifiers stopped the trace), or the context is full:
                    # the segment ends with the conversation so far, as the null harness's loop ends
                    if trace.stop_condition is not None or is_context_overflow(err):
                        return vf.ProgramResult(exit_code=0, stdout="", stderr=str(err))
                    raise
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))  # sent back as it came
                if not message.tool_calls:
                    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": await _run_tool(servers, dispatch, call)})


async def _run_tool(servers: dict, dispatch: dict, call: Any) -> str:
    """A tool call's result as the model reads it: the MCP tool's text, or an error it can act on."""
    name = call.function.name
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as err:
        return f"error: invalid JSON in tool arguments ({err}); resend the call with valid JSON"
    if not isinstance(arguments, dict):
        return f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
    if name not in dispatch:
        return f"error: unknown tool {name!r}"
    content = await call_mcp(servers, dispatch, name, arguments)
    return content if isinstance(content, str) else json.dumps(content)


__all__ = ["ChatHarness"]  # what verifiers' harness loader looks for
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


def roles(environment: str, env_id: str = "") -> list[str]:
    """The env's agent roles (its config's `AgentConfig` fields: `agent` for a plain taskset)."""
    cls = vf.env_config_type(environment, env_id)
    return [name for name, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]


def load(environment: str, taskset_args: dict | None = None, harness: str = HARNESS_ID, env_id: str = "",
         env_args: dict | None = None) -> Any:
    """The environment `environment` (an installed package's module name, as verifiers resolves
    ids) with `taskset_args` for its taskset's config, paired with the `Env` named `env_id` (else
    the taskset's own, else the single-agent env) and `env_args` for that env's config; every role
    on `harness` in a subprocess runtime (the default runtime is a hosted sandbox) unless
    `env_args` pins its own."""
    data: dict[str, Any] = {**(env_args or {}), "taskset": {"id": environment, **(taskset_args or {})}}
    if env_id:
        data["id"] = env_id
    for role in roles(environment, env_id):
        pinned = dict(data.get(role) or {})
        pinned.setdefault("harness", {"id": harness})
        pinned.setdefault("runtime", {"type": "subprocess"})
        if isinstance(pinned.get("client"), dict):  # a model of its own (an OpenAI-compatible endpoint)
            pinned["client"] = {"type": "eval", "api_key_var": API_KEY_VAR, **pinned["client"]}
        data[role] = pinned
    return vf.load_environment(vf.resolve_env_config(data))


async def _untrained_roles(env: Any) -> list[str]:
    """The roles the env does not train: its `setup` marks them (`user-sim` its user), here on
    stand-in seats."""
    seats = vf.Agents(env.config, lambda name, spec: types.SimpleNamespace(trainable=True))
    await env.setup(seats)
    return [name for name in agent_config_fields(env.config) if not getattr(seats, name).trainable]


def _on_policy_endpoint(env: Any, role: str, base_url: str | None) -> bool:
    """Whether `role`'s model calls would go to the policy's endpoint: no client of its own, or
    `base_url` itself."""
    client = getattr(env.config, role).client
    url = getattr(client, "base_url", None)
    return client is None or url is None or (base_url is not None and url.rstrip("/") == base_url.rstrip("/"))


def _untrained_on_policy(role: str, env_id: str) -> str:
    return (f"env {env_id!r} does not train its {role!r} agent, but that agent has no model of its own: its calls "
            f"would go to the episode's base URL and be trained as the policy's. Give it one: "
            f"env_args.{role}.client.base_url (an endpoint the episode can reach: task.agent_endpoints) and "
            f"env_args.{role}.model")


def _note(**fields: Any) -> None:
    """The episode's note for the runner: its output's last line (reward/agents/runner.py)."""
    sys.stdout.flush()
    print(EPISODE_NOTE + json.dumps(fields), file=sys.stderr, flush=True)


async def episode(base_url: str, row: dict, *, environment: str, taskset_args: dict | None = None,
                  harness: str = HARNESS_ID, env_id: str = "", env_args: dict | None = None,
                  index_key: str = "task_index", sampling: dict | None = None) -> float:
    """The task `row[index_key]` of `environment` played against the model at `base_url`; returns
    the trained traces' reward. `sampling`: verifiers' `SamplingConfig` fields (leave temperature
    and top_p unset: the agent server samples at the run's)."""
    index = row.get(index_key)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"row[{index_key!r}]={index!r}: expected a task index (an integer >= 0) of {environment}")
    env = load(environment, taskset_args, harness, env_id, env_args)
    for role in await _untrained_roles(env):
        if _on_policy_endpoint(env, role, base_url):
            raise ValueError(_untrained_on_policy(role, env_id))
    task = next(itertools.islice(env.taskset, index, None), None)  # built lazily, up to the one played
    if task is None:
        raise ValueError(f"row[{index_key!r}]={index}: {environment} has fewer tasks than that")
    os.environ.setdefault(API_KEY_VAR, "unused")
    ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
                          sampling=vf.SamplingConfig(**(sampling or {})))
    async with env.serving():
        result = await env.run_episode(task, ctx)
    if not result.ok or not result.traces:
        errors = [e.message for e in result.errors] + [e.message for t in result.traces for e in t.errors]
        raise RuntimeError(f"verifiers episode of task {index} failed: {'; '.join(errors)[:2000] or 'no trace'}")
    trained = [t for t in result.traces if t.agent is None or t.agent.trainable]
    if not trained:
        raise RuntimeError(f"verifiers episode of task {index}: no trace of a trained agent (every role is untrained)")
    parts: dict[str, tuple[float, float]] = {}
    for t in trained:
        prefix = f"{t.agent.name}." if len(trained) > 1 and t.agent is not None and t.agent.name else ""
        for name, r in t.rewards.items():
            if r is None:
                continue
            if not (math.isfinite(r.score) and math.isfinite(r.weight)):
                raise ValueError(f"verifiers reward function {name!r} of task {index} scored {r.score!r} (weight "
                                 f"{r.weight!r}): a reward function returns a finite number")
            parts[prefix + name] = (r.score, r.weight)
    reward = sum(t.reward for t in trained) / len(trained)
    if not math.isfinite(reward):
        raise ValueError(f"verifiers reward of task {index} is {reward!r}, the weighted sum of " +
                         ", ".join(f"{n}={s!r} x {w!r}" for n, (s, w) in parts.items()))
    limits = [f"{t.agent.name + ': ' if t.agent is not None and t.agent.name else ''}{t.stop_condition}"
              for t in result.traces if t.stop_condition in LIMITS]
    _note(prompt="rendered", reward_parts={n: s * w for n, (s, w) in parts.items()},
          **({"truncated": f"verifiers' limit ended the exchange before it was done ({', '.join(limits)})"}
             if limits else {}))
    return reward


def check_kwargs(*, environment: str, taskset_args: dict | None = None, harness: str = HARNESS_ID,
                 env_id: str = "", env_args: dict | None = None, index_key: str = "task_index",
                 sampling: dict | None = None) -> None:
    """Before Ray starts (reward.loader calls it where the episodes will run): the environment
    loads with these taskset arguments, env and harness, every agent the env does not train has a
    model of its own, and `sampling` leaves the sampling to the run."""
    try:
        env = load(environment, taskset_args, harness, env_id, env_args)
    except Exception as exc:  # noqa: BLE001 - verifiers' own message, attributed to the fields
        raise ValueError(f"environment={environment!r} with taskset_args={taskset_args!r}, harness={harness!r}"
                         f"{f', env_id={env_id!r}' if env_id else ''}{f', env_args={env_args!r}' if env_args else ''} "
                         f"does not load in verifiers: {type(exc).__name__}: {str(exc)[:1000]} (install the "
                         "environment's package: bash launch/agent_env.sh verifiers PACKAGE)") from None
    try:
        untrained = asyncio.run(_untrained_roles(env))
    except Exception:  # noqa: BLE001 - an env whose setup needs live agents: the episode checks it
        untrained = []
    for role in untrained:
        if _on_policy_endpoint(env, role, None):
            raise ValueError(_untrained_on_policy(role, env_id))
    if not isinstance(index_key, str) or not index_key:
        raise ValueError(f"index_key={index_key!r}: name the rows' task-index column")
    fixed = sorted({"temperature", "top_p"} & set(sampling or {}))
    if fixed:
        raise ValueError(f"sampling sets {fixed}: the agent server samples every call at rollout.temperature and "
                         "rollout.top_p (what the learner scores); remove them")
    vf.SamplingConfig(**(sampling or {}))


episode.check_kwargs = check_kwargs


def main(argv: list[str] | None = None) -> None:
    """`python -m reward.agents.verifiers ENVIRONMENT OUT.jsonl [TASKSET_ARGS_JSON]`, in the verifiers
    virtual environment: one row per task of the environment (`task_index`, and its prompt when it
    is text, else a label), the training rows for `task.agent=reward.agents.verifiers:episode`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        raise SystemExit(main.__doc__)
    env = load(args[0], json.loads(args[2]) if len(args) == 3 else None)
    os.makedirs(os.path.dirname(os.path.abspath(args[1])), exist_ok=True)
    rows = 0
    with open(args[1], "w") as f:
        for index, task in enumerate(env.taskset):
            text = task.data.prompt if isinstance(task.data.prompt, str) and task.data.prompt else ""
            f.write(json.dumps({"prompt": text or f"{args[0]} task {index}", "task_index": index}) + "\n")
            rows += 1
    print(f"wrote {rows} rows to {args[1]}")


if __name__ == "__main__":
    main()
