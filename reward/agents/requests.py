"""OpenAI request bodies, parsed and checked for the agent server (reward/agents/server.py).

Agents are untrusted, and the learner scores every token at the run's sampling settings, so a body
is refused (an `ApiError` 400 naming the field) rather than half-honoured: a field this server
does not know, one that would change what is sampled unless it has its neutral value, messages
the chat template cannot take, token ids outside the vocabulary. Nothing here keeps state: each
function turns one request's JSON into what the server samples from, or says why it cannot.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any

from reward.agents.http_limits import ApiError, check_text, check_values, loads

# Body fields: served; accepted and ignored (no effect on what is sampled); refused unless they
# have their neutral value (they change sampling in a way the learner would not score, or ask for
# more than the one completion the policy samples). temperature and top_p are checked per episode.
SERVED = {"messages", "prompt", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
          "max_completion_tokens", "seed", "stream", "stream_options", "logprobs"}
IGNORED = {"model", "user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "top_k": (-1,), "min_p": (0,), "stop": ([], ""), "top_logprobs": (0,),
    "logprobs_mode": (), "response_format": ({"type": "text"},), "echo": (False,), "suffix": ("",),
}

# Why `response_format` (JSON mode, a JSON schema: the Agents SDK's `output_type`) is refused rather
# than served through the engine's structured outputs (docs/environments-and-agents.md)
STRUCTURED_OUTPUT = (
    "response_format: structured output is not served: the learner would train on tokens a grammar "
    "constrained (the engine masks every token the JSON schema forbids) as if the policy had sampled them "
    "freely, so the sampler's and the learner's log-probs disagree; use a plain-text instruction (e.g. 'reply "
    "with a JSON object with keys ...') and parse the reply. With the OpenAI Agents SDK, leave Agent.output_type "
    "unset and parse result.final_output yourself; omit response_format (or send {\"type\": \"text\"})")


def show(value: Any) -> str:
    """A client's value quoted in an error: cut short, however long or deeply nested."""
    return reprlib.repr(value)


def is_number(value: Any) -> bool:
    """An int or float (JSON's numbers); a bool never stands for one."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _neutral(value: Any, options: tuple[Any, ...]) -> bool:
    """`value` is null or one of `options` (a bool never stands for a number)."""
    return value is None or any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in options)


def parse_body(raw: bytes, completions: bool, temperature: float, top_p: float) -> dict[str, Any]:
    """The body as a JSON object whose every field is served at the episode's sampling settings;
    400 naming the first field that is not (checked before the episode's turn is taken)."""
    body = loads(raw, None)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, completions)
    check_sampling(body, temperature, top_p)
    check_values(body, "")
    return body


def check_fields(body: dict[str, Any], completions: bool) -> None:
    """400 for a field this server cannot honour or does not know (never silently ignored): one
    that would change what is sampled (the learner scores the run's distribution), or ask for more
    than the one completion the policy samples, unless it has its neutral value."""
    for name, value in body.items():
        check_text(name, "the body", "a field's name")
        if name not in SERVED | IGNORED | set(NEUTRAL):
            raise ApiError(400, f"unsupported field {show(name)}: this training server refuses what it cannot honour "
                                "exactly rather than ignore it; omit it", name)
        if name == "response_format" and not _neutral(value, NEUTRAL[name]):
            raise ApiError(400, STRUCTURED_OUTPUT, name, "structured_output_not_served")
        if name in NEUTRAL and not _neutral(value, NEUTRAL[name]):
            neutral = " or ".join(json.dumps(o) for o in NEUTRAL[name]) or "nothing else"
            raise ApiError(400, f"{name}={show(value)} is not supported by this training server (it samples one "
                                f"completion with the run's sampling settings, which the learner scores, and records "
                                f"it exactly); omit {name} (or send null or {neutral})", name)
    wrong = ("messages", "tools", "tool_choice", "max_completion_tokens", "top_logprobs") if completions \
        else ("prompt", "echo", "suffix", "best_of")
    for name in wrong:
        if name in body:
            raise ApiError(400, f"{name} belongs to the {'chat' if completions else 'completions'} API; "
                                f"use /{'chat/completions' if completions else 'completions'}", name)
    if not isinstance(body.get("stream_options"), (dict, type(None))):
        raise ApiError(400, "stream_options must be an object", "stream_options")


