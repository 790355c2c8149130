"""OpenEnv environments (openenv-core: an `Environment` served by its own server, reached through
its `EnvClient`), played as agent episodes: `task.agent=reward.agents.openenv:episode`.

openenv-core's dependencies (gradio's pillow pin among them) conflict with ours, so the episode runs
in a virtual environment of its own (`task.agent_python`, made by `launch/agent_env.sh openenv`),
and the environment's server is started as its authors start it (`uvicorn server.app:app`, or its
Docker image), before the run. Per episode: the user's `EnvClient` class connects to the server
(`task.agent_kwargs.server_url`) and `reset`s (with the row's `seed`, if it has one); its observation, after the row's prompt, is the
user's turn; each model reply (a chat call to the episode's base URL, which the agent server
records token for token) becomes the action (`action_field`), and each observation after a step
the next user turn, until the environment says done or `max_turns`. The episode's reward is the
sum of the environment's rewards. An episode whose conversation fills the model's context (the
agent server answers 400 `context_length_exceeded`) ends there, truncated, with the rewards it had
(the runner marks it truncated); so does one that reaches `max_turns` before the environment says
done (its note, reward/agents/runner.py `EPISODE_NOTE`, tells the runner). A server that hangs or
dies costs its episode only: its calls raise or overrun `task.agent_timeout_s`, and the episode is
an error sample.

Runs where only the standard library part of ours is importable (reward.loader here).
openenv-core and openai are imported at the top, so the agent pool's zygote imports them once (its
import pulls in FastAPI and gradio: ~10 s) and every episode's fresh fork has them.
"""

from __future__ import annotations

import json
import sys
import typing
from typing import Any

import openenv.core  # noqa: F401 - imported once, in the zygote, not by every episode
from openai import AsyncOpenAI, BadRequestError

from reward.loader import load_object  # standard library only, as the zygote's own loader

_SKIPPED = ("done", "reward", "metadata")
EPISODE_NOTE = "rlpost-episode-note: "  # reward/agents/runner.py EPISODE_NOTE (not importable here)


def action_class(client: type) -> type:
    """The Action type the user's `EnvClient[Action, Observation, State]` subclass declares (dict
    for openenv-core's GenericEnvClient, whose actions are `Dict[str, Any]`)."""
    for base in getattr(client, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args:
            return typing.get_origin(args[0]) or args[0]
    raise TypeError(f"{client.__name__} does not declare its action type (subclass EnvClient[Action, Obs, State])")


def observation_text(observation: Any, field: str | None = None) -> str:
    """An observation as the model reads it: `field` when named; else its only other field when it
    has one (besides done, reward, metadata); else those fields as JSON."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    if field:
        return str(data[field])
    rest = {k: v for k, v in data.items() if k not in _SKIPPED}
    if len(rest) == 1:
        return str(next(iter(rest.values())))
    return json.dumps(rest, default=str)


async def episode(base_url: str, row: dict, *, client: str, server_url: str, action_field: str = "message",
                  observation_field: str | None = None, max_turns: int = 8, prompt_key: str = "prompt",
                  reset_kwargs: dict | None = None) -> float:
    """One episode of the environment behind `server_url` through `client` ("module:Class", the
    environment's own `EnvClient` subclass), the model reached at `base_url`."""
    env_client = load_object(client, None, field="task.agent_kwargs.client")
    action = action_class(env_client)
    llm = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    async with env_client(base_url=server_url) as env:
        seed = {"seed": row["seed"]} if row.get("seed") is not None else {}  # a row's own episode
        result = await env.reset(**{**(reset_kwargs or {}), **seed})
        total = float(result.reward or 0.0)
        first = observation_text(result.observation, observation_field)
        prompt = row.get(prompt_key) or ""
        messages = [{"role": "user", "content": f"{prompt}\n{first}" if prompt else first}]
        for _ in range(max_turns):
            if result.done:
                break
            try:
                reply = await llm.chat.completions.create(model="policy", messages=messages)
            except BadRequestError as err:
                if err.code == "context_length_exceeded":  # the context is full: truncated, keeping its rewards
                    return total  # (the runner reads the refusal)
                raise
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            result = await env.step(action(**{action_field: text}))
            total += float(result.reward or 0.0)
            if not result.done:
                messages.append({"role": "user", "content": observation_text(result.observation, observation_field)})
    if not result.done:  # max_turns ended it: truncated, keeping its rewards (the runner reads the note)
        sys.stdout.flush()
        print(EPISODE_NOTE + json.dumps({"truncated": f"max_turns={max_turns} reached before the environment was "
                                                       "done"}), file=sys.stderr, flush=True)
    return total
