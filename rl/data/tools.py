"""The one tool-call format environments parse: JSON inside ``<tool_call>`` tags.

    <tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>

This is the format of the Hermes-style chat templates (Qwen2.5, Qwen3 and others render a tool
call exactly so, and render a ``{"role": "tool", "content": ...}`` message as the tool's answer),
so an HF chat model with a tool template calls tools in its own format; the built-in tiny models
are trained to write it too. Whitespace around the JSON is ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class BadToolCall(ValueError):
    """Text between <tool_call> tags that is not {"name": str, "arguments": {...}}."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in `text`, in order ([] when there is none). A malformed one raises
    BadToolCall, whose message an environment can hand back to the model as its observation."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            raise BadToolCall(f"tool call is not JSON: {err.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise BadToolCall('tool call needs {"name": str, "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise BadToolCall("tool call arguments are not JSON") from None
        if not isinstance(args, dict):
            raise BadToolCall("tool call arguments must be a JSON object")
        calls.append(ToolCall(obj["name"], args))
    return calls


def text_outside_tool_calls(text: str) -> str:
    """`text` with its <tool_call> ... </tool_call> spans removed, stripped."""
    return _CALL.sub("", text).strip()


def format_tool_call(call: ToolCall) -> str:
    """The text of `call` in the format above (compact JSON), as the tiny models are taught it."""
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":")) \
        + "</tool_call>"


def tool_message(content: str) -> dict[str, str]:
    """A tool's answer as a chat message (the template renders it as its tool turn)."""
    return {"role": "tool", "content": content}
