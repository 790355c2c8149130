"""The processes an agent episode runs in, below the pool (reward/agents/pool.py): the launcher, the
zygote, a worker per episode and the episode itself. Standard library only, with reward.loader and
reward.agents.jail/relay: it runs in `task.agent_python`'s interpreter too.

    driver --subprocess--> launcher --fork--> zygote (pid 1) --fork--> worker --fork--> episode (pid 1)

- The launcher (root, or the user) makes the namespaces the zygote is born in and, as root, maps
  the zygote's user namespace onto two unused host uids; then it only waits (jail.py).
- The zygote builds its root file system (only the interpreter, its packages and the agent's code,
  read-only), becomes uid 0 of its user namespace, imports the agent function once, and forks a
  worker per request, reporting each one's exit.
- A worker first says hello (the driver reads its host pid from the message's credentials, to put
  it in its cgroups); then, given an episode, it makes the episode's network, IPC, UTS and pid
  namespaces, listens on the endpoints' addresses in that network, hands the agent server's
  listener to the server (which accepts there itself: handoff.py), forks the episode, relays its
  connections to the other endpoints to the pool's Unix sockets (relay.py), and sends its result
  to the driver.
- The episode: a private /tmp, /dev/shm and /proc, uid 1, no capabilities, seccomp; it calls
  `fn(base_url, row, **kwargs)` and reads the return value once, as a plain float (or None), and
  writes it as JSON. Nothing an episode sends is ever unpickled.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import inspect
import json
import math
import os
import pickle
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
from contextlib import suppress
from typing import Any, Callable

from reward.agents import jail, relay
from reward.loader import RewardLoadError, load_agent_function
from sandbox import _linux

_ERROR_CHARS = 1000
MAX_MESSAGE = 1 << 16  # a worker's result message (JSON of a float or an error line): far less


# -- the launcher ---------------------------------------------------------------------------------
def launcher_main(ctrl_fd: int) -> None:
    """Make the zygote's namespaces, fork it, map its user namespace (as root), wait for it."""
    _die_with_parent()
    cfg = pickle.load(sys.stdin.buffer)  # from the driver (trusted): never from an episode
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    try:
        jail.launcher_namespaces(cfg["privileged"])
    except OSError as exc:
        _refuse(ctrl_fd, f"{cfg['name']}: could not make the agent sandbox's namespaces: {exc}")
        return
    up_r, up_w = os.pipe()      # zygote -> launcher
    down_r, down_w = os.pipe()  # launcher -> zygote
    pid = os.fork()
    if pid == 0:
        os.close(up_r)
        os.close(down_w)
        try:
            _zygote_main(ctrl_fd, cfg, up_w, down_r)
        finally:
            os._exit(0)
    os.close(ctrl_fd)
    os.close(up_w)
    os.close(down_r)
    with os.fdopen(up_r, "rb") as up:
        for line in up:
            kind, _, rest = line.rstrip(b"\n").partition(b" ")
            if kind == b"R":  # the zygote has pivoted: its temporary root's empty host dir goes
                with suppress(OSError):
                    os.rmdir(rest.decode())
            elif kind == b"M":
                try:
                    jail.map_user(pid, cfg["uids"], cfg["gids"])
                    os.write(down_w, b"k")
                except OSError:
                    os.write(down_w, b"n")
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _refuse(ctrl_fd: int, why: str) -> None:
    with socket.socket(fileno=ctrl_fd) as ctrl:
        ctrl.send(b"E" + why.encode()[:60000])


