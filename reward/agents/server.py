"""An OpenAI-compatible endpoint in front of the rollout fleet, recording token-exact episodes
(docs/architecture.md "Agents"): the HTTP app, its episodes and its routes.

Any agent written with the plain `openai` client becomes an environment: each episode gets its own
base URL (`http://HOST:PORT/episodes/{key}/v1`), and every call made there is recorded as a
`RecordedCall` (exact prompt ids, sampled ids, log-probs, policy versions) that
`rl.data.agent_calls.episode_sample` turns into one training Sample. A call is parsed and checked
by `requests`, its prompt built token-exactly by `chat`, sampled here, and answered by `answers`.

Calls of one episode are served one at a time (an episode is one trajectory); episodes run
concurrently, each call in a worker thread that blocks on `generate` (the fleet). An episode ends
when its agent returns: a call still in flight then is not recorded (issue 58).

Agents are untrusted code. An episode's key is a secret (`secrets`): the base URL is the only
way into the episode, and a key that is unknown, closed or malformed gets the same 404, so no
agent can reach or probe another's episode. What the policy samples is the run's (`requests`
refuses other sampling settings). Bodies, headers, reads and connections are bounded
(`http_limits`), so a hostile or broken client costs a bounded amount of memory and time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl.data.agent_calls import RecordedCall
from rl.data.dataset import derive_seed
from rl.data.types import GenerationRequest, Sample
from reward.agents import answers, requests
from reward.agents.chat import Conversation, Prompts
from reward.agents.handoff import Handoffs
from reward.agents.http_limits import (CONNECTION, MAX_HEADER_BYTES, AnswerFaults, ApiError, Connection, ConnectionBudget,
                                       read_body)

__all__ = ["MAX_HEADER_BYTES", "AgentServer", "RequestRejected"]

log = logging.getLogger(__name__)


class RequestRejected(Exception):
    """Raised by `generate` when the engine refuses a request (bad parameters): answered as a 400,
    never a fault."""


def _not_found() -> ApiError:
    """The one answer for a key that is unknown, closed or malformed (and any other path): the
    same bytes whatever the key, so an agent learns nothing about other episodes."""
    return ApiError(404, "unknown episode: use the base_url the trainer gave this episode", code="episode_not_found")


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
    recorded_at: list[float] = field(default_factory=list)  # time.monotonic() each call was recorded
    conv: Conversation = field(default_factory=Conversation)
    done: bool = False  # ended or closed: nothing more is recorded
    waiting: int = 0  # its requests in flight or waiting their turn (at most max_pending_per_episode)
    refused: str | None = None  # its last refusal, naming the call (only the first is logged: `_refused`)


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
        self.vocab_size = len(tokenizer)
        self._prompts = Prompts(tokenizer, observation_role)
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}
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
        # sandboxed episodes' workers hand their listeners over here (reward/agents/handoff.py): the
        # server accepts inside each episode's network, no relay between
        self._uds_dir = tempfile.mkdtemp(prefix="rlpost-agent-server-")
        os.chmod(self._uds_dir, 0o755)
        self._handoffs = Handoffs(os.path.join(self._uds_dir, "listeners.sock"), self._serve_listener)
        self.handoff_path = self._handoffs.path
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
        self._loop = self._server.servers[0].get_loop()
        self._on_loop(self._handoffs.start, self._loop)
        return self.url

    def _on_loop(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 10.0) -> Any:
        """`fn(*args)` on the server's event loop; its result."""
        async def call() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout_s)

    async def _serve_listener(self, listener: socket.socket, source: Any) -> asyncio.AbstractServer:
        """Serve the app on an episode's listener (handed over: reward/agents/handoff.py), as uvicorn
        serves its own sockets, its connections counted as `source`'s."""
        server = self._server

        def connection(_loop: asyncio.AbstractEventLoop | None = None) -> Connection:
            return server.config.http_protocol_class(config=server.config, server_state=server.server_state,
                                                     app_state=server.lifespan.state, _loop=_loop, source=source)
        return await asyncio.get_running_loop().create_server(connection, sock=listener,
                                                              backlog=server.config.backlog)

    def listening(self) -> int:
        """Episodes' listeners served now (each closed when its worker goes)."""
        return self._on_loop(self._handoffs.listening)

    def stop(self) -> None:
        """Stop serving (calls in flight get a few seconds to finish); idempotent."""
        if self._server is not None:
            if self._thread is not None and self._thread.is_alive():
                with suppress(Exception):  # (a loop already gone: its listeners went with it)
                    self._on_loop(self._handoffs.close)
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self._socket is not None:
            self._socket.close()
            shutil.rmtree(self._uds_dir, ignore_errors=True)
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
        if temperature is not None and not (requests.is_number(temperature) and math.isfinite(temperature)
                                            and temperature >= 0):
            raise ValueError(f"episode temperature must be a finite number >= 0, got {temperature!r}")
        key = secrets.token_urlsafe(24)
        with self._lock:
            self._episodes[key] = _Episode(int(seed_base), dict(metadata or {}),
                                           self.temperature if temperature is None else float(temperature))
        return key, f"{self.url}/episodes/{key}/v1"

    def end_episode(self, key: str, at: float | None = None) -> None:
        """The agent returned, died or was killed: the episode is over (issue 58). Its calls from now
        on are refused (404), a call in flight is answered 404 and not recorded, and a call recorded
        at or after `at` is dropped: `at` is when the agent returned, `time.monotonic()` in its own
        process (one clock for the whole host), since the pool learns of it later; None: now. What
        is left is what `close_episode` returns. Unknown key: nothing (issue 47)."""
        now = time.monotonic()
        at = now if at is None else min(at, now)
        with self._lock:
            ep = self._episodes.get(key)
            if ep is None:
                return
            ep.done, kept = True, len(ep.calls)
            while kept and ep.recorded_at[kept - 1] >= at:  # recorded in order: the late ones are last
                kept -= 1
            dropped = len(ep.calls) - kept
            del ep.calls[kept:], ep.recorded_at[kept:]
        if dropped:
            log.debug("agent server: an episode (seed_base %d) dropped %d calls that finished after its agent "
                      "returned", ep.seed_base, dropped)

    def close_episode(self, key: str) -> list[RecordedCall]:
        """Ends the episode at once (as `end_episode` with no time) and returns its calls, those
        recorded before its end; never waits for a call in flight (that call's result is not
        recorded, and it answers 404). Unknown key: KeyError."""
        with self._lock:
            ep = self._episodes.pop(key)
            ep.done = True
            return list(ep.calls)

    def refusal(self, key: str) -> str | None:
        """The episode's last refusal, if any ("the agent server refused call 3: 413 the request
        body ..."): the runner names it in the sample's error, since the agent may have seen only
        what its client made of it."""
        with self._lock:
            ep = self._episodes.get(key)
            return None if ep is None else ep.refused

    def open_count(self) -> int:
        with self._lock:
            return len(self._episodes)

    def _episode(self, key: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(key)
        if ep is None:
            raise _not_found()
        return ep

    def _refuse(self, ep: _Episode, why: str, close: bool = False) -> ApiError:
        """The 429 for an episode past a cap (recorded as it is answered: `_refused`)."""
        return ApiError(429, why, code="rate_limit_exceeded", close=close)

    def _refused(self, key: Any, err: ApiError) -> None:
        """A 4xx answered to a live episode (`key`) is its last refusal; its first is logged."""
        with self._lock:
            ep = self._episodes.get(key) if isinstance(key, str) and 400 <= err.status < 500 \
                and err.status != 404 else None
            if ep is None:
                return
            first, call = ep.refused is None, len(ep.calls) + 1
            ep.refused = f"the agent server refused call {call}: {err.status} {err.message}"
        if first:
            log.warning("agent server: an episode (seed_base %d) was refused call %d: %d %s; its further refusals "
                        "are not logged", ep.seed_base, call, err.status, err.message)

    # ---- HTTP -----------------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="rlpost agent server", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(AnswerFaults)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, err: ApiError) -> JSONResponse:
            self._refused(request.path_params.get("key"), err)
            return err.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
            if err.status_code == 404:  # any other path: the same answer as a wrong key
                return _not_found().response()
            return ApiError(err.status_code, str(err.detail)).response()

        async def run(completions: bool, key: str, request: Request) -> Response:
            ep = self._episode(key)
            if not self._connections.claim(CONNECTION.get(), key):
                raise self._refuse(ep, f"had over {self._connections.per_episode} connections open at once",
                                   close=True)  # body unread
            if self._limiter is None:  # made on the server's event loop
                self._limiter = anyio.CapacityLimiter(self.max_concurrent_calls)
            if ep.waiting >= self.max_pending_per_episode:
                raise self._refuse(ep, f"had over {self.max_pending_per_episode} requests in flight at once",
                                   close=True)  # body unread
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

    # ---- one call (a worker thread) -------------------------------------------------------------

    def _call(self, completions: bool, ep: _Episode, raw: bytes) -> answers.Answer:
        body = requests.parse_body(raw, completions, ep.temperature, self.top_p)
        if ep.done:
            raise _not_found()
        if len(ep.calls) >= self.max_calls:
            raise self._refuse(ep, f"made over task.agent_max_calls={self.max_calls} calls")
        return self._completion(ep, body) if completions else self._chat(ep, body)

    def _chat(self, ep: _Episode, body: dict[str, Any]) -> answers.Answer:
        messages = requests.messages(body.get("messages"))
        tools, use_tools = requests.tools(body)
        prompt = self._prompts.chat(ep.conv, messages, tools, ep.calls[-1] if ep.calls else None)
        call, index = self._sample(ep, body, prompt, "messages")
        content, tool_calls = self._prompts.reply(ep.conv, messages, tools, use_tools, call, index)
        return answers.chat(call, content, tool_calls, body, self.model_name, self._prompts.tokens)

    def _completion(self, ep: _Episode, body: dict[str, Any]) -> answers.Answer:
        prompt = requests.prompt(body, self.vocab_size)
        ids = self._prompts.text(ep.conv, prompt, ep.calls[-1] if ep.calls else None) if isinstance(prompt, str) \
            else prompt
        if not ids:
            raise ApiError(400, "prompt: it is empty once tokenized; the model needs at least one token", "prompt")
        call, _ = self._sample(ep, body, ids, "prompt")
        ep.conv.text = (prompt, call) if isinstance(prompt, str) else None
        return answers.text(call, body, self.model_name, self._prompts.tokens)

    def _sample(self, ep: _Episode, body: dict[str, Any], prompt_ids: list[int],
                param: str) -> tuple[RecordedCall, int]:
        """Generate for `prompt_ids` and record the call, unless the episode ended meanwhile (then a
        404, nothing recorded); returns the call and its index in the episode."""
        max_tokens = requests.max_tokens(body, len(prompt_ids), self.max_new_tokens, self.max_model_len, param)
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
            if ep.done:  # ended while this call ran: its agent has returned
                raise _not_found()
            ep.calls.append(call)
            ep.recorded_at.append(time.monotonic())
        return call, index
