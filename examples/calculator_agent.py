"""The calculator task as agent code: a tool-using agent written with the plain `openai` client,
trained as it is (`task=calculator_agent`, `task.agent: examples.calculator_agent:solve`).

Nothing here knows about RL. The trainer calls `solve(base_url, row)` once per sample, with a base
URL of its own on the agent server (reward/agents/runner.py, reward/agents/server.py); every chat call made
there is sampled from the policy being trained and recorded token for token, and `solve`'s return
value is the episode's reward. Any agent harness works the same way: point its OpenAI client at
`base_url` and return a score.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import OpenAI

from examples.calculator_tool import evaluate

# One connection pool for every episode: an OpenAI client otherwise builds its own (~20 ms of CPU
# each, for an SSL context), once per episode here.
HTTP = httpx.Client(timeout=120.0)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an integer expression of digits and + - *",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def solve(base_url: str, row: dict[str, Any], max_turns: int = 4) -> float:
    """Ask the model the sum; run the calculator for each tool call it makes and send back the
    result; its first answer without a tool call is final: 1.0 if right, else 0.0."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as it came
        if not message.tool_calls:
            return float((message.content or "").strip() == str(row["answer"]).strip())
        for call in message.tool_calls:
            try:
                result = str(evaluate(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, TypeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