# -- the zygote ------------------------------------------------------------------------------------
def _zygote_main(ctrl_fd: int, cfg: dict, up_w: int, down_r: int) -> None:
    """Build the sandbox's root, become its uid 0, load the agent function once, then fork a
    worker per request and report each worker's exit, until the driver's EOF."""
    _die_with_parent()
    ctrl = socket.socket(fileno=ctrl_fd)
    field = cfg["name"]
    try:
        names = [(name, ip) for name, ip, _, _, _ in cfg["endpoints"] if name != ip]
        visible = visible_paths(cfg)
        # the sandbox shows folders at their real paths: a path through a symlink (a virtualenv
        # linked from elsewhere, a checkout under /tmp) would lead nowhere once inside
        sys.path[:] = [os.path.realpath(p) if p else p for p in sys.path]
        cfg["keep"] = [p for p in visible if p.startswith(("/tmp/", "/dev/shm/")) and p not in cfg["visible"]]  # code
        root = jail.enter_root(visible, cfg["hidden"], cfg["limits"]["tmp_mb"] << 20, names)
        os.write(up_w, b"R " + root.encode() + b"\n")
        if cfg["privileged"]:
            os.setgroups([])  # the host's supplementary groups, before they can no longer be dropped
            jail.unshare(jail.CLONE_NEWUSER)
            os.write(up_w, b"M\n")
            if os.read(down_r, 1) != b"k":
                raise OSError("the launcher could not map the sandbox's user namespace")
        jail.become_zygote_user()
        _die_with_parent()  # again: a change of credentials clears the parent-death signal
    except OSError as exc:
        ctrl.send(b"E" + f"{field}: could not build the agent sandbox: {exc}".encode())
        return
    finally:
        os.close(up_w)
        os.close(down_r)
    # home, caches and temporary files in /tmp, which is each episode's own: before the module is
    # imported, since libraries fix their cache folders at import (verifiers: ~/.cache)
    os.environ.update(HOME="/tmp", TMPDIR="/tmp", XDG_CACHE_HOME="/tmp/.cache", XDG_CONFIG_HOME="/tmp/.config",
                      XDG_DATA_HOME="/tmp/.local/share")
    sys.path.insert(0, os.path.realpath(cfg["base_dir"] or "."))
    try:
        fn = load_agent_function(cfg["spec"], cfg["base_dir"], cfg["kwargs"], field=field)
    except RewardLoadError as exc:
        ctrl.send(b"E" + str(exc).encode())
        return
    except BaseException as exc:  # noqa: BLE001 - the user's module, imported here
        ctrl.send(b"E" + f"{field}: importing it raised {type(exc).__name__}: {exc}".encode())
        return
    _become_subreaper()
    gc.freeze()  # the loaded heap: a worker's collections then never write to (and copy) its pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ctrl.send(b"ready")
    workers: set[int] = set()
    try:
        with suppress(BrokenPipeError, ConnectionResetError):  # the driver closed: end quietly
            _zygote_loop(ctrl, wake_r, wake_w, fn, cfg, workers)
    finally:
        for pid in workers:
            _kill(pid)
        _kill_children()


def visible_paths(cfg: dict) -> list[str]:
    """What the sandbox shows, read-only: this interpreter's prefixes and package directories whole;
    of every other directory on sys.path (and `code_dirs`: the checkout, the agent's base_dir and
    file), only its Python code (packages and .py files), so data, runs, checkpoints and caches
    beside the code stay out; plus `visible` (the relay's socket directory)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    out = set(prefixes) | {os.path.dirname(os.path.realpath(sys.executable))}
    for entry in [*sys.path, *cfg["code_dirs"]]:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == p or real.startswith(p + os.sep) for p in prefixes):
            continue
        if os.path.basename(real) in ("site-packages", "dist-packages"):
            out.add(real)
            continue
        out.update(code_in(real))
    for finder in sys.meta_path:  # editable installs map package names to folders anywhere
        for path in dict(getattr(finder, "MAPPING", None) or {}).values():
            out.add(os.path.realpath(path))
    for var in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"):  # an HTTP client's CA store
        if os.environ.get(var) and os.path.exists(os.environ[var]):
            out.add(os.path.realpath(os.environ[var]))
    out.update(cfg["visible"])
    return sorted(out)


def code_in(folder: str) -> list[str]:
    """A folder's Python code: its packages (folders with __init__.py) and modules."""
    out = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".py") or name.endswith(".pth") or os.path.isfile(os.path.join(path, "__init__.py")):
            out.append(os.path.realpath(path))
    return out


