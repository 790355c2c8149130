"""An OpenAI-compatible endpoint in front of the rollout fleet, recording token-exact episodes
(DESIGN.md "Agents through an OpenAI-compatible endpoint").

Any agent written with the plain `openai` client becomes an environment: each episode gets its own
base URL (`http://HOST:PORT/episodes/{key}/v1`), and every call made there is recorded as a
`RecordedCall` (exact prompt ids, sampled ids, log-probs, policy versions) that
`rl.data.agent_calls.episode_sample` turns into one training Sample.

The server owns tokenization. A chat call whose messages are the previous call's messages + the
assistant message it returned + new messages gets, as its prompt, the previous prompt + the
previous completion exactly as sampled + the template's tokens for the new messages
(`ObservationEncoder`, tokenized once), so nothing the model sampled is ever re-tokenized. Any
other conversation is rendered afresh (and `episode_sample` will say the agent rewrote history).

Calls of one episode are served one at a time (an episode is one trajectory); episodes run
concurrently, each call in a worker thread that blocks on `generate` (the fleet).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl.data.agent_calls import RecordedCall
from rl.data.dataset import derive_seed
from rl.data.episodes import ObservationEncoder
from rl.data.tools import BadToolCall, ToolCall, format_tool_call, parse_tool_calls, text_outside_tool_calls
from rl.data.types import GenerationRequest, Sample

log = logging.getLogger(__name__)

_KEY = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]*")
_REQUEST_FIELDS = {f.name for f in fields(GenerationRequest)}

# Body fields: served; accepted and ignored (no effect on what is sampled); refused unless they
# have their neutral value (they change sampling in a way the fleet cannot honour or record).
_SERVED = {"messages", "prompt", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
           "max_completion_tokens", "seed", "n", "stream", "logprobs", "top_logprobs"}
_IGNORED = {"model", "user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options",
            "prompt_cache_key", "safety_identifier"}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "stop": (None, [], ""), "response_format": (None, {"type": "text"}),
    "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
}


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


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


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"{param}: only text content is supported (a string or a list of text parts)", param)


def _calls(tool_calls: Any, param: str) -> tuple[tuple[str, str], ...]:
    """An assistant message's tool calls as ((name, canonical JSON arguments), ...)."""
    out = []
    for j, tc in enumerate(tool_calls or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{param}[{j}]: a tool call needs function.name and function.arguments",
                           f"{param}[{j}]")
        args = fn.get("arguments") or {}
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ApiError(400, f"{param}[{j}].function.arguments is not JSON", f"{param}[{j}]") from None
        out.append((fn["name"], json.dumps(args, sort_keys=True)))
    return tuple(out)


@dataclass(frozen=True)
class _Message:
    """A chat message reduced to what the template sees (compared across calls)."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def reply_key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """What identifies an assistant message the server returned (whitespace around it aside)."""
        return self.content.strip(), self.tool_calls


def _messages(raw: Any) -> list[_Message]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: a non-empty list of messages is required", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: a message is an object with a role", f"messages[{i}]")
        out.append(_Message(m["role"], _text(m.get("content"), f"messages[{i}].content"),
                            _calls(m.get("tool_calls"), f"messages[{i}].tool_calls"), m.get("tool_call_id"),
                            m.get("name")))
    return out


@dataclass
class _Chat:
    """An episode's last chat call, for extending its prompt token-exactly."""

    messages: list[_Message]
    tools: str  # canonical JSON
    reply: tuple[str, tuple[tuple[str, str], ...]]
    call: RecordedCall


@dataclass
class _Episode:
    key: str
    seed_base: int
    metadata: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time
    calls: list[RecordedCall] = field(default_factory=list)
    replies: dict[tuple, str] = field(default_factory=dict)  # returned assistant message -> raw model text
    chat: _Chat | None = None
    text: tuple[str, RecordedCall] | None = None  # last /completions call: its prompt text and record
    closing: bool = False  # no new call starts
    done: bool = False  # nothing more is recorded


