"""The calculator task as an OpenAI Agents SDK agent (`agents.Agent` with a function tool, run by
`Runner`), trained as written: `task=calculator_agents_sdk`.

The agent below is what its authors would write for OpenAI's API. The only lines that are about
us are the SDK's own documented switches in `solve`: its client pointed at the episode's base URL
and its chat-completions model (`set_default_openai_api("chat_completions")`), which our agent
server serves token for token, tool calls parsed in the model's own format. Each episode runs in
a process of its own, so these process-wide defaults are the episode's alone.
"""

from __future__ import annotations

from typing import Any

from agents import (Agent, MaxTurnsExceeded, Runner, function_tool, set_default_openai_api,
                    set_default_openai_client, set_tracing_disabled)
from openai import AsyncOpenAI

from examples.calculator_tool import evaluate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an integer expression of digits and + - *.

    Args:
        expression: e.g. 12+34*2
    """
    return str(evaluate(expression))


# No instructions: the tiny calculator model was taught episodes that start with the user's question.
AGENT = Agent(name="calculator", model="policy", tools=[calculator])


def solve(base_url: str, row: dict[str, Any], max_turns: int = 4) -> float:
    """One episode: the agent answers the row's question; 1.0 if its final answer is right."""
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0),
                              use_for_tracing=False)
    set_default_openai_api("chat_completions")
    set_tracing_disabled(True)  # no trace upload: nothing leaves the machine
    try:
        result = Runner.run_sync(AGENT, row["prompt"], max_turns=max_turns)
    except MaxTurnsExceeded:
        return 0.0
    return float(str(result.final_output).strip() == str(row["answer"]).strip())