def _zygote_loop(ctrl: socket.socket, wake_r: int, wake_w: int, fn: Callable[..., Any], cfg: dict,
                 workers: set[int]) -> None:
    """Fork a worker per request ("F", with its socket and log pipe), report each worker's exit."""
    while True:
        ready = select.select([ctrl, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            for pid, status in _reap():
                if pid in workers:
                    workers.discard(pid)
                    ctrl.send(b"X %d %d" % (pid, status))
                    if cfg["fallback"]:
                        _kill_children(keep=workers)  # what the dead worker orphaned
        if ctrl in ready:
            msg, fds, _, _ = socket.recv_fds(ctrl, 16, 2)
            if not msg:
                return
            _flush_stdio()  # else each worker would print the zygote's buffered output again
            try:
                pid = os.fork()
            except OSError as exc:
                ctrl.send(f"E could not start a worker: fork failed: {exc}".encode())
                pid = -1
            if pid == 0:
                for f in (ctrl.detach(), wake_r, wake_w):
                    os.close(f)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _worker_main(*fds, fn, cfg)
            for f in fds:
                os.close(f)
            if pid > 0:
                workers.add(pid)
                ctrl.send(b"F %d" % pid)


# -- a worker ------------------------------------------------------------------------------------
def _worker_main(sock_fd: int, log_fd: int, fn: Callable[..., Any], cfg: dict) -> None:
    """Say hello, make the episode's sandbox ready, take one episode, run it there, relay its
    connections, send its result. Never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        faulthandler.enable()  # a crash in C leaves the Python stack in the log tail
        sock = socket.socket(fileno=sock_fd)
        sock.set_inheritable(False)
        sock.sendall(b"H")  # its credentials tell the driver this worker's host pid
        try:  # the driver put it in its cgroups (what it forks from now on is counted there): go
            go = _recv_exact(sock, 1)
        except EOFError:
            go = b""
        if go != b"G":  # the pool closed meanwhile
            code = 0
            return
        if cfg["fallback"]:
            _set_rlimits(cfg["limits"])
        reply = _run_episode(fn, cfg, sock)
        if reply is not None:
            _send_msg(sock, reply)
        code = 0
    except BaseException:  # noqa: BLE001 - our own set-up or I/O failed: say so in the log tail
        traceback.print_exc()
    finally:
        _flush_stdio()
        os._exit(code)


def _run_episode(fn: Callable[..., Any], cfg: dict, sock: socket.socket) -> bytes | None:
    """The episode's namespaces and its process, sandboxed, made while the driver sends its job
    (the worker is told to go on once in its cgroups); then the job from the driver,
    passed on; its connections relayed while it runs. Its JSON result, {"died": wait status} when
    it ended without one, or None when the driver closed before sending a job."""
    jail.episode_namespaces()
    for _, ip, _, _, _ in cfg["endpoints"]:
        jail.add_address(ip)
    listeners, handed = [], []
    for _, ip, port, path, handoff in cfg["endpoints"]:
        listener = relay.tcp_listener(ip, port)
        if handoff:  # the agent server accepts here itself; kept open while the episode runs
            handed.append(relay.hand_over(path, listener))
            listener.close()
        else:
            listeners.append((listener, relay.unix_connector(path)))
    job_r, job_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the episode keeps only its job and result pipes and its output: not the driver's socket
        for f in (result_r, job_w):
            os.close(f)
        for s in (sock, *handed, *(listener for listener, _ in listeners)):
            s.close()
        _episode_main(fn, cfg, job_r, result_w)
    for f in (job_r, result_w):
        os.close(f)
    try:
        job = _recv_msg(sock)  # pickled (base_url, row), from the driver (trusted)
    except EOFError:
        _kill(pid)
        return None
    with suppress(OSError):  # (an episode that died setting up: its exit status says so below)
        _write_all(job_w, job)
    os.close(job_w)
    pidfd = os.pidfd_open(pid)
    pump = relay.Relay(listeners)
    pump.sel.register(result_r, 1, "result")
    pump.sel.register(pidfd, 1, "exit")
    out, status, reading = bytearray(), None, True
    while reading or status is None:
        for key in pump.pump(None):
            if key.data == "result":
                chunk = os.read(result_r, MAX_MESSAGE)
                out += chunk
                if not chunk or len(out) > MAX_MESSAGE:
                    pump.sel.unregister(result_r)
                    reading = False
                    if chunk:  # a flood: the episode is ended
                        with suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        out = bytearray(json.dumps({"error": f"sent over {MAX_MESSAGE} bytes as its result"}).encode())
            elif key.data == "exit":
                status = os.waitpid(pid, 0)[1]
                pump.sel.unregister(pidfd)
    if out:
        return bytes(out)
    return json.dumps({"died": status}).encode()


def _episode_main(fn: Callable[..., Any], cfg: dict, job_r: int, result_w: int) -> None:
    """The episode process: sandboxed, it waits for its job, runs the agent and writes one JSON
    line. Never returns."""
    me = os.getpid()
    try:
        jail.enter_episode(cfg["limits"]["tmp_mb"] << 20, cfg["seccomp"], cfg["privileged"], cfg["visible"],
                           cfg["keep"])
        os.chdir("/tmp")
    except BaseException as exc:  # noqa: BLE001
        os.write(result_w, json.dumps({"error": f"could not enter its sandbox: {exc}"}).encode())
        os._exit(1)
    job = bytearray()
    while chunk := os.read(job_r, 1 << 16):
        job += chunk
    os.close(job_r)
    if not job:  # no episode came (its worker was stopped)
        os._exit(0)
    base_url, row = pickle.loads(job)  # from the driver, through its worker
    reply = episode_result(fn, base_url, row, cfg["kwargs"], cfg["reward_bound"])
    if os.getpid() != me:  # a process the agent forked returned from it: only the episode replies
        os._exit(0)
    _flush_stdio()
    with suppress(OSError):
        os.write(result_w, reply)
    os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def episode_result(fn: Callable[..., Any], base_url: str, row: dict, kwargs: dict, bound: float) -> bytes:
    """The agent's outcome as JSON: {"reward": float or null, "at": when it returned} or {"error":
    why, "at": ...}. The return value is read once, here, into a plain float. `at` is
    time.monotonic() (one clock for the host): calls the agent left in flight then are not its
    episode's (reward.agents.server.AgentServer.end_episode)."""
    try:
        value = fn(base_url, row, **kwargs)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
    except SystemExit as exc:
        return _error(f"called sys.exit({exc.code!r})", time.monotonic())
    except BaseException as exc:  # noqa: BLE001 - the user's code: whatever it raises is the episode's
        ended = time.monotonic()
        traceback.print_exc()
        at = traceback.extract_tb(exc.__traceback__)[-1]
        return _error(f"raised {type(exc).__name__}: {exc} (at {os.path.basename(at.filename)}:{at.lineno} "
                      f"in {at.name})", ended)
    ended = time.monotonic()
    try:
        reward, why = read_reward(value, bound)
    except BaseException as exc:  # noqa: BLE001 - a value whose conversion raises
        reward, why = None, f"returned a value whose conversion raised {type(exc).__name__}"
    return _error(why, ended) if why else json.dumps({"reward": reward, "at": ended}).encode()


def read_reward(value: Any, bound: float) -> tuple[float | None, str | None]:
    """(reward, None) or (None, why): a plain int or float (or a NumPy number) read once with
    float(), finite and within +-bound; None means "no reward of the agent's own". A bool, a
    subclass of int or float (whose methods could answer differently each time), and anything
    else are refused."""
    if value is None:
        return None, None
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    numpy_number = kind.__module__ == "numpy" and hasattr(value, "dtype") and not numpy_bool
    if kind is bool or numpy_bool:
        return None, (f"returned {value!r} (a bool): an agent returns the episode's reward as a plain float or "
                      "int, or None to leave it to reward.functions")
    if kind not in (int, float) and not numpy_number:
        base = "float" if isinstance(value, float) else "int" if isinstance(value, int) else None
        what = f"a {kind.__name__} (a subclass of {base})" if base else f"a {kind.__name__}, not a number"
        return None, (f"returned {what}: an agent returns the episode's reward as a plain "
                      "float or int, or None to leave it to reward.functions")
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None, f"returned {kind.__name__} that is not a finite number"
    if type(number) is not float or not math.isfinite(number):
        return None, f"returned {number!r}: not a finite number"
    if abs(number) > bound:
        return None, (f"returned {number:g}, beyond task.agent_reward_bound={bound:g}: return a reward within "
                      "+-bound, or raise the bound")
    return number, None


def _error(why: str, at: float | None = None) -> bytes:
    return json.dumps({"error": " ".join(why.split())[:_ERROR_CHARS], "at": at}).encode()


# -- process plumbing ---------------------------------------------------------------------------
def _flush_stdio() -> None:
    with suppress(OSError, ValueError, AttributeError):  # closed, or None in a process started without them
        sys.stdout.flush()
        sys.stderr.flush()


def _send_msg(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)))
    sock.sendall(data)


