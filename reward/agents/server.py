"""An OpenAI-compatible endpoint in front of the rollout fleet, recording token-exact episodes
(docs/architecture.md "Agents").

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

Agents are untrusted code. An episode's key is a secret (`secrets`): the base URL is the only
way into the episode, and a key that is unknown, closed or malformed gets the same 404, so no
agent can reach or probe another's episode. What the policy samples is the run's: a request
asking for another temperature, top_p, penalty or the like is refused (the learner scores every
token at the run's settings), as is anything the engine would choke on (token ids out of the
vocabulary, non-finite numbers, lone surrogates). Bodies, headers, reads and connections are
bounded, so a hostile or broken client costs a bounded amount of memory and time.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import reprlib
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl.data.agent_calls import RecordedCall
from reward.agents.http_limits import (MAX_HEADER_BYTES, AnswerFaults, ApiError, Connection, ConnectionBudget, check_text,
                                 check_values, loads, read_body)
from rl.data.dataset import derive_seed
from rl.data.episodes import ObservationEncoder
from rl.data.tools import BadToolCall, ToolCall, format_tool_call, parse_tool_calls, text_outside_tool_calls
from rl.data.types import GenerationRequest, Sample

log = logging.getLogger(__name__)

# Body fields: served; accepted and ignored (no effect on what is sampled); refused unless they
# have their neutral value (they change sampling in a way the learner would not score, or ask for
# more than the one completion the policy samples). temperature and top_p are checked per episode.
_SERVED = {"messages", "prompt", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
           "max_completion_tokens", "seed", "stream", "stream_options", "logprobs"}
_IGNORED = {"model", "user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "top_k": (-1,), "min_p": (0,), "stop": ([], ""), "top_logprobs": (0,),
    "logprobs_mode": (), "response_format": ({"type": "text"},), "echo": (False,), "suffix": ("",),
}


class RequestRejected(Exception):
    """Raised by `generate` when the engine refuses a request (bad parameters): answered as a 400,
    never a fault."""


def _show(value: Any) -> str:
    """A client's value quoted in an error: cut short, however long or deeply nested."""
    return reprlib.repr(value)


def _not_found() -> ApiError:
    """The one answer for a key that is unknown, closed or malformed (and any other path): the
    same bytes whatever the key, so an agent learns nothing about other episodes."""
    return ApiError(404, "unknown episode: use the base_url the trainer gave this episode", code="episode_not_found")


def _neutral(value: Any, options: tuple[Any, ...]) -> bool:
    """`value` is null or one of `options` (a bool never stands for a number)."""
    return value is None or any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in options)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    if not isinstance(tool_calls, (list, type(None))):
        raise ApiError(400, f"{param} must be a list of tool calls", param)
    out = []
    for j, tc in enumerate(tool_calls or []):
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
        for name in ("tool_call_id", "name"):
            if not isinstance(m.get(name), (str, type(None))):
                raise ApiError(400, f"messages[{i}].{name} must be a string", f"messages[{i}].{name}")
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
    seed_base: int
    metadata: dict[str, Any]
    temperature: float  # what every call samples at
    # one call at a time, the others waiting on the server's loop, their bodies unread, rather than
    # in worker threads: an agent flooding its own episode holds neither the threads other episodes'
    # calls need nor more than one body (a connection buffers 64 KiB before uvicorn stops reading)
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: list[RecordedCall] = field(default_factory=list)
    replies: dict[tuple, str] = field(default_factory=dict)  # returned assistant message -> raw model text
    chat: _Chat | None = None
    text: tuple[str, RecordedCall] | None = None  # last /completions call: its prompt text and record
    done: bool = False  # closed: nothing more is recorded
    waiting: int = 0  # its requests in flight or waiting their turn (at most max_pending_per_episode)
    refused: str | None = None  # the first cap it ran into (logged once per episode, not per request)