def check_sampling(body: dict[str, Any], temperature: float, top_p: float) -> None:
    """400 unless the body samples as the learner scores: temperature and top_p omitted or the
    episode's (another value would be trained on as if sampled at these), max_tokens an integer
    >= 1 (capped later), seed an integer."""
    for name, value, whose in (("temperature", temperature, "the run's rollout.temperature unless the trainer "
                                "set this episode's"), ("top_p", top_p, "the run's rollout.top_p")):
        got = body.get(name)
        if got is not None and not (is_number(got) and got == value):
            raise ApiError(400, f"{name}={show(got)}: every call of this episode samples at {name}={value} "
                                f"({whose}), the distribution the learner scores; omit {name} or send {value}", name)
    for name in ("max_tokens", "max_completion_tokens"):
        got = body.get(name)
        if got is not None and not (is_number(got) and isinstance(got, int) and got >= 1):
            raise ApiError(400, f"{name} must be an integer >= 1, got {show(got)}", name)
    seed = body.get("seed")
    if seed is not None and not (is_number(seed) and isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer, got {show(seed)}", "seed")


def max_tokens(body: dict[str, Any], prompt_len: int, max_new_tokens: int, max_model_len: int | None,
               param: str) -> int:
    """What the body asks for (else all it may have), capped at max_new_tokens and the room
    max_model_len leaves, so the episode always fits its context; 400 when the prompt leaves none."""
    cap = max_new_tokens
    if max_model_len is not None:
        room = max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_len} tokens; this server's context is {max_model_len} "
                                "tokens (rollout.max_model_len), leaving no room to generate", param,
                           "context_length_exceeded")
        cap = min(cap, room)
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    return cap if asked is None else min(asked, cap)


# ---- chat bodies --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    """A chat message reduced to what the template sees: compared across an episode's calls to
    find the conversation a call continues."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def reply_key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """What identifies an assistant message the server returned (whitespace around it aside)."""
        return self.content.strip(), self.tool_calls


def messages(raw: Any) -> list[Message]:
    """`messages` as Messages; 400 naming the first that is not a text message with a role."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: a non-empty list of messages is required", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: a message is an object with a role", f"messages[{i}]")
        for name in ("tool_call_id", "name"):
            if not isinstance(m.get(name), (str, type(None))):
                raise ApiError(400, f"messages[{i}].{name} must be a string", f"messages[{i}].{name}")
        out.append(Message(m["role"], text(m.get("content"), f"messages[{i}].content"),
                           tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls"), m.get("tool_call_id"),
                           m.get("name")))
    return out


def text(content: Any, param: str) -> str:
    """A message's content as text: a string, None, or a list of text parts (the model reads text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"{param}: only text content is supported (a string or a list of text parts)", param)


def tool_calls(raw: Any, param: str) -> tuple[tuple[str, str], ...]:
    """An assistant message's tool calls as ((name, canonical JSON arguments), ...): the same call
    compares equal however the agent's client spelled its arguments."""
    if not isinstance(raw, (list, type(None))):
        raise ApiError(400, f"{param} must be a list of tool calls", param)
    out = []
    for j, tc in enumerate(raw or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{param}[{j}]: a tool call needs function.name and function.arguments",
                           f"{param}[{j}]")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = loads(args, f"{param}[{j}].function.arguments")
            check_values(args, f"{param}[{j}].function.arguments")
        out.append((fn["name"], json.dumps(args, sort_keys=True)))
    return tuple(out)


def tools(body: dict[str, Any]) -> tuple[list[Any] | None, bool]:
    """The body's tool definitions (None: none) and whether the model's tool calls are parsed out
    of its text (tool_choice "auto" or omitted); 400 for a choice that would force a call."""
    defined = body.get("tools") or None
    if defined is not None and not isinstance(defined, list):
        raise ApiError(400, "tools must be a list of tool definitions", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"tool_choice={show(choice)}: only 'auto' and 'none' are supported (the model is "
                            "never forced to call a tool)", "tool_choice")
    return defined, bool(defined) and choice != "none"


# ---- completions bodies -------------------------------------------------------------------------

def prompt(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    """The one prompt of a /completions body: text, or token ids of the model's vocabulary (400
    naming the first that is not). A batch of prompts is refused: an episode is one sequence of calls."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if not (isinstance(raw, list) and raw and not any(isinstance(p, (str, list)) for p in raw)):
        raise ApiError(400, "prompt must be one string or one non-empty list of token ids", "prompt")
    for i, t in enumerate(raw):
        if not (is_number(t) and isinstance(t, int) and 0 <= t < vocab_size):
            raise ApiError(400, f"prompt[{i}]={show(t)}: a token id is an integer in [0, {vocab_size}) (the "
                                "model's vocabulary)", f"prompt[{i}]")
    return list(raw)