def _recv_msg(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("!Q", _recv_exact(sock, 8))
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _reap():
    """(pid, wait status) of each exited child, without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _kill(pid: int) -> None:
    """SIGKILL `pid` and, when it leads one, its process group."""
    for kill in (os.killpg, os.kill):
        with suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _kill_children(keep: set[int] | frozenset[int] = frozenset()) -> None:
    """SIGKILL this process's children but `keep`, and reap them, until none is left (a second at
    most). As a subreaper this process inherits what they orphan, so this ends the whole tree."""
    deadline = time.monotonic() + 1.0
    while (kids := [pid for pid in _children() if pid not in keep]) and time.monotonic() < deadline:
        for pid in kids:
            _kill(pid)
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)


def _become_subreaper() -> None:
    _linux.set_child_subreaper(True)


def _die_with_parent() -> None:
    _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)


def _set_rlimits(limits: dict) -> None:
    """The fallback's caps (no cgroups): address space past what the worker inherits from the zygote,
    and tasks past what its user runs already."""
    vm = int(_status("self").get("VmSize", "0 kB").split()[0]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + (limits["memory_mb"] << 20),) * 2)
    uid = str(os.getuid())
    tasks = sum(int(s.get("Threads", "1")) for s in map(_status, _pids()) if s.get("Uid", "").split()[:1] == [uid])
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks + limits["max_processes"],) * 2)


def _children() -> list[int]:
    me, kids = str(os.getpid()).encode(), []
    for pid in _pids():
        with suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[1] == me:  # after "pid (comm)": state, ppid
                kids.append(int(pid))
    return kids


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def _status(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