class AgentServer:
    """OpenAI-compatible HTTP server over a blocking `generate` (the fleet), per-episode recording.

    `generate(request) -> Sample` must be thread-safe; it is called from one worker thread per call
    in flight, at most `max_concurrent_calls` at once (more wait their turn). Every call samples at
    the episode's temperature (the run's `temperature` unless `open_episode` gave one) and the run's
    `top_p`, with max_tokens capped at `max_new_tokens` and at the room `max_model_len` leaves, so an
    episode's trajectory is what the learner scores and always fits its context; the seed is derived
    from (the episode's seed_base, the call's index) unless the body gives one.

    Limits on clients (agents are untrusted): a body over `max_body_bytes` is refused (413) while it
    is read, before anything is read when its Content-Length says so; a connection silent for
    `keep_alive_s` (a new one too) is closed, and so is one whose request headers have not all come
    `read_timeout_s` after it opened or after its last response; a body not all come
    `read_timeout_s` after the server began reading it (at once, unless the episode's previous call
    is still running) is a 408; headers still incomplete past MAX_HEADER_BYTES are a 400; past
    `max_connections` connections or requests in flight, a request gets a 503 at once. Fair share
    (issue 47): an episode may have `max_pending_per_episode` requests in flight or waiting and
    `max_connections_per_episode` connections (more get a 429 at once and the connection closed, so
    one agent's flood cannot fill the server's slots) and `max_calls` recorded calls
    (`task.agent_max_calls`; more get a 429 and the episode is an error naming it); connections
    that have named no live episode (keyless, wrong keys) are kept apart, at most
    `max_unclaimed_connections`, the oldest idle closed past that (`http_limits.ConnectionBudget`);
    each episode's first refusal is logged, not each request.
    The default body limit, max(1 MiB, 64 bytes a token of max_model_len (else of 64k tokens)),
    holds a full context of text at ~10 characters a token, each JSON-escaped to 6 bytes: a longer
    body could not fit the context anyway.
    """

    def __init__(self, tokenizer: Any, generate: Callable[[GenerationRequest], Sample], *,
                 host: str = "127.0.0.1", port: int = 0, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, max_model_len: int | None = None, model_name: str = "policy",
                 max_concurrent_calls: int = 256, observation_role: str = "tool", max_body_bytes: int | None = None,
                 read_timeout_s: float = 30.0, keep_alive_s: float = 5.0, max_connections: int = 1024,
                 max_calls: int = 1000, max_pending_per_episode: int = 4, max_connections_per_episode: int = 8,
                 max_unclaimed_connections: int = 256):
        self.tokenizer, self.generate = tokenizer, generate
        self.host, self._port = host, port
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, float(temperature), float(top_p)
        self.max_model_len, self.model_name = max_model_len, model_name
        self.max_concurrent_calls, self.max_connections = max_concurrent_calls, max_connections
        self.max_calls, self.max_pending_per_episode = max_calls, max_pending_per_episode
        self._connections = ConnectionBudget(max_unclaimed_connections, max_connections_per_episode)
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else \
            max(1 << 20, 64 * (max_model_len or 1 << 16))
        self.read_timeout_s, self.keep_alive_s = read_timeout_s, keep_alive_s
        self.eos, self.vocab_size = tokenizer.eos_token_id, len(tokenizer)
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
        # h11, not httptools (uvicorn's choice when installed): httptools has no cap on headers still
        # arriving; limit_concurrency answers 503 past max_connections connections or requests in flight
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=5, http=functools.partial(Connection, headers_timeout_s=self.read_timeout_s,
                                                             budget=self._connections),
            timeout_keep_alive=self.keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            limit_concurrency=self.max_connections)
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

    def open_episode(self, seed_base: int, metadata: dict[str, Any] | None = None,
                     temperature: float | None = None) -> tuple[str, str]:
        """A new episode: returns (key, base_url), the URL for `openai.OpenAI(base_url=...)`. The key
        is unguessable: holding the URL is the only way into the episode. `metadata` goes with each
        of its GenerationRequests; `temperature` is the episode's sampling temperature (None: the
        run's; evaluation opens greedy episodes with 0.0)."""
        if self._thread is None:
            raise RuntimeError("AgentServer is not serving: call start() first (its port is chosen then)")
        if temperature is not None and not (_number(temperature) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"episode temperature must be a finite number >= 0, got {temperature!r}")
        key = secrets.token_urlsafe(24)
        with self._lock:
            self._episodes[key] = _Episode(int(seed_base), dict(metadata or {}),
                                           self.temperature if temperature is None else float(temperature))
        return key, f"{self.url}/episodes/{key}/v1"

    def close_episode(self, key: str) -> list[RecordedCall]:
        """Ends the episode at once and returns its calls so far; never waits for a call in flight
        (that call's result is not recorded, and it answers 404). Unknown key: KeyError."""
        with self._lock:
            ep = self._episodes.pop(key)
            ep.done = True
            return list(ep.calls)

    def end_episode(self, key: str) -> None:
        """The agent returned, died or was killed: from now on its calls are refused (404) and nothing
        more is recorded; `close_episode` still returns what was. Unknown key: nothing (issue 47)."""
        with self._lock:
            ep = self._episodes.get(key)
            if ep is not None:
                ep.done = True

    def refusal(self, key: str) -> str | None:
        """The cap the episode ran into, if any (the runner makes it the sample's error)."""
        with self._lock:
            ep = self._episodes.get(key)
            return None if ep is None else ep.refused

    def _refuse(self, ep: _Episode, why: str, close: bool = False) -> ApiError:
        with self._lock:
            first, ep.refused = ep.refused is None, ep.refused or why
        if first:
            log.warning("agent server: an episode (seed_base %d) %s; its further refusals are not logged",
                        ep.seed_base, why)
        return ApiError(429, why, code="rate_limit_exceeded", close=close)

    def open_count(self) -> int:
        with self._lock:
            return len(self._episodes)

    def _episode(self, key: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(key)
        if ep is None:
            raise _not_found()
        return ep

    # ---- HTTP -----------------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="rlpost agent server", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(AnswerFaults)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, err: ApiError) -> JSONResponse:
            return err.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
            if err.status_code == 404:  # any other path: the same answer as a wrong key
                return _not_found().response()
            return ApiError(err.status_code, str(err.detail)).response()

        async def run(completions: bool, key: str, request: Request) -> Response:
            ep = self._episode(key)
            client = (request.client.host, request.client.port) if request.client else None
            if not self._connections.claim(client, key):
                raise self._refuse(ep, f"had over {self._connections.per_episode} connections open at once",
                                   close=True)  # body unread
            if self._limiter is None:  # made on the server's event loop
                self._limiter = anyio.CapacityLimiter(self.max_concurrent_calls)
            if ep.waiting >= self.max_pending_per_episode:
                raise self._refuse(ep, f"had over {self.max_pending_per_episode} requests in flight at once", close=True)  # body unread
            ep.waiting += 1
            try:
                async with ep.turn:
                    raw = await read_body(request, self.max_body_bytes, self.read_timeout_s)
                    out = await anyio.to_thread.run_sync(self._call, completions, ep, raw, limiter=self._limiter)
            finally:
                ep.waiting -= 1
            if isinstance(out, dict):
                return JSONResponse(out)
            return StreamingResponse(out, media_type="text/event-stream")

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat(key: str, request: Request) -> Response:
            return await run(False, key, request)

        @app.post("/episodes/{key}/v1/completions")
        async def completions(key: str, request: Request) -> Response:
            return await run(True, key, request)

        @app.get("/episodes/{key}/v1/models")
        async def models(key: str) -> JSONResponse:
            self._episode(key)
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                             "owned_by": "rlpost"}]})

        return app

    def _call(self, completions: bool, ep: _Episode, raw: bytes) -> Any:
        body = loads(raw, None)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _check_fields(body, completions)
        self._check_sampling(ep, body)
        check_values(body, "")
        if ep.done:
            raise _not_found()
        if len(ep.calls) >= self.max_calls:
            raise self._refuse(ep, f"made over task.agent_max_calls={self.max_calls} calls")
        return self._completion(ep, body) if completions else self._chat(ep, body)

    # ---- one call -------------------------------------------------------------------------------

    def _check_sampling(self, ep: _Episode, body: dict[str, Any]) -> None:
        """400 unless the body samples as the learner scores: temperature and top_p omitted or the
        episode's (another value would be trained on as if sampled at these), max_tokens an integer
        >= 1 (capped later), seed an integer."""
        for name, value, whose in (("temperature", ep.temperature, "the run's rollout.temperature unless the trainer "
                                    "set this episode's"), ("top_p", self.top_p, "the run's rollout.top_p")):
            got = body.get(name)
            if got is not None and not (_number(got) and got == value):
                raise ApiError(400, f"{name}={_show(got)}: every call of this episode samples at {name}={value} "
                                    f"({whose}), the distribution the learner scores; omit {name} or send {value}",
                               name)
        for name in ("max_tokens", "max_completion_tokens"):
            got = body.get(name)
            if got is not None and not (_number(got) and isinstance(got, int) and got >= 1):
                raise ApiError(400, f"{name} must be an integer >= 1, got {_show(got)}", name)
        seed = body.get("seed")
        if seed is not None and not (_number(seed) and isinstance(seed, int)):
            raise ApiError(400, f"seed must be an integer, got {_show(seed)}", "seed")

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, param: str) -> int:
        """What the body asks for (else all it may have), capped at max_new_tokens and the room
        max_model_len leaves; 400 when the prompt leaves none."""
        cap = self.max_new_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - prompt_len
            if room < 1:
                raise ApiError(400, f"the prompt is {prompt_len} tokens; this server's context is {self.max_model_len} "
                                    "tokens (rollout.max_model_len), leaving no room to generate", param,
                               "context_length_exceeded")
            cap = min(cap, room)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        return cap if asked is None else min(asked, cap)

    def _sample(self, ep: _Episode, body: dict[str, Any], prompt_ids: list[int],
                param: str) -> tuple[RecordedCall, int]:
        """Generate for `prompt_ids` and record the call; returns it and its index in the episode."""
        max_tokens = self._max_tokens(body, len(prompt_ids), param)
        seed, index = body.get("seed"), len(ep.calls)
        request = GenerationRequest(prompt_ids=list(prompt_ids), prompt_text="", group_id=0, sample_index=0,
                                    seed=derive_seed(ep.seed_base, index) if seed is None else seed & 0x7FFFFFFF,
                                    metadata=ep.metadata, max_tokens=max_tokens, temperature=ep.temperature)
        try:
            out = self.generate(request)
        except RequestRejected as err:
            raise ApiError(400, f"the engine refused the request: {err}", code="request_rejected") from None
        except Exception as err:  # noqa: BLE001 - the fleet failed: the agent sees a 500, nothing is recorded
            log.exception("agent server: generate failed for call %d of an episode", index)
            raise ApiError(500, f"generation failed: {type(err).__name__}: {err}", code="generation_failed") from None
        versions = out.token_versions if out.token_versions is not None else \
            [out.policy_version] * len(out.completion_ids)
        call = RecordedCall(list(prompt_ids), list(out.completion_ids), list(out.logprobs), list(versions),
                            out.finish_reason, out.completion_text, out.policy_version)
        with self._lock:
            if ep.done:  # closed while this call ran
                raise _not_found()
            ep.calls.append(call)
        return call, index

    def _chat(self, ep: _Episode, body: dict[str, Any]) -> Any:
        messages = _messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list of tool definitions", "tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise ApiError(400, f"tool_choice={_show(choice)}: only 'auto' and 'none' are supported (the model is "
                                "never forced to call a tool)", "tool_choice")
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
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": self.model_name}
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
            log.warning("agent server: new messages cannot be appended token-exactly (%s); rendering the "
                        "conversation afresh", err)
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
        elif isinstance(prompt, list) and prompt and not any(isinstance(p, (str, list)) for p in prompt):
            ids, text = self._token_ids(prompt), None
        else:  # a batch of prompts too: an episode is one sequence of calls
            raise ApiError(400, "prompt must be one string or one non-empty list of token ids", "prompt")
        if not ids:
            raise ApiError(400, "prompt: it is empty once tokenized; the model needs at least one token", "prompt")
        call, index = self._sample(ep, body, ids, "prompt")
        ep.text = (text, call) if text is not None else None
        logprobs = None
        if body.get("logprobs") is not None:  # the sampled tokens' log-probs; top_logprobs are not available
            tokens = self._tokens(call)
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": call.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        choice = {"index": 0, "text": call.completion_text, "finish_reason": call.finish_reason, "logprobs": logprobs}
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if not body.get("stream"):
            return {**head, "choices": [choice], "usage": _usage(call)}
        chunks = [{**head, "choices": [choice]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": _usage(call)})
        return _sse(chunks)

    def _token_ids(self, prompt: list[Any]) -> list[int]:
        """`prompt` as token ids, 400 naming the first that is not one of the model's."""
        for i, t in enumerate(prompt):
            if not (_number(t) and isinstance(t, int) and 0 <= t < self.vocab_size):
                raise ApiError(400, f"prompt[{i}]={_show(t)}: a token id is an integer in [0, {self.vocab_size}) (the "
                                    "model's vocabulary)", f"prompt[{i}]")
        return list(prompt)

    def _tokens(self, call: RecordedCall) -> list[str]:
        return [self.tokenizer.decode([t]) for t in call.completion_ids]


def _check_fields(body: dict[str, Any], completions: bool) -> None:
    """400 for a field this server cannot honour or does not know (never silently ignored): one
    that would change what is sampled (the learner scores the run's distribution), or ask for more
    than the one completion the policy samples, unless it has its neutral value."""
    for name, value in body.items():
        check_text(name, "the body", "a field's name")
        if name not in _SERVED | _IGNORED | set(_NEUTRAL):
            raise ApiError(400, f"unsupported field {_show(name)}: this training server refuses what it cannot honour "
                                "exactly rather than ignore it; omit it", name)
        if name in _NEUTRAL and not _neutral(value, _NEUTRAL[name]):
            neutral = " or ".join(json.dumps(o) for o in _NEUTRAL[name]) or "nothing else"
            raise ApiError(400, f"{name}={_show(value)} is not supported by this training server (it samples one "
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


def _usage(call: RecordedCall) -> dict[str, int]:
    n, m = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _sse(chunks: list[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: the whole answer in one content chunk, then the end, then [DONE]."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
