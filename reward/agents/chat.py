"""An episode's conversation as token ids, for the agent server (reward/agents/server.py).

The server owns tokenization, so that nothing the model sampled is ever tokenized again. A chat
call whose messages are the previous call's messages + the assistant message it returned + new
messages gets, as its prompt, the previous prompt + the previous completion exactly as sampled +
the template's tokens for the new messages (`ObservationEncoder`, tokenized once); a text prompt
that starts with the previous text call's prompt + the text it returned gets the previous ids +
the sampled ids + the rest tokenized once. Any other conversation is rendered afresh (a handoff,
a summary: `rl.data.agent_calls.episode_sample` makes it a new segment of the episode, where an
assistant message the server did not sample is prompt, never trained). The other way, the
model's text becomes the assistant message the agent gets: content and `<tool_call>` calls.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from rl.data.agent_calls import RecordedCall
from rl.data.episodes import ObservationEncoder
from rl.data.tools import BadToolCall, ToolCall, format_tool_call, parse_tool_calls, text_outside_tool_calls
from reward.agents.http_limits import ApiError
from reward.agents.requests import Message, tool_calls

log = logging.getLogger(__name__)


def split_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The model's text as (content outside the <tool_call> tags, or None when empty; the calls).
    Text with no call, or a malformed one (the agent then sees the raw text), has no calls."""
    try:
        calls = parse_tool_calls(text)
    except BadToolCall:
        return text, []
    if not calls:
        return text, []
    return text_outside_tool_calls(text) or None, calls


@dataclass
class _LastChat:
    """An episode's last chat call, for extending its prompt token-exactly."""

    messages: list[Message]
    tools: str  # canonical JSON
    reply: tuple[str, tuple[tuple[str, str], ...]]
    call: RecordedCall


@dataclass
class Conversation:
    """What an episode's next prompt may extend: its last chat call, the model's raw text of each
    assistant message returned (an agent sends back the parsed message, not the text), and its
    last text call (its prompt text and record)."""

    chat: _LastChat | None = None
    replies: dict[tuple, str] = field(default_factory=dict)
    text: tuple[str, RecordedCall] | None = None


