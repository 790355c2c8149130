"""Agent code that misbehaves on purpose (tests/test_hostile_agents.py, tests/test_calculator.py):
`act(base_url, row, ...)` does what `row["case"]` names. Behaviour cases crash, hang, flood or
return a bad reward; request cases send the agent server one hostile request, note the answer in
`out_dir/<case>.json`, then make one ordinary call (unless the request was served: then it was
the episode's call) and return 1.0: the bad request must cost the episode nothing (a 4xx, never a
broken worker or a poisoned connection)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

_CURRENT: dict[str, Any] = {}  # this process's episode URL: a module global, as a careless agent keeps one
GOOD = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4}
FORK_BOMB_CAP = 400  # forks the bomb stops at by itself (about), so that a pool without a limit cannot hurt the host


def _call(client: httpx.Client, base_url: str, body: dict[str, Any] | bytes, path: str = "/chat/completions",
          headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return client.post(base_url + path, content=content, headers={"content-type": "application/json",
                                                                   **(headers or {})})


def _note(out_dir: str | None, case: str, **facts: Any) -> None:
    if out_dir:
        with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
            json.dump(facts, f)


def _error(response: httpx.Response) -> dict[str, Any]:
    try:
        return response.json().get("error") or {}
    except ValueError:
        return {}


def _other_key(base_url: str, change: str) -> str:
    """The base URL of an episode whose key differs from this one's (never a valid one)."""
    head, _, rest = base_url.partition("/episodes/")
    key, _, tail = rest.partition("/")
    if change == "flip":
        key = key[:-1] + ("A" if key[-1] != "A" else "B")
    elif change == "counter":  # what the server's old counter keys looked like
        key = "g0-s1-2"
    return f"{head}/episodes/{key}/{tail}"


def _request_case(case: str, base_url: str, client: httpx.Client, closed_url: str | None,
                  vocab: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Send the hostile request of `case`; returns (status, error body, extra facts)."""
    extra: dict[str, Any] = {}
    if case in ("wrong_key", "neighbour_key"):
        r = _call(client, _other_key(base_url, "flip" if case == "wrong_key" else "counter"), GOOD)
        extra["body"] = r.text
    elif case == "closed_key":
        r = _call(client, closed_url, GOOD)
        extra["body"] = r.text
    elif case == "models_closed_key":
        r = client.get(closed_url + "/models")
        extra["body"] = r.text
    elif case.startswith("temperature_"):
        value = {"nan": float("nan"), "inf": float("inf"), "3": 3.0, "0": 0.0}[case.removeprefix("temperature_")]
        r = _call(client, base_url, {**GOOD, "temperature": value})
    elif case == "top_k":
        r = _call(client, base_url, {**GOOD, "top_k": 5})
    elif case in ("token_id_negative", "token_id_huge"):
        bad = -5 if case == "token_id_negative" else 10**9
        r = _call(client, base_url, {"model": "policy", "prompt": [1, bad, 2], "max_tokens": 4}, "/completions")
    elif case == "max_tokens_huge":
        r = _call(client, base_url, {**GOOD, "max_tokens": 10**6})
        extra["completion_tokens"] = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
    elif case == "body_30mb":
        started = time.monotonic()
        r = _call(client, base_url, b'{"messages": "' + b"x" * (30 << 20) + b'"}')
        extra["seconds"] = time.monotonic() - started
    elif case == "deep_json":
        r = _call(client, base_url, b"[" * 100_000 + b"]" * 100_000)
    elif case == "lone_surrogate":
        r = _call(client, base_url, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    elif case == "idle_connections":
        host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
        idle = [socket.create_connection((host, port), timeout=5) for _ in range(300)]
        try:
            r = _call(client, base_url, GOOD)  # served beside them
        finally:
            for s in idle:
                s.close()
    elif case == "stream_true":
        r = _call(client, base_url, {**GOOD, "stream": True})
        extra["events"] = r.text.count("data: ")
    else:
        raise ValueError(f"unknown case {case!r}")
    return r.status_code, _error(r), extra


def act(base_url: str, row: dict[str, Any], out_dir: str | None = None, closed_url: str | None = None,
        vocab: int = 0, **_: Any) -> Any:
    case = row.get("case", "good")
    client = httpx.Client(timeout=60.0)
    _CURRENT["url"] = base_url
    if case == "leaky_thread" and "thread" not in _CURRENT:  # one per process, posting to the current URL
        def post_forever() -> None:
            with httpx.Client(timeout=60.0) as c:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        _call(c, _CURRENT["url"], GOOD)
                    time.sleep(0.02)
        _CURRENT["thread"] = threading.Thread(target=post_forever, daemon=True)
        _CURRENT["thread"].start()
    if case == "connection_flood":  # 1,000 connections opened and held, sending nothing (issue 47)
        where, held = urlsplit(base_url), []
        with contextlib.suppress(OSError):  # (past this process's open-file limit: as many as it gets)
            for _ in range(1000):
                held.append(socket.create_connection((where.hostname, where.port), timeout=5))
        time.sleep(3.0)  # while the other episodes run
        for sock in held:
            sock.close()
        return None
    if case == "raise_before_call":
        raise RuntimeError("the agent gave up before calling")
    if case == "never_call":
        return 1.0
    if case == "sys_exit":
        sys.exit(3)
    if case == "segfault":
        ctypes.string_at(0)
    if case == "busy_loop":
        while True:
            pass
    if case == "fork_bomb":  # every process forks while it can; each fork adds a byte to the count
        count = os.path.join(out_dir or ".", "fork_bomb.count")
        while True:
            made = os.path.getsize(count) if os.path.exists(count) else 0
            try:
                if made < FORK_BOMB_CAP and os.fork() > 0:
                    with open(count, "ab") as f:
                        f.write(b"x")
                    continue
            except OSError:  # refused: the pids limit holds
                pass
            time.sleep(0.01)
    if case == "huge_return":
        _call(client, base_url, GOOD)
        return "x" * (100 << 20)
    if case == "print_flood":
        chunk = "y" * (1 << 20)
        for _ in range(100):
            sys.stdout.write(chunk)
        sys.stdout.flush()
    elif case == "call_then_hang":
        _call(client, base_url, GOOD)
        time.sleep(10_000)
    elif case.startswith("reward_"):
        _call(client, base_url, GOOD)
        return {"reward_nan": float("nan"), "reward_inf": float("inf"), "reward_str": "high", "reward_true": True,
                "reward_huge": 1e30, "reward_neg_huge": -1e30}[case]
    elif case != "good" and case != "leaky_thread":
        status, error, extra = _request_case(case, base_url, client, closed_url, vocab)
        _note(out_dir, case, status=status, param=error.get("param"), code=error.get("code"), **extra)
        if status == 200:  # it was the episode's call (recorded): nothing more to ask
            return 1.0
    response = _call(client, base_url, GOOD)  # the episode goes on: an ordinary call
    response.raise_for_status()
    return 1.0
