"""Byte relays between an episode's private network and the endpoints it may reach.

An episode's network namespace has only its own loopback. Its worker listens there on each
endpoint's address (`127.0.0.1:port`: the agent server, and the task's named servers). The agent
server's listener is handed to the server itself (`hand_over`; reward/agents/handoff.py), which
accepts there: no relay on the calls' path. Every connection to another endpoint is relayed to a
Unix socket of the pool, which relays it to the endpoint's real TCP address on the host. Path-based Unix sockets cross network namespaces, so nothing else on the
host (Ray, other services, other addresses) is reachable from an episode. Standard library only:
the worker side runs in the zygote's interpreter.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
from contextlib import suppress
from typing import Callable

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
EPISODE_CONNECTIONS = 64  # open at once per episode (its worker's relay): past it the oldest is closed


class Relay:
    """Pumps bytes between accepted connections and the targets they are relayed to, on the caller's
    thread (`pump`) or a thread of its own (`start`). `listeners`: (listening socket, a function that
    opens the connection to relay to, blocking, bounded by its own timeout). `max_connections`:
    open at once; past it the oldest is closed to make room (an episode flooding its endpoints
    meets its own worker's cap, so the pool's relay, shared by all episodes, has room for every
    worker's)."""

    def __init__(self, listeners: list[tuple[socket.socket, Callable[[], socket.socket]]],
                 max_connections: int = EPISODE_CONNECTIONS):
        self.max_connections = max_connections
        self.sel = selectors.DefaultSelector()
        self._links: dict[socket.socket, socket.socket] = {}
        self._pending: dict[socket.socket, bytearray] = {}
        self._eof: dict[socket.socket, bool] = {}
        self._accepted: dict[socket.socket, None] = {}  # accepted connections, oldest first
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        for listener, connect in listeners:
            listener.setblocking(False)
            self.sel.register(listener, selectors.EVENT_READ, ("accept", connect))
        self._thread: threading.Thread | None = None

    def start(self, name: str) -> Relay:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(2.0)
        if self._thread is None or not self._thread.is_alive():
            for s in list(self._links):
                self._drop(s)
            for key in list(self.sel.get_map().values()):
                if isinstance(key.fileobj, socket.socket):
                    key.fileobj.close()
            self.sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        while not self._closed:
            try:
                self.pump(None)
            except Exception:  # noqa: BLE001 - a relay bug costs connections, never the pool
                log.exception("relay failed; going on")

    def pump(self, timeout: float | None) -> list:
        """One round: accept, read and write what is ready. Returns the events that are not the
        relay's (the caller's own fds registered on `sel` with data not a tuple/None)."""
        other = []
        for key, _ in self.sel.select(timeout):
            data = key.data
            if key.fileobj == self._wake_r:
                with suppress(OSError):
                    os.read(self._wake_r, 64)
            elif isinstance(data, tuple) and data[0] == "accept":
                self._accept(key.fileobj, data[1])
            elif isinstance(data, tuple) and data[0] == "link":
                self._forward(key.fileobj)
            else:
                other.append(key)
        return other

    def _accept(self, listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        while len(self._links) >= 2 * self.max_connections and self._accepted:  # the oldest makes room
            oldest = next(iter(self._accepted))
            self._drop(oldest)
        try:
            target = connect()
        except OSError:
            conn.close()
            return
        for a, b in ((conn, target), (target, conn)):
            a.setblocking(False)
            if a.family in (socket.AF_INET, socket.AF_INET6):
                # each chunk goes on as it came: with Nagle, a response written while the peer's
                # delayed ACK of the last one is due waits for it (~15 ms a call; the servers we
                # relay set TCP_NODELAY themselves, as asyncio and httpx do)
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._links[a] = b
            self._pending[a] = bytearray()  # what is still to be written to `a`
            self._eof[a] = False            # `a` sent its last byte
        self._accepted[conn] = None
        for a in (conn, target):
            self._watch(a)

    def _watch(self, s: socket.socket) -> None:
        """Read from `s` while its peer has nothing pending (so a peer that stops reading holds back
        only its own connection, never the relay); write to `s` while it has something pending."""
        peer = self._links.get(s)
        if peer is None:
            return
        events = (0 if self._eof[s] or self._pending[peer] else selectors.EVENT_READ) | \
                 (selectors.EVENT_WRITE if self._pending[s] else 0)
        self._unwatch(s)
        if events:
            self.sel.register(s, events, ("link",))

    def _forward(self, s: socket.socket) -> None:
        peer = self._links.get(s)
        if peer is None:
            return
        if self._pending[s]:  # writable: flush what waits for it
            try:
                sent = s.send(self._pending[s])
                del self._pending[s][:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(s)
                return
            if not self._pending[s] and self._eof[peer]:
                with suppress(OSError):
                    s.shutdown(socket.SHUT_WR)
        elif not self._eof[s]:
            try:
                data = s.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if data:
                self._pending[peer] += data
            else:  # half-closed: the other way may still carry the reply
                self._eof[s] = True
                if not self._pending[peer]:
                    with suppress(OSError):
                        peer.shutdown(socket.SHUT_WR)
        if self._eof[s] and self._eof[peer] and not self._pending[s] and not self._pending[peer]:
            self._drop(s)  # both ways ended
            return
        self._watch(s)
        self._watch(peer)

    def _unwatch(self, s: socket.socket) -> None:
        with suppress(KeyError, ValueError):
            self.sel.unregister(s)

    def _drop(self, s: socket.socket) -> None:
        for x in (s, self._links.get(s)):
            if x is None:
                continue
            self._links.pop(x, None)
            self._pending.pop(x, None)
            self._eof.pop(x, None)
            self._accepted.pop(x, None)
            self._unwatch(x)
            x.close()


def unix_connector(path: str, timeout_s: float = 10.0) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return s
    return connect


def tcp_connector(host: str, port: int, timeout_s: float = 10.0) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        return socket.create_connection((host, port), timeout=timeout_s)
    return connect


def hand_over(path: str, listener: socket.socket, timeout_s: float = 10.0) -> socket.socket:
    """Give `listener` to the server taking listeners at the Unix socket `path` (the agent server:
    reward/agents/handoff.py), which then accepts on it itself; returns the connection to keep
    open while the listener is to be served (closing it, or exiting, ends that)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        socket.send_fds(s, [b"L"], [listener.fileno()])
    except OSError:
        s.close()
        raise
    return s


def tcp_listener(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


def unix_listener(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o666)  # the episodes' host uids connect to it
    s.listen(128)
    return s