class AgentServer:
    """OpenAI-compatible HTTP server over a blocking `generate` (the fleet), per-episode recording.

    `generate(request) -> Sample` must be thread-safe; it is called from one worker thread per call
    in flight. Per call: the body's temperature, max_tokens (or max_completion_tokens) and seed, else
    the defaults; the seed is derived from (the episode's seed_base, the call's index) unless given.
    `top_p` is the fleet's (`top_p_default`): a request asking for another is refused while
    `GenerationRequest` has no top_p field (passed on once it has). With `max_model_len`, a prompt
    that leaves no room is refused (400, code context_length_exceeded) and max_tokens is capped to
    the room left, so an episode's trajectory always fits the learner's context. At most
    `max_concurrent_calls` calls wait on `generate` at once (worker threads); more queue.
    """

    def __init__(self, tokenizer: Any, generate: Callable[[GenerationRequest], Sample], *,
                 host: str = "127.0.0.1", port: int = 0, max_tokens_default: int = 256,
                 temperature_default: float = 1.0, top_p_default: float = 1.0, max_model_len: int | None = None,
                 model_name: str = "policy", max_concurrent_calls: int = 1024,
                 observation_role: str = "tool"):
        self.tokenizer, self.generate = tokenizer, generate
        self.host, self._port = host, port
        self.max_tokens_default, self.temperature_default = max_tokens_default, temperature_default
        self.top_p_default, self.max_model_len, self.model_name = top_p_default, max_model_len, model_name
        self.max_concurrent_calls = max_concurrent_calls
        self.eos = tokenizer.eos_token_id
        try:  # "the template's tokens after an assistant turn ending at EOS", as in-process episodes compute them
            self._encoder: ObservationEncoder | None = ObservationEncoder(tokenizer, chat=True, role=observation_role,
                                                                          cap=1 << 30)
        except Exception as err:  # noqa: BLE001 - no template, or one that cannot be extended: render afresh
            log.warning("agent server: chat prompts cannot extend earlier calls token-exactly (%s); every chat call "
                        "is rendered afresh, so multi-call episodes will be flagged as rewritten", err)
            self._encoder = None
        self._lock = threading.Lock()
        # HF fast tokenizers may refuse concurrent use ("Already borrowed") when a call changes their
        # truncation/padding state: prompts are built one at a time (fast next to generating)
        self._tokenizer_lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}
        self._closed: set[str] = set()
        self._tools_checked = False
        self._limiter: anyio.CapacityLimiter | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.app = self._make_app()

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve in a background thread; returns the server's URL once it is listening."""
        if self._thread is not None:
            raise RuntimeError("AgentServer already started")
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        self._socket, self._port = sock, sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"agent-server:{self._port}")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agent server on {self.host}:{self._port} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        """Stop serving (calls in flight get a few seconds to finish); idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = self._limiter = None  # the limiter belongs to the old loop

    def __enter__(self) -> AgentServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- episodes -------------------------------------------------------------------------------

    def open_episode(self, key: str, seed_base: int, metadata: dict[str, Any] | None = None) -> str:
        """Start recording episode `key` (URL-safe: letters, digits, . _ ~ -); returns its base URL
        for `openai.OpenAI(base_url=...)`. `metadata` goes with each of its GenerationRequests."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"episode key {key!r}: use letters, digits and . _ ~ - only, not starting with '.' "
                             "(it is part of a URL)")
        url = self.base_url(key)
        with self._lock:
            if key in self._episodes:
                raise ValueError(f"episode {key!r} is already open")
            self._closed.discard(key)
            self._episodes[key] = _Episode(key, int(seed_base), dict(metadata or {}))
        return url

    def base_url(self, key: str) -> str:
        if self._thread is None:
            raise RuntimeError("AgentServer is not serving: call start() first (its port is chosen then)")
        return f"{self.url}/episodes/{key}/v1"

    def close_episode(self, key: str, timeout_s: float | None = None) -> list[RecordedCall]:
        """Stop episode `key` and return its calls in order. A call in flight is waited for (up to
        `timeout_s`, then left unrecorded); later calls to the key get a 404."""
        with self._lock:
            ep = self._episodes.pop(key, None)
            if ep is None:
                raise KeyError(f"episode {key!r} is not open")
            ep.closing = True
            self._closed.add(key)
        got = ep.lock.acquire(timeout=-1 if timeout_s is None else timeout_s)
        try:
            with self._lock:
                ep.done = True
                return list(ep.calls)
        finally:
            if got:
                ep.lock.release()

    def _episode(self, key: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(key)
            if ep is None:
                if key in self._closed:
                    raise ApiError(404, f"episode {key!r} is closed: it was ended by the trainer and takes no more "
                                        "calls", code="episode_closed")
                raise ApiError(404, f"unknown episode {key!r}: no episode with this key is open on this server "
                                    "(use the base_url the trainer gave the agent)", code="episode_not_found")
            return ep

    # ---- HTTP -----------------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="rlpost agent server", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, err: ApiError) -> JSONResponse:
            return err.response()

        @app.exception_handler(Exception)
        async def server_error(_: Request, err: Exception) -> JSONResponse:  # a bug here: still OpenAI's format
            log.error("agent server: %s: %s", type(err).__name__, err, exc_info=err)
            return ApiError(500, f"internal error: {type(err).__name__}: {err}").response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
            return ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}").response()

        async def run(fn: Callable[[_Episode, dict[str, Any]], Any], key: str, request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            ep = self._episode(key)
            if self._limiter is None:  # made on the server's event loop
                self._limiter = anyio.CapacityLimiter(self.max_concurrent_calls)
            out = await anyio.to_thread.run_sync(self._call, fn, ep, body, limiter=self._limiter)
            if isinstance(out, dict):
                return JSONResponse(out)
            return StreamingResponse(out, media_type="text/event-stream")

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat(key: str, request: Request) -> Response:
            return await run(self._chat, key, request)

        @app.post("/episodes/{key}/v1/completions")
        async def completions(key: str, request: Request) -> Response:
            return await run(self._completion, key, request)

        @app.get("/episodes/{key}/v1/models")
        async def models(key: str) -> JSONResponse:
            self._episode(key)
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                             "owned_by": "rlpost"}]})

        return app

    def _call(self, fn: Callable[[_Episode, dict[str, Any]], Any], ep: _Episode, body: dict[str, Any]) -> Any:
        _check_fields(body, fn == self._completion)
        with ep.lock:
            if ep.closing:
                self._episode(ep.key)  # raises: closed
            return fn(ep, body)

    # ---- one call -------------------------------------------------------------------------------

    def _sample(self, ep: _Episode, body: dict[str, Any], prompt_ids: list[int],
                param: str) -> tuple[RecordedCall, int]:
        """Generate for `prompt_ids` and record the call; returns it and its index in the episode."""
        temperature = body.get("temperature")
        temperature = self.temperature_default if temperature is None else temperature
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ApiError(400, f"temperature must be a number >= 0, got {temperature!r}", "temperature")
        top_p = body.get("top_p")
        extra: dict[str, Any] = {}
        if top_p is not None:
            if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
                raise ApiError(400, f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
            if "top_p" in _REQUEST_FIELDS:
                extra["top_p"] = float(top_p)
            elif float(top_p) != self.top_p_default:
                raise ApiError(400, f"top_p={top_p}: this server samples with the fleet's top_p={self.top_p_default} "
                                    "(rollout.top_p); omit top_p or send that value", "top_p")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        max_tokens = self.max_tokens_default if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"{name} must be an integer >= 1, got {max_tokens!r}", name)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens; this server's context is "
                                    f"{self.max_model_len} tokens (rollout.max_model_len), leaving no room to "
                                    "generate", param, "context_length_exceeded")
            max_tokens = min(max_tokens, room)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError(400, f"seed must be an integer, got {seed!r}", "seed")
        index = len(ep.calls)
        request = GenerationRequest(prompt_ids=list(prompt_ids), prompt_text="", group_id=0, sample_index=0,
                                    seed=derive_seed(ep.seed_base, index) if seed is None else seed & 0x7FFFFFFF,
                                    metadata=ep.metadata, max_tokens=max_tokens, temperature=float(temperature),
                                    **extra)
        try:
            out = self.generate(request)
        except Exception as err:  # noqa: BLE001 - the fleet failed: the agent sees a 500, nothing is recorded
            log.exception("agent server: generate failed for episode %s call %d", ep.key, index)
            raise ApiError(500, f"generation failed: {type(err).__name__}: {err}", code="generation_failed") from None
        versions = out.token_versions if out.token_versions is not None else \
            [out.policy_version] * len(out.completion_ids)
        call = RecordedCall(list(prompt_ids), list(out.completion_ids), list(out.logprobs), list(versions),
                            out.finish_reason, out.completion_text, out.policy_version)
        with self._lock:
            if ep.done:
                raise ApiError(404, f"episode {ep.key!r} was closed while this call ran; it was not recorded",
                               code="episode_closed")
            ep.calls.append(call)
        return call, index

    def _chat(self, ep: _Episode, body: dict[str, Any]) -> Any:
        messages = _messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list of tool definitions", "tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise ApiError(400, f"tool_choice={choice!r}: only 'auto' and 'none' are supported (the model is never "
                                "forced to call a tool)", "tool_choice")
        tools_key = json.dumps(tools, sort_keys=True)
        with self._tokenizer_lock:
            prompt = self._extend(ep, messages, tools_key)
            if prompt is None:
                prompt = self._render(ep, messages, tools)
        call, index = self._sample(ep, body, prompt, "messages")
        content, calls = split_tool_calls(call.completion_text) if tools and choice != "none" else \
            (call.completion_text, [])
        tool_calls = [{"id": f"call_{index}_{j}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for j, c in enumerate(calls)]
        reply = _Message("assistant", content or "", _calls(tool_calls, "tool_calls"))
        ep.replies[reply.reply_key] = call.completion_text
        ep.chat = _Chat(messages, tools_key, reply.reply_key, call)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else call.finish_reason
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(self._tokens(call), call.logprobs)]} if body.get("logprobs") else None
        head = {"id": f"chatcmpl-{ep.key}-{index}", "created": int(time.time()), "model": self.model_name}
        usage = _usage(call)
        if not body.get("stream"):
            return {**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}]}
        delta = {**message, "tool_calls": [{"index": j, **tc} for j, tc in enumerate(tool_calls)]} if tool_calls \
            else message
        chunks = [{**head, "object": "chat.completion.chunk", "choices": [
                       {"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs}]},
                  {**head, "object": "chat.completion.chunk", "choices": [
                      {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        return _sse(chunks)

    def _extend(self, ep: _Episode, messages: list[_Message], tools_key: str) -> list[int] | None:
        """The prompt as the last chat call's prompt + its completion + the new messages' template
        tokens, when `messages` continue that call's conversation with its reply; else None."""
        last, n = ep.chat, len(ep.chat.messages) if ep.chat else 0
        if (last is None or self._encoder is None or last.tools != tools_key or len(messages) <= n + 1
                or messages[:n] != last.messages or messages[n].role != "assistant"
                or messages[n].reply_key != last.reply or ep.calls[-1] is not last.call):
            return None
        completion = last.call.completion_ids
        if completion and completion[-1] == self.eos:
            closing: list[int] = []
        elif last.call.finish_reason == "length":  # the template closes a cut-off turn with its EOS
            closing = [self.eos]
        else:  # stopped at another stop token: the template's turn end would not follow it
            return None
        try:
            observation = self._encoder([self._template_message(ep, m) for m in messages[n + 1:]])
        except ValueError as err:
            log.warning("agent server: episode %s: new messages cannot be appended token-exactly (%s); rendering "
                        "the conversation afresh", ep.key, err)
            return None
        return last.call.prompt_ids + completion + closing + observation

    def _template_message(self, ep: _Episode, m: _Message) -> dict[str, Any]:
        """A message as the chat template gets it: an assistant message the server returned is the
        model's own text (tool calls in its tags); another one's tool calls are written in them."""
        content = m.content
        if m.role == "assistant":
            content = ep.replies.get(m.reply_key) or content + "".join(
                format_tool_call(ToolCall(name, json.loads(args))) for name, args in m.tool_calls)
        out: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out

    def _render(self, ep: _Episode, messages: list[_Message], tools: list[Any] | None) -> list[int]:
        """The whole conversation rendered by the chat template, with the generation prompt."""
        kwargs = {"tools": tools} if tools else {}
        try:
            out = self.tokenizer.apply_chat_template([self._template_message(ep, m) for m in messages],
                                                     add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError, the template's raise_exception, no template
            raise ApiError(400, f"messages: the model's chat template cannot render them: {type(err).__name__}: "
                                f"{err}", "messages") from None
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if tools and not self._tools_checked:
            self._tools_checked = True
            bare = self.tokenizer.apply_chat_template([self._template_message(ep, m) for m in messages],
                                                      add_generation_prompt=True, tokenize=True)
            if list(bare["input_ids"] if hasattr(bare, "keys") else bare) == ids:
                log.warning("agent server: the model's chat template ignores `tools`: the model does not see the "
                            "tool definitions (describe the tools in a message instead)")
        return ids

    def _completion(self, ep: _Episode, body: dict[str, Any]) -> Any:
        """A text prompt that starts with the previous call's prompt + the text it returned continues
        it: the sampled ids (EOS included, though the returned text does not show it) + the rest,
        tokenized once. Any other text is tokenized whole (with the tokenizer's special tokens)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            last = ep.text
            head = last[0] + last[1].completion_text if last else None
            if last and ep.calls[-1] is last[1] and prompt.startswith(head):  # continue token-exactly
                rest = prompt[len(head):]
                with self._tokenizer_lock:
                    ids = last[1].prompt_ids + last[1].completion_ids + \
                        (list(self.tokenizer(rest, add_special_tokens=False).input_ids) if rest else [])
            else:
                with self._tokenizer_lock:
                    ids = list(self.tokenizer(prompt).input_ids)
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids, text = list(prompt), None
        else:
            raise ApiError(400, "prompt must be one string or one list of token ids", "prompt")
        call, index = self._sample(ep, body, ids, "prompt")
        ep.text = (text, call) if text is not None else None
        logprobs = None
        if body.get("logprobs") is not None:  # the sampled tokens' log-probs; top_logprobs are not available
            tokens = self._tokens(call)
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": call.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        choice = {"index": 0, "text": call.completion_text, "finish_reason": call.finish_reason, "logprobs": logprobs}
        head = {"id": f"cmpl-{ep.key}-{index}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if not body.get("stream"):
            return {**head, "choices": [choice], "usage": _usage(call)}
        chunks = [{**head, "choices": [choice]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": _usage(call)})
        return _sse(chunks)

    def _tokens(self, call: RecordedCall) -> list[str]:
        return [self.tokenizer.decode([t]) for t in call.completion_ids]


def _check_fields(body: dict[str, Any], completions: bool) -> None:
    """400 for a field this server cannot honour or does not know (never silently ignored)."""
    for name, value in body.items():
        if name in _NEUTRAL and value not in _NEUTRAL[name]:
            raise ApiError(400, f"{name}={value!r} is not supported by this training server (it samples one "
                                "completion, as the policy does, and records it exactly); omit it", name)
        if name not in _SERVED | _IGNORED | set(_NEUTRAL):
            raise ApiError(400, f"unsupported field {name!r}: this training server refuses what it cannot honour "
                                "exactly rather than ignore it; omit it", name)
    wrong = ("messages", "tools", "tool_choice", "max_completion_tokens", "top_logprobs") if completions \
        else ("prompt", "echo", "suffix", "best_of")
    for name in wrong:
        if name in body:
            raise ApiError(400, f"{name} belongs to the {'chat' if completions else 'completions'} API; "
                                f"use /{'chat/completions' if completions else 'completions'}", name)


def _usage(call: RecordedCall) -> dict[str, int]:
    n, m = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _sse(chunks: list[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: the whole answer in one content chunk, then the end, then [DONE]."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
