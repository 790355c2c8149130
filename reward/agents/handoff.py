"""Listening sockets handed to the agent server by episodes' workers, so the server accepts inside
each episode's private network and no process relays its calls.

A sandboxed episode has a network namespace of its own (reward/agents/jail.py): its loopback is
all it can reach. Its worker opens a TCP listener there on the agent server's address and hands
it over a Unix socket of the server (`relay.hand_over`, SCM_RIGHTS); the server's event loop then
serves HTTP on it like on its own port, and the episode's `openai` client talks to the server's
connection directly. Each call used to cross a relay in the worker (two extra socket hops and a
wake-up of the worker per request and per response: +1.7 ms a call and +7 ms an episode's first
one on an idle host, and much more when the host is busy). A socket keeps the namespace it was
made in, so accepting needs no privilege and nothing else of the episode's network is reachable.

The worker keeps its handover connection open for its episode's life; when it closes (the worker
exited: its episode ended or was killed), the server stops listening there. Connections accepted
there count as that episode's in the server's connection budget (`http_limits.ConnectionBudget`).
Only workers reach this socket: its folder is hidden from episodes (jail.enter_episode's `cover`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from contextlib import suppress
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_LISTENERS = 4  # per handover connection (an episode reaches the server at one address)
_ids = itertools.count()


class Handoffs:
    """Takes listeners on `path` and serves each with `serve(listener, source)` (a coroutine making
    an asyncio server), on the event loop it is started on; closes them when their worker goes."""

    def __init__(self, path: str, serve: Callable[[socket.socket, Any], Any]):
        self.path, self._serve = path, serve
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o666)  # the workers' host uids connect to it
        self._sock.listen(128)
        self._sock.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[socket.socket, tuple[Any, list[asyncio.AbstractServer]]] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin accepting (call on `loop`'s thread)."""
        self._loop = loop
        loop.add_reader(self._sock, self._accept)

    def close(self) -> None:
        """Stop accepting and close every listener (call on the loop's thread)."""
        if self._loop is not None:
            self._loop.remove_reader(self._sock)
            for conn in list(self._conns):
                self._drop(conn)
        self._sock.close()

    def listening(self) -> int:
        return sum(len(servers) for _, servers in self._conns.values())

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of fds: the worker's listener is never served, its episode fails
            log.warning("agent server: could not take an episode's listener: %s", exc)
            return
        conn.setblocking(False)
        self._conns[conn] = (("episode", next(_ids)), [])
        self._loop.add_reader(conn, self._receive, conn)

    def _receive(self, conn: socket.socket) -> None:
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 16, MAX_LISTENERS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg, fds = b"", []
        source, servers = self._conns[conn]
        for fd in fds:
            listener = socket.socket(fileno=fd)
            if listener.type != socket.SOCK_STREAM or listener.family not in (socket.AF_INET, socket.AF_INET6) \
                    or len(servers) >= MAX_LISTENERS:
                listener.close()
                continue
            task = self._loop.create_task(self._serve(listener, source))
            task.add_done_callback(lambda t, servers=servers, conn=conn, listener=listener:
                                   self._served(t, servers, conn, listener))
        if not msg:  # the worker is gone: its episode is over
            self._drop(conn)

    def _served(self, task: asyncio.Task, servers: list, conn: socket.socket, listener: socket.socket) -> None:
        if task.cancelled() or task.exception() is not None:  # its episode's calls find no server: its deadline
            log.warning("agent server: serving an episode's listener failed: %r",
                        None if task.cancelled() else task.exception())
            listener.close()  # (it holds the episode's network namespace)
            return
        servers.append(task.result())
        if conn not in self._conns:  # its worker went meanwhile
            task.result().close()

    def _drop(self, conn: socket.socket) -> None:
        _, servers = self._conns.pop(conn)
        self._loop.remove_reader(conn)
        for server in servers:
            server.close()  # stops listening; the episode's own connections end with its processes
        with suppress(OSError):
            conn.close()
