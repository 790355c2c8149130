"""What keeps the agent server's HTTP up under clients that are broken or hostile (the agents are
user code): OpenAI-format errors, a 500 that leaves its keep-alive connection usable, deadlines for
a request's headers and body (uvicorn has none), and limits on body size and JSON shape, so that
a client costs a bounded amount of memory and time and never a crash."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
from collections import Counter, OrderedDict
from typing import Any

import anyio
import h11
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024  # h11's own default, made explicit: an OpenAI client sends < 1 KiB of headers
MAX_JSON_DEPTH = 64  # tool schemas nest a few levels; deeper only feeds recursion in json and the template
# A refused request's body still coming is read and discarded up to this much (`Connection`), so
# that its client reads the answer (closing over unread bytes resets the connection)
LINGER_BYTES = 64 << 20
BODY_LIMIT = "max(1 MiB, 64 bytes x rollout.max_model_len)"  # the server's default (AgentServer)


def size_text(n: int) -> str:
    """Bytes as people read them: 512 B, 1 MiB, 2.1 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}.
    `close`: the request was not read to its end, so the connection cannot carry another."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.close = status, message, param, code, close

    def response(self) -> JSONResponse:
        kind = "not_found_error" if self.status == 404 else "server_error" if self.status >= 500 \
            else "invalid_request_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers={"connection": "close"} if self.close else None)


def check_values(value: Any, path: str) -> None:
    """400 for a string with a lone surrogate (no tokenizer takes it), a non-finite number, or
    nesting deeper than MAX_JSON_DEPTH, anywhere in `value`; the message names where."""
    stack = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", where)
        if isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ApiError(400, f"{where}={item}: NaN and infinities are not numbers this server takes", where)
        elif isinstance(item, dict):
            for key, sub in item.items():
                check_text(key, where or "the body", "a key")
                stack.append((sub, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            stack += [(sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item)]


def check_text(text: str, param: str, what: str = "the string") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param}: {what} is not valid Unicode (it has a lone surrogate such as \\ud800)",
                       param) from None


def loads(text: str | bytes, param: str | None) -> Any:
    """JSON as Python, 400 when it is not JSON (nesting that overflows the parser included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and bad UTF-8 are ValueErrors
        what = f"{param} is" if param else "the request body is"
        detail = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ApiError(400, f"{what} not JSON ({detail})", param) from None


class AnswerFaults:
    """ASGI middleware: an unexpected exception becomes an OpenAI-format 500 that leaves the
    connection usable. Starlette's ServerErrorMiddleware answers such an exception and then raises
    it again (for the server's log); uvicorn then closes the connection under a response that did
    not say `connection: close`, and the client's next request on that keep-alive connection is
    reset. Nothing is raised again here (a response already begun cannot be answered: that one
    still goes up, and uvicorn rightly drops the connection)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # nobody to answer
            return
        except Exception as err:
            if started:
                raise
            route = getattr(scope.get("route"), "path", "?")  # the pattern: the path would hold the key
            log.error("agent server: %s %s: %s", scope.get("method"), route, type(err).__name__, exc_info=err)
            await ApiError(500, f"internal error ({type(err).__name__}); the trainer's log has the details",
                           code="internal_error").response()(scope, receive, send)


CONNECTION: contextvars.ContextVar[Connection | None] = contextvars.ContextVar("agent_server_connection",
                                                                             default=None)


class ConnectionBudget:
    """Who holds the server's connections, so one agent's flood cannot deny the others (issue 47).

    A connection is *unclaimed* until a request names a live episode (keyless, or only wrong keys
    so far): at most `max_unclaimed` are kept, and past that the oldest idle one *of the source
    holding the most* is closed (a source: the episode whose listener it came on, handed over by its
    worker (reward/agents/handoff.py), else the client's host). A flood of connections that send
    nothing thus evicts itself: a flood that cycles its connections would otherwise make a
    well-behaved client's brand-new connection, whose request is still on its way, the oldest idle
    one (issue 58: CI saw an honest call cut so). A request to a live episode
    claims its connection for that episode; an episode may hold `per_episode` connections, and a
    request past that is refused (the app answers 429 and closes it). Called on the server's event
    loop only (connections open, close and requests start there): no lock."""

    def __init__(self, max_unclaimed: int = 256, per_episode: int = 8):
        self.max_unclaimed, self.per_episode = max_unclaimed, per_episode
        self._unclaimed: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._by_source: dict[Any, OrderedDict[Connection, None]] = {}  # the same, per source
        self._owner: dict[Connection, str] = {}
        self._held: Counter[str] = Counter()
        self.evicted = 0

    def opened(self, conn: Connection) -> None:
        self._unclaimed[conn] = None
        self._by_source.setdefault(conn.source, OrderedDict())[conn] = None
        if len(self._unclaimed) > self.max_unclaimed:
            victim = self._victim(conn)
            if victim is not None:
                if self.evicted == 0:
                    log.warning("agent server: over %d connections sent no request to a live episode; the oldest "
                                "idle ones of the source holding the most are closed (logged once)",
                                self.max_unclaimed)
                self.evicted += 1
                self._unclaim(victim)
                victim.close_idle()

    def _victim(self, new: Connection) -> Connection | None:
        """The oldest idle unclaimed connection of the source holding the most (not `new`)."""
        for source in sorted(self._by_source, key=lambda k: len(self._by_source[k]), reverse=True):
            victim = next((c for c in self._by_source[source] if c is not new and c.idle()), None)
            if victim is not None:
                return victim
        return None

    def _unclaim(self, conn: Connection) -> None:
        self._unclaimed.pop(conn, None)
        mine = self._by_source.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._by_source[conn.source]

    def closed(self, conn: Connection) -> None:
        self._unclaim(conn)
        self._release(conn)

    def claim(self, conn: Connection | None, key: str) -> bool:
        """The connection `conn` (the request's: `CONNECTION.get()`) now serves episode `key`; False
        if that episode already holds `per_episode` others (the caller refuses the request and closes
        the connection). (By connection, not client address: episodes' listeners are in networks of
        their own, where every client is 127.0.0.1 and ports repeat.)"""
        if conn is None or self._owner.get(conn) == key:
            return True  # (a client not served through `Connection`, e.g. an in-process test client)
        self._release(conn)
        self._unclaim(conn)
        if self._held[key] >= self.per_episode:
            return False
        self._owner[conn] = key
        self._held[key] += 1
        return True

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def _release(self, conn: Connection) -> None:
        key = self._owner.pop(conn, None)
        if key is not None:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]


