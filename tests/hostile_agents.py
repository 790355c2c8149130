"""Agent code that misbehaves on purpose (tests/test_hostile_agents.py, tests/test_calculator.py):
`act(base_url, row, ...)` does what `row["case"]` names. Behaviour cases crash, hang, flood or
return a bad reward; request cases send the agent server one hostile request, note the answer
(POSTed to `notes_url`, the test's note taker: an episode writes no host file), then make one
ordinary call (unless the request was served: then it was the episode's call) and return 1.0:
the bad request must cost the episode nothing (a 4xx, never a broken worker or a poisoned
connection). Escape cases (issue 58) try to reach outside their sandbox (other episodes' files,
memory, sockets and processes, the driver, the run directory, the cgroups), note what they found,
and then behave: none of it may work."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
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


def _note(notes_url: str | None, case: str, **facts: Any) -> None:
    if notes_url:
        httpx.post(f"{notes_url}/{case}", json=facts, timeout=10.0).raise_for_status()


def _errno(call) -> Any:
    """What a call that should be refused did: its OSError's errno name, or "worked"."""
    try:
        call()
    except OSError as err:
        return type(err).__name__ if err.errno is None else __import__("errno").errorcode.get(err.errno, err.errno)
    return "worked"


_libc = ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: int) -> None:
    if _libc.syscall(number, *args) == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _escape_case(case: str, base_url: str, row: dict[str, Any], notes_url: str | None) -> None:
    """Try what `case` names from inside the sandbox; note what came of it."""
    if case == "tmp_writer":  # the answer and this episode's URL left where a later episode would look
        with open("/tmp/shared_answer.txt", "w") as f:
            f.write(f"{base_url}\n{row.get('answer', '4')}\n")
        time.sleep(1.5)  # the readers run meanwhile
        _note(notes_url, case, wrote=True)
    elif case == "tmp_reader":
        time.sleep(0.3)
        found = os.path.exists("/tmp/shared_answer.txt")
        posted = None
        if found:  # post into the writer's episode
            url = open("/tmp/shared_answer.txt").read().split()[0]
            posted = _call(httpx.Client(timeout=30), url, GOOD).status_code
        _note(notes_url, case, found=found, posted=posted, tmp=sorted(os.listdir("/tmp")))
    elif case == "proc_scan":  # other episodes' URLs in any process's memory, command line or environment
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        own = base_url.encode()
        found = 0
        for pid in pids:
            for name in ("cmdline", "environ"):
                with contextlib.suppress(OSError):
                    found += open(f"/proc/{pid}/{name}", "rb").read().replace(own, b"").count(b"/episodes/")
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
                with open(f"/proc/{pid}/mem", "rb") as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        if "rw" not in line.split()[1] or hi - lo > 64 << 20:
                            continue
                        with contextlib.suppress(OSError, ValueError, OverflowError):
                            mem.seek(lo)
                            found += mem.read(hi - lo).replace(own, b"").count(b"/episodes/")
        _note(notes_url, case, pids=pids, found=found)
    elif case == "forge_sibling":  # another episode's result socket, through pidfd_getfd
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        tried = {}
        for pid in pids + [2, 3, 100]:
            tried[pid] = _errno(lambda pid=pid: _syscall(438, os.pidfd_open(pid), 3, 0))  # pidfd_getfd
        _note(notes_url, case, pids=pids, tried={str(k): v for k, v in tried.items()})
    elif case == "kill_zygote":
        _note(notes_url, case, ppid=os.getppid(), kill_parent=_errno(lambda: os.kill(os.getppid() or 1, signal.SIGKILL))
              if os.getppid() else "no parent in sight", kill_all=_errno(lambda: os.kill(-1, signal.SIGKILL)))
    elif case == "write_run_dir":
        def append() -> None:
            with open(os.path.join(row["run_dir"], "metrics.jsonl"), "a") as f:
                f.write('{"step": 99, "reward/mean": 123456.0}\n')
        _note(notes_url, case, append=_errno(append), listed=_errno(lambda: os.listdir(row["run_dir"])))
    elif case == "leave_cgroup":
        def move() -> None:
            with open("/sys/fs/cgroup/pids/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        _note(notes_url, case, move=_errno(move), cgroup=open("/proc/self/cgroup").read()[:200])
    elif case == "signal_driver":
        _note(notes_url, case, sigint=_errno(lambda: os.kill(int(row["driver_pid"]), signal.SIGINT)))
    elif case == "ptrace_sibling":
        def attach(pid: int) -> None:
            _syscall(101, 16, pid, 0, 0)  # ptrace(PTRACE_ATTACH, pid)
        _note(notes_url, case, **{str(pid): _errno(lambda pid=pid: attach(pid)) for pid in (1, 2, int(row["driver_pid"]))})


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


class FlipFloat(float):
    """A reward that reads 1.0 twice, then 1e300: a bound checked on one read and used on another."""

    reads = 0

    def __float__(self) -> float:
        FlipFloat.reads += 1
        return 1.0 if FlipFloat.reads <= 2 else 1e300

    def __abs__(self) -> float:
        return self.__float__()


class Reduces:
    """A return value whose unpickling would run code in whoever unpickles it."""

    def __init__(self, call: Any, args: tuple) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple:
        return self.call, self.args


ESCAPES = ("tmp_writer", "tmp_reader", "proc_scan", "forge_sibling", "kill_zygote", "write_run_dir", "leave_cgroup",
           "signal_driver", "ptrace_sibling")


def act(base_url: str, row: dict[str, Any], notes_url: str | None = None, closed_url: str | None = None,
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
    if case in ESCAPES:
        _escape_case(case, base_url, row, notes_url)
    if case == "reduce_value":
        _call(client, base_url, GOOD)
        return Reduces(os.system, (f"touch {row['marker']}",))
    if case == "system_exit_value":
        _call(client, base_url, GOOD)
        return Reduces(sys.exit, (3,))
    if case == "float_subclass":
        _call(client, base_url, GOOD)
        return FlipFloat(1.0)
    if case == "call_in_flight":  # one call, then another still in flight as the agent returns
        _call(client, base_url, GOOD)
        threading.Thread(target=lambda: _call(httpx.Client(timeout=60.0), base_url, GOOD), daemon=True).start()
        time.sleep(0.005)
        return 1.0
    if case == "fork_bomb":  # every process forks while it can; each fork adds a byte to a count in
        count = "/tmp/fork_bomb.count"  # the episode's own /tmp, which the first process reports
        reporter = httpx.Client(timeout=10.0)  # made before the bomb: amid 31 busy forks (one CPU share
        if os.fork() > 0:                     # among them) building a client's SSL context took > 6 s
            time.sleep(2.0)
            reporter.post(f"{notes_url}/{case}", json={"forked": os.path.getsize(count) if os.path.exists(count)
                                                       else 0}).raise_for_status()
            time.sleep(10_000)
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
    elif case not in ("good", "leaky_thread", *ESCAPES):
        status, error, extra = _request_case(case, base_url, client, closed_url, vocab)
        _note(notes_url, case, status=status, param=error.get("param"), code=error.get("code"), **extra)
        if status == 200:  # it was the episode's call (recorded): nothing more to ask
            return 1.0
    response = _call(client, base_url, GOOD)  # the episode goes on: an ordinary call
    response.raise_for_status()
    return 1.0