class Prompts:
    """Chat messages and text prompts as prompt ids through `tokenizer` (its chat template for
    messages), each extending its episode's previous call token-exactly where it continues it."""

    def __init__(self, tokenizer: Any, observation_role: str = "tool"):
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        try:  # "the template's tokens after an assistant turn ending at EOS", as in-process episodes compute them
            self._encoder: ObservationEncoder | None = ObservationEncoder(tokenizer, chat=True, role=observation_role,
                                                                          cap=1 << 30)
        except Exception as err:  # noqa: BLE001 - no template, or one that cannot be extended: render afresh
            log.warning("agent server: chat prompts cannot extend earlier calls token-exactly (%s); every chat call "
                        "is rendered afresh (one that does not extend the last call's ids starts a new segment)", err)
            self._encoder = None
        # HF fast tokenizers may refuse concurrent use ("Already borrowed") when a call changes their
        # truncation/padding state: prompts are built one at a time (fast next to generating)
        self._lock = threading.Lock()
        self._tools_checked = False

    # ---- chat -----------------------------------------------------------------------------------

    def chat(self, conv: Conversation, messages: list[Message], tools: list[Any] | None,
             latest: RecordedCall | None) -> list[int]:
        """The prompt for `messages`: extending the last chat call when they continue it and it is
        the episode's `latest` call, else the whole conversation rendered afresh."""
        with self._lock:
            prompt = self._extend(conv, messages, json.dumps(tools, sort_keys=True), latest)
            return prompt if prompt is not None else self._render(conv, messages, tools)

    def reply(self, conv: Conversation, messages: list[Message], tools: list[Any] | None, use_tools: bool,
              call: RecordedCall, index: int) -> tuple[str | None, list[dict[str, Any]]]:
        """The assistant message for `call` (the episode's `index`th) as (content, OpenAI tool
        calls), remembered so that the conversation's next call can extend this one."""
        content, calls = split_tool_calls(call.completion_text) if use_tools else (call.completion_text, [])
        out = [{"id": f"call_{index}_{j}", "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for j, c in enumerate(calls)]
        reply = Message("assistant", content or "", tool_calls(out, "tool_calls"))
        conv.replies[reply.reply_key] = call.completion_text
        conv.chat = _LastChat(messages, json.dumps(tools, sort_keys=True), reply.reply_key, call)
        return content, out

    def _extend(self, conv: Conversation, messages: list[Message], tools_key: str,
                latest: RecordedCall | None) -> list[int] | None:
        """The prompt as the last chat call's prompt + its completion + the new messages' template
        tokens, when `messages` continue that call's conversation with its reply; else None."""
        last, n = conv.chat, len(conv.chat.messages) if conv.chat else 0
        if (last is None or self._encoder is None or last.tools != tools_key or len(messages) <= n + 1
                or messages[:n] != last.messages or messages[n].role != "assistant"
                or messages[n].reply_key != last.reply or latest is not last.call):
            return None
        completion = last.call.completion_ids
        if completion and completion[-1] == self.eos:
            closing: list[int] = []
        elif last.call.finish_reason == "length":  # the template closes a cut-off turn with its EOS
            closing = [self.eos]
        else:  # stopped at another stop token: the template's turn end would not follow it
            return None
        try:
            observation = self._encoder([self._template_message(conv, m) for m in messages[n + 1:]])
        except ValueError as err:
            log.warning("agent server: new messages cannot be appended token-exactly (%s); rendering the "
                        "conversation afresh", err)
            return None
        return last.call.prompt_ids + completion + closing + observation

    def _template_message(self, conv: Conversation, m: Message) -> dict[str, Any]:
        """A message as the chat template gets it: an assistant message the server returned is the
        model's own text (tool calls in its tags); another one's tool calls are written in them."""
        content = m.content
        if m.role == "assistant":
            content = conv.replies.get(m.reply_key) or content + "".join(
                format_tool_call(ToolCall(name, json.loads(args))) for name, args in m.tool_calls)
        out: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out

    def _render(self, conv: Conversation, messages: list[Message], tools: list[Any] | None) -> list[int]:
        """The whole conversation rendered by the chat template, with the generation prompt."""
        kwargs = {"tools": tools} if tools else {}
        try:
            out = self.tokenizer.apply_chat_template([self._template_message(conv, m) for m in messages],
                                                     add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError, the template's raise_exception, no template
            raise ApiError(400, f"messages: the model's chat template cannot render them: {type(err).__name__}: "
                                f"{err}", "messages") from None
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if tools and not self._tools_checked:
            self._tools_checked = True
            bare = self.tokenizer.apply_chat_template([self._template_message(conv, m) for m in messages],
                                                      add_generation_prompt=True, tokenize=True)
            if list(bare["input_ids"] if hasattr(bare, "keys") else bare) == ids:
                log.warning("agent server: the model's chat template ignores `tools`: the model does not see the "
                            "tool definitions (describe the tools in a message instead)")
        return ids

    # ---- text -----------------------------------------------------------------------------------

    def text(self, conv: Conversation, prompt: str, latest: RecordedCall | None) -> list[int]:
        """A text prompt that starts with the last text call's prompt + the text it returned (that
        call the episode's `latest`) continues it: the sampled ids (EOS included, though the
        returned text does not show it) + the rest, tokenized once. Any other text is tokenized
        whole (with the tokenizer's special tokens)."""
        last = conv.text
        with self._lock:
            if last and latest is last[1] and prompt.startswith(last[0] + last[1].completion_text):
                rest = prompt[len(last[0] + last[1].completion_text):]
                return last[1].prompt_ids + last[1].completion_ids + \
                    (list(self.tokenizer(rest, add_special_tokens=False).input_ids) if rest else [])
            return list(self.tokenizer(prompt).input_ids)

    def tokens(self, call: RecordedCall) -> list[str]:
        """Each sampled token as text (the answers' log-probs name them)."""
        return [self.tokenizer.decode([t]) for t in call.completion_ids]
