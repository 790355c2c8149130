"""OpenAI answers, for the agent server (reward/agents/server.py): a recorded call as the body the
`openai` client expects (`chat.completion`, `text_completion`), or as server-sent events when the
request streams (the whole answer in one content chunk: it is sampled before anything is sent).
Pure formatting: what the agent reads is built from the record, so it is what was recorded.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Callable, Iterator

from rl.data.agent_calls import RecordedCall

Answer = dict[str, Any] | Iterator[str]  # a JSON body, or the lines of an event stream


def chat(call: RecordedCall, content: str | None, tool_calls: list[dict[str, Any]], body: dict[str, Any],
         model: str, tokens: Callable[[RecordedCall], list[str]]) -> Answer:
    """`call` as a chat completion whose message is (`content`, `tool_calls`); `tokens` names the
    sampled tokens, asked only when the body wants log-probs."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = "tool_calls" if tool_calls else call.finish_reason
    logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens(call), call.logprobs)]} if body.get("logprobs") else None
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
    if not body.get("stream"):
        return {**head, "object": "chat.completion", "usage": usage(call), "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}]}
    delta = {**message, "tool_calls": [{"index": j, **tc} for j, tc in enumerate(tool_calls)]} if tool_calls \
        else message
    chunks = [{**head, "object": "chat.completion.chunk", "choices": [
                   {"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs}]},
              {**head, "object": "chat.completion.chunk", "choices": [
                  {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(call)})
    return sse(chunks)


def text(call: RecordedCall, body: dict[str, Any], model: str, tokens: Callable[[RecordedCall], list[str]]) -> Answer:
    """`call` as a text completion; its log-probs are the sampled tokens' (top_logprobs are not
    available: the engine returns the sampled token's only)."""
    logprobs = None
    if body.get("logprobs") is not None:
        names = tokens(call)
        offsets = [sum(len(t) for t in names[:i]) for i in range(len(names))]
        logprobs = {"tokens": names, "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": offsets}
    choice = {"index": 0, "text": call.completion_text, "finish_reason": call.finish_reason, "logprobs": logprobs}
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": model}
    if not body.get("stream"):
        return {**head, "choices": [choice], "usage": usage(call)}
    chunks = [{**head, "choices": [choice]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": usage(call)})
    return sse(chunks)


def usage(call: RecordedCall) -> dict[str, int]:
    n, m = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def sse(chunks: list[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: the whole answer in one content chunk, then the end, then [DONE]."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