class Connection(H11Protocol):
    """uvicorn's h11 connection with a deadline for a request's headers, counted in a
    `ConnectionBudget` (which may close it while it is idle), that closes after a refusal without
    resetting.

    uvicorn closes a connection left idle `timeout_keep_alive` after a response, but arms nothing
    when a connection opens, and cancels that timer at the first byte: a client that connects and
    stays silent, or sends half a request line, would hold its connection (and a place under
    `limit_concurrency`) forever. Here a new connection is idle like one after a response, and one
    whose next request's headers have not come `headers_timeout_s` after it opened or after the
    last response is closed. (The body's deadline is the app's: `read_body`.)

    A refusal answered before its request's body was read (a 413, a 429 at the door, a 408) says
    `connection: close`. Closing a socket whose received bytes are unread makes the kernel send a
    reset, not a FIN, and a reset throws away what the peer had not read yet: an `openai` client
    (which sends its whole body before it reads) then saw `APIConnectionError: Connection error.`
    instead of the answer, always through an episode's relay (reward/agents/relay.py, which drops
    both sides when its write to the server fails), sometimes even directly (issue 59). So such a
    connection lingers, as Apache's does: the answer is sent, then a FIN (`write_eof`), and what
    still comes of the body is read and discarded (never held) until the client closes, up to
    `linger_bytes` and `headers_timeout_s`; only past those is it closed over unread bytes."""

    def __init__(self, *args: Any, headers_timeout_s: float, budget: ConnectionBudget | None = None,
                 linger_bytes: int = LINGER_BYTES, source: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.source = source  # who opened it (None: told by its address, at connection_made)
        self._headers_timeout_s = headers_timeout_s
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._budget = budget
        self._linger_bytes, self._lingering, self._discarded = linger_bytes, False, 0
        self._linger_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        if self.source is None:
            self.source = ("host", self.client[0] if self.client else None)
        self.transport = _Lingering(transport, self)  # what uvicorn (and each request's cycle) closes
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._await_headers()
        if self._budget is not None:
            self._budget.opened(self)

    def idle(self) -> bool:
        """No request under way (none yet, or the last one answered)."""
        return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)

    def close_idle(self) -> None:
        self.timeout_keep_alive_handler()  # as uvicorn closes an idle connection

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            CONNECTION.set(self)  # a request's task, made in here, copies it: `ConnectionBudget.claim`
            super().data_received(data)
            return
        self._discarded += len(data)  # the rest of a refused body: counted, never kept
        if self._discarded > self._linger_bytes:
            self._raw.close()

    def close_transport(self) -> None:
        """Close, lingering first if the client is still sending a request's body."""
        if self._lingering or self._raw.is_closing():
            return
        if self.conn.their_state is not h11.SEND_BODY or not self._raw.can_write_eof():
            self._raw.close()
            return
        self._lingering = True
        self._raw.write_eof()  # a FIN once the answer is written; the client's EOF then closes it
        self._raw.resume_reading()
        self._linger_deadline = self.loop.call_later(self._headers_timeout_s, self._raw.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for timer in (self._headers_deadline, self._linger_deadline):
            if timer is not None:
                timer.cancel()
        if self._budget is not None:
            self._budget.closed(self)

    def _await_headers(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
        self._headers_deadline = self.loop.call_later(self._headers_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        if self.cycle is None or self.cycle.response_complete:  # no request came in time
            self.timeout_keep_alive_handler()  # closes the connection as uvicorn closes an idle one


class _Lingering:
    """A connection's transport as uvicorn sees it: the same, except that `close` lingers
    (`Connection.close_transport`) and a lingering one is closing."""

    def __init__(self, transport: asyncio.Transport, conn: Connection):
        self._transport, self._conn = transport, conn

    def close(self) -> None:
        self._conn.close_transport()

    def is_closing(self) -> bool:
        return self._conn._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def read_body(request: Request, max_bytes: int, timeout_s: float, limit: str = BODY_LIMIT) -> bytes:
        """The body, refused (413) past `max_bytes` as soon as that is known (a Content-Length
        over it: before reading anything), and (408) when it has not all come `timeout_s` after
        reading began. Either way the connection closes after the answer, the rest of the body
        read and discarded (`Connection`) so the client reads the answer. `limit`: where
        `max_bytes` comes from, named in the 413."""
        def too_large(size: str) -> ApiError:
            return ApiError(413, f"the request body ({size}) is over this server's limit of {size_text(max_bytes)} "
                                 f"({max_bytes} bytes: {limit}); send less, e.g. cut long observations",
                            code="request_too_large", close=True)
        length = request.headers.get("content-length")
        if length is not None and int(length) > max_bytes:  # (h11 has checked it is digits)
            raise too_large(size_text(int(length)))
        chunks, size = [], 0
        try:
            with anyio.fail_after(timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_bytes:
                        raise too_large(f"over {size_text(max_bytes)}, sent in chunks")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout_s} s", code="timeout",
                           close=True) from None
        return b"".join(chunks)
