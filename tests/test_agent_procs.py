"""reward.agents.pool: agent functions in sandboxed episode processes that deadlines, crashes and
floods cannot take down with them, in both isolation regimes (cgroups, and the fallback forced by
hand); what an episode can see of the host (its own processes, an empty /tmp, the code and nothing
beside it, uid 1, no signal reaching out); a zygote that dies, restarted then given up on; and
reward.loader.load_agent_function's errors. Real processes throughout.

An episode writes no host file (the root it sees is read-only, the host's /tmp is not its /tmp), so
the test learns its processes from the driver's side: `TreeSampler` polls the host pids of the
pool's workers (`w.pid`) and all their descendants while a case runs (each case's episode waits at
a gate, an endpoint of the test's, until the sampler has seen it), and every one of them must be
gone once the outcome is in. What an episode found out comes back as its float reward; what it
did to an endpoint (the test's `Counter`), the endpoint counts."""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import os
import re
import shutil
import signal
import socketserver
import statistics
import tempfile
import threading
import time
from typing import Callable

import psutil
import pytest

from reward.agents import pool as agent_procs
from reward.agents.pool import AgentLimits, AgentPool
from reward.loader import RewardLoadError, load_agent_function

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_under_tmp() -> list[str]:
    """The names in an episode's /tmp that lead to the agent's code (the checkout, when it lies
    under /tmp, e.g. a CI clone): put back read-only, they are not another episode's files."""
    return [REPO.split(os.sep)[2]] if REPO.startswith("/tmp/") else []
TIMEOUT_S = 2.0
LIMITS = AgentLimits(timeout_s=TIMEOUT_S, memory_mb=512, max_processes=32)
CGROUPS = agent_procs._cgroups_usable()

AGENTS = '''
import asyncio, ctypes, os, signal, socket, subprocess, sys, threading, time

CONSTANT = 3
CALLS = 0  # calls of `behave` in this process: 1 in every episode, each a fresh fork of the zygote

def gate(row, processes):
    """With row["gate"] (the test's counter's port): wait until the test has seen `processes` of
    this episode's (the worker, the episode, its children), 10 s at most."""
    if "gate" in row:
        with socket.create_connection(("127.0.0.1", row["gate"]), timeout=30) as s:
            s.sendall(b"gate %d\\n" % processes)
            s.makefile("rb").readline()

def behave(base_url, row, offset=0.0):
    global CALLS
    CALLS += 1
    gate(row, 2)
    result = globals()[row["case"]](row)
    return result + offset if row["case"] == "value" else result

def value(row):
    print("thinking about", row["case"])
    return 1.0

def raises(row):
    raise ValueError("bad row 7")

def exits(row):
    sys.exit(3)

def os_exit(row):
    os._exit(0)

def segfault(row):
    ctypes.string_at(0)

def busy(row):
    while True:
        pass

def sleeps(row):
    time.sleep(1000)

def sleep_then(row):
    time.sleep(row["s"])
    return 7.0

def big_return(row):
    return "x" * 100_000_000

def rogue_result(row):
    """Bypasses the episode's own result writer: a garbage stream to every fd it has past stdio
    (its result pipe), 1 MiB each, then hangs. Sockets are left out: an episode should have none
    (test_an_episode_has_no_socket_to_the_driver), and the one it inherits today is the driver's."""
    for fd in range(3, 64):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                os.write(fd, b"x" * (1 << 20))
        except OSError:
            pass
    time.sleep(1000)

def by_hand(row):
    """Writes row["data"] as its result to every pipe it has past stdio (its result pipe), then exits."""
    for fd in range(3, 64):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                os.write(fd, row["data"].encode())
        except OSError:
            pass
    os._exit(0)

def unpicklable(row):
    return lambda: 0

def floods(row):
    line = "y" * 999 + "\\n"
    for _ in range(100_000):
        sys.stdout.write(line)
    print("the end")
    return 2.0

def fork_bomb(row):
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)

def hog(row):
    chunks = [b"x" * (64 << 20) for _ in range(48)]  # 3 GB, written (not lazily mapped)
    return len(chunks)

def detached(row):
    """A child in a session of its own (what subprocess.Popen(start_new_session=True) makes),
    left sleeping when the episode returns."""
    if os.fork() == 0:
        os.setsid()
        time.sleep(1000)
        os._exit(0)
    gate(row, 3)  # the sampler has seen the child too
    return 0.0

def calls(row):
    return float(CALLS)

def proc_entries(row):
    return float(sum(name.isdigit() for name in os.listdir("/proc")))

def getpid(row):
    return float(os.getpid())

def tmp_then_write(row):
    """How many entries /tmp and /dev/shm had, before leaving a file in each (but the folders that
    lead to the agent's code, put back read-only where the checkout lies under /tmp: row["code"])."""
    before = len(set(os.listdir("/tmp")) - set(row.get("code", ()))) + len(os.listdir("/dev/shm"))
    print(os.listdir("/tmp"), os.listdir("/dev/shm"))
    for d in ("/tmp", "/dev/shm"):
        with open(d + "/left-by-an-episode", "w") as f:
            f.write("x")
    return float(before)

def exists(row):
    return float(os.path.exists(row["path"]))

def write(row):
    """0.0 if it could create row["path"], else the errno."""
    try:
        open(row["path"], "w").close()
    except OSError as exc:
        return float(exc.errno)
    return 0.0

def lazy_import(row):
    import sibling  # beside this file, imported only now, in the episode
    return sibling.VALUE

def uid(row):
    return float(os.getuid())

def kill(row):
    """How many of row["pids"] SIGINT reached (ProcessLookupError, PermissionError: not reached)."""
    reached = 0
    for pid in row["pids"]:
        try:
            os.kill(pid, signal.SIGINT)
            reached += 1
        except (ProcessLookupError, PermissionError):
            pass
    return float(reached)

def privileges(row):
    """What it may still do to the kernel: 1000 x no capability at all (effective, bounding),
    100 x no_new_privs, 10 x a seccomp filter, 1 x unshare(CLONE_NEWUSER) refused."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    libc = ctypes.CDLL(None, use_errno=True)
    refused = libc.unshare(0x10000000) == -1 and ctypes.get_errno() == 1
    return (1000.0 * (int(status["CapEff"], 16) == 0 == int(status["CapBnd"], 16)) + 100.0 * (status["NoNewPrivs"].strip() == "1")
            + 10.0 * (status["Seccomp"].strip() == "2") + 1.0 * refused)

def sockets(row):
    """The sockets among its fds (it opened none)."""
    found = 0
    for fd in range(3, 256):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return float(found)

def native(row):
    """1.0 if what an ordinary agent may need works: row["what"] is "numpy" (a C extension linking
    libstdc++, imported in the episode) or "exec" (run a program: this interpreter)."""
    if row["what"] == "numpy":
        import numpy
        return float(numpy.float64(1.0))
    return float(subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, timeout=30).stdout == b"1\\n")

def needs_scale(base_url, row, scale):
    return scale

def two_args(base_url, row):
    return 0.0

def one_arg(base_url):
    return 0.0

def with_kwargs(base_url, row, **kwargs):
    return 0.0

LEFT = []  # what earlier episodes in this process left

def leaky(row):
    """Looks for what an earlier episode left (globals, threads, environment, cwd) and reports it as
    len(LEFT)*1000 + threads*100 + env*10 + (cwd == "/"); then leaves all of it, with a thread that
    keeps calling the test's counter (an endpoint) after the episode returned. It returns once a
    call has come back through the relays (5 s at most)."""
    seen = (len(LEFT) * 1000 + threading.active_count() * 100 + (os.environ.get("LEAKED") is not None) * 10
            + (os.getcwd() == "/"))
    LEFT.append(row["n"])
    os.environ["LEAKED"] = "1"
    os.chdir("/")
    answered = threading.Event()
    def keep_calling():
        while True:
            try:
                with socket.create_connection(("127.0.0.1", row["port"]), timeout=1) as s:
                    s.sendall(b"%d\\n" % row["n"])
                    if s.makefile("rb").readline() == b"ok\\n":
                        answered.set()
            except OSError:
                pass
            time.sleep(0.005)
    threading.Thread(target=keep_calling, daemon=True).start()
    answered.wait(5.0)
    time.sleep(0.05)
    return float(seen)

async def async_value(base_url, row):
    await asyncio.sleep(0.01)
    return 2.5
'''


def write_agents(folder: str) -> str:
    with open(os.path.join(folder, "agents.py"), "w") as f:
        f.write(AGENTS)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("data beside the agent's code: not the episode's to see\n")
    return folder


@pytest.fixture(scope="module")
def agents_dir():
    """The agent's folder, outside /tmp (an episode's /tmp is its own: test_agent_code_under_tmp)."""
    d = tempfile.mkdtemp(prefix="rlpost-test-agents-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    yield write_agents(d)
    shutil.rmtree(d, ignore_errors=True)


class Counter(socketserver.ThreadingTCPServer):
    """An endpoint on the host's 127.0.0.1: counts the connections that name an episode (`hits[n]`),
    answering "ok"; "gate N" is answered once `seen(N)` (set by the test) holds, or after 10 s."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        self.hits: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()
        self.seen: Callable[[int], bool] = lambda n: True
        self.gated_s = 0.0  # time episodes spent waiting at the gate
        counter = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                line = self.rfile.readline(32).strip()
                if line.startswith(b"gate "):
                    t0 = time.monotonic()
                    while not counter.seen(int(line.split()[1])) and time.monotonic() < t0 + 10.0:
                        time.sleep(0.01)
                    with counter.lock:
                        counter.gated_s += time.monotonic() - t0
                    self.wfile.write(b"ok\n")
                if line.isdigit():
                    with counter.lock:
                        counter.hits[int(line)] += 1
                    self.wfile.write(b"ok\n")

        super().__init__(("127.0.0.1", 0), Handler)

    def snapshot(self) -> dict[int, int]:
        with self.lock:
            return dict(self.hits)


@pytest.fixture(scope="module")
def counter():
    server = Counter()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def make_pool(agents_dir: str, regime: str, spec: str = "agents:behave", workers: int = 2, **kw) -> AgentPool:
    """A pool in `regime` ("cgroups", or "fallback" forced where cgroups work)."""
    if regime == "cgroups" and not CGROUPS:
        pytest.skip("no writable v1 memory/pids cgroups here")
    with pytest.MonkeyPatch.context() as mp:
        if regime == "fallback":
            mp.setattr(agent_procs, "_cgroups_usable", lambda: False)
        return AgentPool(spec, agents_dir, workers, kw.pop("limits", LIMITS), **kw)


@pytest.fixture(scope="module", params=["cgroups", "fallback"])
def pool(request, agents_dir, counter):
    p = make_pool(agents_dir, request.param, kwargs={"offset": 0.5},
                  endpoints=[("127.0.0.1", counter.server_address[1])])
    p.regime = request.param
    yield p
    p.close()


def run_one(pool: AgentPool, row: dict, wait_s: float = 30.0):
    """Start one job and wait for its outcome: (outcome, wall seconds)."""
    job_id = object()
    t0 = time.monotonic()
    pool.start(job_id, "http://127.0.0.1:1/v1", row)
    while time.monotonic() - t0 < wait_s:
        for jid, outcome in pool.results(0.5):
            assert jid is job_id, "an outcome for a job not started here"
            return outcome, time.monotonic() - t0
    raise AssertionError(f"no outcome for {row} within {wait_s} s")


def run_all(pool: AgentPool, rows: dict, wait_s: float = 30.0) -> dict:
    """Start a job per row (`rows`: job id -> row), all at once; their outcomes by job id."""
    for job_id, row in rows.items():
        pool.start(job_id, "http://127.0.0.1:1/v1", row)
    got, t0 = {}, time.monotonic()
    while len(got) < len(rows) and time.monotonic() - t0 < wait_s:
        got.update(pool.results(0.5))
    assert got.keys() == rows.keys(), f"outcomes for {sorted(got, key=str)} of {sorted(rows, key=str)}"
    return got


def value_of(pool: AgentPool, row: dict) -> float | None:
    outcome, _ = run_one(pool, row)
    assert outcome.error is None, outcome
    return outcome.value


def peak_rss_reset() -> None:
    """Reset this process's VmHWM, so that a later read gives the peak since now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie counts: its parent has yet to reap it); pid reuse is noticed."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def processes(pids) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def left_alive(procs, within_s: float = 2.0) -> list[psutil.Process]:
    """Those of `procs` still running `within_s` from now (a killed process exits in milliseconds;
    the bound is for a loaded machine)."""
    deadline = time.monotonic() + within_s
    while (alive := [p for p in procs if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


def children(pid: int) -> list[int]:
    """`pid`'s children, from /proc/<pid>/task/*/children (cheaper than a scan of every process)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            with open(path) as f:
                out += map(int, f.read().split())
    return out


class TreeSampler:
    """While a case runs, every ~20 ms: the host processes of the pool's workers (`w.pid`, their
    host pids) and all their descendants (with `zygote`: the launcher's whole tree too, zygote
    included). `seen`: every process sampled; `last`: the latest sample; `most`: the most live
    processes under one worker in a sample. With cgroups, also each agent pids cgroup's most tasks
    (`cgroup_most`) and every pid in them (`cgroup_pids`)."""

    def __init__(self, pool: AgentPool, zygote: bool = False):
        self.pool = pool
        self.zygote = pool._zygote.pid if zygote else None  # this launcher's: not one started after it
        self.seen: set[psutil.Process] = set()
        self.last: list[psutil.Process] = []
        self.most = 0
        self.cgroup_most: dict[str, int] = {}
        self.cgroup_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(0.02):
                return

    def _sample(self) -> None:
        roots = [w.pid for w in list(self.pool._workers) if w.pid is not None]
        if self.zygote is not None:
            roots.append(self.zygote)
        sample = []
        for root in roots:
            tree, todo = [], [root]
            while todo:
                pid = todo.pop()
                try:
                    tree.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    continue
                todo += children(pid)
            sample += tree
            self.most = max(self.most, sum(not gone(p) for p in tree))
        self.seen.update(sample)
        self.last = sample
        for d in glob.glob(f"/sys/fs/cgroup/pids/rlpost-sandbox/{os.getpid()}-agent-*"):
            try:
                current = int(open(f"{d}/pids.current").read())
                self.cgroup_pids.update(int(p) for p in open(f"{d}/cgroup.procs").read().split())
            except OSError:
                continue
            self.cgroup_most[d] = max(self.cgroup_most.get(d, 0), current)

    def wait_for(self, live: int, wait_s: float = 10.0) -> None:
        """Until a sample shows `live` processes at least."""
        deadline = time.monotonic() + wait_s
        while sum(not gone(p) for p in self.last) < live:
            assert time.monotonic() < deadline, f"never saw {live} processes: {self.last}"
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


TIMED_OUT = r"^task\.agent did not return within task\.agent_timeout_s=2 s: killed$"
MEMORY = {"cgroups": r"^task\.agent was killed at its memory limit, task\.agent_memory_mb=512$",
          "fallback": r"^task\.agent raised MemoryError"}
NOT_A_NUMBER = (r": an agent returns the episode's reward as a plain float or int, or None to leave it to "
                r"reward\.functions$")

# case, expected value (None: an error), error pattern, most wall seconds, fewest processes the
# sampler must see (the worker, its episode, what that forks); every worker dies after its episode:
# retired, issue 47
CASES = [
    ("value", 1.5, None, 1, 2),
    ("raises", None, r"^task\.agent raised ValueError: bad row 7 \(at agents\.py:\d+ in raises\)$", 1, 2),
    ("exits", None, r"^task\.agent called sys\.exit\(3\)$", 1, 2),
    ("os_exit", None, r"^task\.agent exited with code 0 before returning$", 1, 2),
    ("segfault", None, r"^task\.agent was killed by signal SIGSEGV$", 1, 2),
    ("busy", None, TIMED_OUT, TIMEOUT_S + 1, 2),
    ("sleeps", None, TIMED_OUT, TIMEOUT_S + 1, 2),
    ("big_return", None, r"^task\.agent returned a str, not a number" + NOT_A_NUMBER, 5, 2),
    ("rogue_result", None, r"^task\.agent sent over 65536 bytes as its result$", 1, 2),
    ("unpicklable", None, r"^task\.agent returned a function, not a number" + NOT_A_NUMBER, 1, 2),
    ("floods", 2.0, None, 10, 2),
    ("hog", None, MEMORY, 10, 2),  # the fallback's MemoryError is caught
    ("fork_bomb", None, TIMED_OUT, TIMEOUT_S + 1, LIMITS.max_processes // 2),
    ("detached", 0.0, None, 1, 3),
]


@pytest.mark.parametrize("case,value,error,most_s,fewest", CASES, ids=[c[0] for c in CASES])
def test_outcome(pool, counter, case, value, error, most_s, fewest):
    error = error[pool.regime] if isinstance(error, dict) else error
    peak_rss_reset()
    before = peak_rss()
    with TreeSampler(pool) as sampler:
        counter.seen, counter.gated_s = (lambda n: sampler.most >= n), 0.0  # the episode goes on once seen
        try:
            outcome, wall = run_one(pool, {"case": case, "gate": counter.server_address[1]})
        finally:
            counter.seen = lambda n: True
    grew = peak_rss() - before

    if error is None:
        assert outcome.error is None and outcome.value == value and type(outcome.value) is float, outcome
    else:
        assert outcome.value is None and re.search(error, outcome.error), outcome
    assert wall < most_s + counter.gated_s and outcome.seconds <= wall
    if error == TIMED_OUT:
        assert wall >= TIMEOUT_S
    assert grew < 30 << 20, f"the driver's peak RSS grew by {grew >> 20} MiB"  # never the 100 MB
    assert len(sampler.seen) >= fewest, f"the sampler saw only {sampler.seen}"
    assert not left_alive(sampler.seen), "retired, whatever the outcome"  # the worker, its episode, their children

    if case == "value":
        assert outcome.log_tail == "thinking about value\n"
    if case == "raises":
        assert outcome.log_tail.startswith("Traceback") and outcome.log_tail.endswith("ValueError: bad row 7\n")
    if case == "segfault":  # faulthandler's stack, up to the agent's line
        assert "Segmentation fault" in outcome.log_tail and "in segfault" in outcome.log_tail
    if case == "floods":
        assert len(outcome.log_tail) == LIMITS.log_tail_bytes and outcome.log_tail.endswith("y\nthe end\n")
    if case == "fork_bomb":
        if pool.regime == "cgroups":  # the pids cgroup's limit, and the cgroup removed with every task in it
            bomb = max(sampler.cgroup_most, key=sampler.cgroup_most.get)
            # (+1: a fork over the limit is charged, then reverted: pids.current shows it for an instant)
            assert LIMITS.max_processes // 2 < sampler.cgroup_most[bomb] <= LIMITS.max_processes + 1, \
                sampler.cgroup_most
            time.sleep(0.3)  # the zygote's exit report, then the cgroup's removal
            assert not os.path.exists(bomb)
            assert not left_alive(processes(sampler.cgroup_pids))
        else:  # RLIMIT_NPROC: the episode's host uid is not root, so the limit holds (the worker, plus a few
            # tasks of the zygote's uid the limit was set above, are in the tree too)
            assert LIMITS.max_processes // 2 < sampler.most <= LIMITS.max_processes + 8, sampler.most


BY_HAND = [  # what an episode writes on its result pipe itself, then exits; value, error
    ("{not json", None, r"^task\.agent sent a result that is not JSON$"),
    ("[1.0]", None, r"^task\.agent sent a result of the wrong shape$"),
    ('{"reward": "1.0"}', None, r"^task\.agent sent a result of the wrong shape$"),
    ('{"reward": 1.0, "error": "x"}', None, r"^task\.agent sent a result of the wrong shape$"),
    ('{"reward": 2.0}', 2.0, None),  # no more than returning 2.0 (task.agent_reward_bound: reward.agents.runner)
]


@pytest.mark.parametrize("data,value,error", BY_HAND, ids=[d for d, _, _ in BY_HAND])
def test_a_result_written_by_hand_is_read_as_data(pool, data, value, error):
    outcome, _ = run_one(pool, {"case": "by_hand", "data": data})
    assert outcome.value == value and (outcome.error is None if error is None else re.search(error, outcome.error)), \
        outcome


RESULT_LOST = "task.agent exited with code 0 before returning"  # what a lost result reads as (pool._exited)


def test_each_episode_runs_in_a_fresh_process_and_its_cost(pool, capsys):
    """40 trivial episodes through 2 workers: each in a fresh fork of the loaded zygote (issue 47):
    its call counter, a module global, is 1 in every one; the cost per episode is printed, 2 at a
    time and one at a time."""
    run_one(pool, {"case": "calls"})
    t0 = time.monotonic()
    got = run_all(pool, {i: {"case": "calls"} for i in range(40)})
    wall = time.monotonic() - t0
    lost = {j for j, o in got.items() if o.error == RESULT_LOST}
    assert not {j: o for j, o in got.items() if j not in lost and (o.error is not None or o.value != 1.0)}
    assert wall < 10
    alone = [run_one(pool, {"case": "calls"})[1] for _ in range(10)]
    with capsys.disabled():
        print(f"\n[{pool.regime}] 40 sandboxed episodes, a fresh worker each, 2 at a time: {wall * 1e3:.0f} ms, "
              f"{wall / 40 * 1e3:.1f} ms per episode wall; episode mean "
              f"{sum(o.seconds for o in got.values()) / 40 * 1e3:.2f} ms; one at a time: median "
              f"{statistics.median(alone) * 1e3:.1f} ms per episode (start to outcome)")
    assert not lost, f"{len(lost)} of 40 results lost: a worker's exit handled before its result"


def test_nothing_an_episode_leaves_is_seen_by_another_or_outlives_it(pool, counter):
    """An agent that leaves globals, cwd, environment and a thread still calling an endpoint: the
    next episodes see none of it (100.0: no global left, 1 thread, no variable, cwd not "/"), and
    the thread's calls stop with its episode (issue 47: a module-global URL and a thread per worker
    put 107 calls into 30 later episodes). Calls already on their way through the relays when the
    episode ends may still land (relay latency); then the count stops."""
    port = counter.server_address[1]
    base = 1000 * (pool.regime == "fallback")  # this module's pools share the counter
    rows = {base + i: {"case": "leaky", "n": base + i, "port": port} for i in range(6)}
    got = run_all(pool, rows)
    assert all(o.error is None and o.value == 100.0 for o in got.values()), got
    time.sleep(0.3)  # what was in flight lands
    settled = counter.snapshot()
    assert all(settled.get(j) for j in rows), settled  # each episode's thread reached the endpoint
    time.sleep(0.5)
    later = counter.snapshot()
    assert all(later[j] == settled[j] for j in rows), (settled, later)  # no thread outlives its episode


def test_crash_spares_the_other_episode(pool):
    pool.start("slow", "http://x", {"case": "sleep_then", "s": 1.0})
    time.sleep(0.2)
    pool.start("crash", "http://x", {"case": "segfault"})
    got = {}
    t0 = time.monotonic()
    while len(got) < 2 and time.monotonic() - t0 < 10:
        got.update(pool.results(1.0))
    assert "SIGSEGV" in got["crash"].error
    assert got["slow"].value == 7.0 and got["slow"].error is None


def test_cancel(pool):
    with TreeSampler(pool) as sampler:
        for i in range(2):
            pool.start(f"hang{i}", "http://x", {"case": "sleeps"})
        pool.start("queued", "http://x", {"case": "value"})
        sampler.wait_for(4)  # two workers, each with its episode
        assert pool.running() == 2 and pool.queued() == 1
        pool.cancel("queued")
        assert pool.queued() == 0
        for i in range(2):
            pool.cancel(f"hang{i}")
        time.sleep(0.3)
    assert pool.running() == 0 and pool.results(0.5) == []
    assert not left_alive(sampler.seen)
    assert run_one(pool, {"case": "value"})[0].value == 1.5


def test_an_episode_sees_only_its_own_processes(pool):
    """Its /proc is its pid namespace's: itself alone (pid 1), whatever else runs on the host."""
    assert value_of(pool, {"case": "proc_entries"}) == 1.0
    assert value_of(pool, {"case": "getpid"}) == 1.0


def test_tmp_starts_empty_in_every_episode(pool):
    """/tmp and /dev/shm are the episode's own: empty at its start, though each episode before
    (sequential, and concurrent) left a file in both."""
    row = {"case": "tmp_then_write", "code": code_under_tmp()}
    one_by_one = [run_one(pool, row)[0] for _ in range(3)]  # (what it found: in the log tail)
    together = run_all(pool, {i: row for i in range(4)})
    for outcome in one_by_one + list(together.values()):
        assert outcome.error is None and outcome.value == 0.0, outcome


def test_an_episode_sees_the_code_and_nothing_beside_it(pool, agents_dir, tmp_path):
    """The checkout's and the agent's folder's Python code is there, read-only; their other files
    (.git, pyproject.toml, data beside the agent) and the host's files (the test's tmp_path) are
    not."""
    (tmp_path / "host.txt").write_text("a host file")
    expected = {
        os.path.join(REPO, "reward", "agents", "pool.py"): 1.0,
        os.path.join(agents_dir, "agents.py"): 1.0,
        os.path.join(REPO, ".git"): 0.0,
        os.path.join(REPO, "pyproject.toml"): 0.0,
        os.path.join(agents_dir, "notes.txt"): 0.0,
        str(tmp_path / "host.txt"): 0.0,
    }
    assert all(map(os.path.exists, expected))
    got = run_all(pool, {path: {"case": "exists", "path": path} for path in expected})
    assert {path: o.value for path, o in got.items()} == expected, got
    for folder in (agents_dir, REPO):
        new = os.path.join(folder, f"written-by-an-episode-{os.getpid()}.py")
        try:
            # the code is read-only (a checkout under /tmp: its folders there belong to the zygote)
            assert value_of(pool, {"case": "write", "path": new}) in (errno.EROFS, errno.EACCES)
            assert not os.path.exists(new)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(new)


def test_agent_code_under_tmp(tmp_path):
    """An agent whose folder lies under /tmp (the zygote binds its code inside its /tmp, which each
    episode replaces with its own): its code is still there in the episode, read by a lazy import
    of a module beside it; the data beside it is not."""
    (tmp_path / "sibling.py").write_text("VALUE = 4.0\n")
    pool = make_pool(write_agents(str(tmp_path)), "cgroups" if CGROUPS else "fallback", workers=1)
    try:
        assert value_of(pool, {"case": "lazy_import"}) == 4.0
        assert value_of(pool, {"case": "exists", "path": str(tmp_path / "agents.py")}) == 1.0
        assert value_of(pool, {"case": "exists", "path": str(tmp_path / "notes.txt")}) == 0.0
    finally:
        pool.close()


def test_an_episode_has_no_privilege_and_a_seccomp_filter(pool):
    """No capability (none to regain: the bounding set is empty), no_new_privs, the seccomp filter
    on; a new user namespace (where it would be root again) is refused."""
    assert value_of(pool, {"case": "privileges"}) == 1111.0


def test_an_episode_is_uid_1_and_cannot_signal_the_host(pool):
    """uid 1 inside (a host uid of its own; where the driver is not root, the episode is uid 0 of a
    single-uid user namespace, the driver's user, capabilities dropped); SIGINT to the driver,
    the launcher and the zygote reaches none of them (not in its pid namespace), and the driver
    never sees it."""
    assert value_of(pool, {"case": "uid"}) == (1.0 if os.geteuid() == 0 else 0.0)
    launcher = pool._zygote.pid
    [zygote] = psutil.Process(launcher).children()
    received = []
    old = signal.signal(signal.SIGINT, lambda *args: received.append(args))
    try:
        reached = value_of(pool, {"case": "kill", "pids": [os.getpid(), launcher, zygote.pid]})
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGINT, old)
    assert reached == 0.0 and received == []
    assert pool._zygote.pid == launcher and pool.restarts == 0 and zygote.is_running()


def test_an_episode_has_no_socket_to_the_driver(pool):
    """Its worker's socket to the driver is closed in the episode: no result of its own past its
    worker and read_reward."""
    assert value_of(pool, {"case": "sockets"}) == 0.0


@pytest.mark.parametrize("what", ["numpy", "exec"])
def test_an_episode_can_use_native_code(pool, what):
    """The sandbox's root has the loader and system libraries the interpreter's packages link:
    numpy (libstdc++) imports in an episode, and a program runs (this interpreter)."""
    outcome, _ = run_one(pool, {"case": "native", "what": what})
    assert outcome.value == 1.0, outcome


@pytest.mark.parametrize("regime", ["cgroups", "fallback"])
def test_close_kills_hanging_agents(agents_dir, regime, capsys):
    t0 = time.monotonic()
    pool = make_pool(agents_dir, regime, limits=AgentLimits(timeout_s=1000))
    started = time.monotonic() - t0
    outcome, first = run_one(pool, {"case": "value"})  # the first episode forks its worker
    with TreeSampler(pool, zygote=True) as sampler:
        for i in range(3):
            pool.start(i, "http://x", {"case": "sleeps"})
        sampler.wait_for(6)  # the launcher, the zygote, two workers, each with its episode
        deadline = time.monotonic() + 10
        while pool.running() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.running() == 2 and pool.queued() == 1
        # each started worker: 3 controllers
        in_cgroups = [w for w in pool._workers if w.cg]
        cgroup_dirs = [d for w in in_cgroups for d in w.cg.paths.values()]
        assert len(cgroup_dirs) == 3 * len(in_cgroups)
        assert len(in_cgroups) >= (2 if regime == "cgroups" else 0)
        t1 = time.monotonic()
        pool.close()
        closing = time.monotonic() - t1
    assert closing < 2.0
    assert not left_alive(sampler.seen, within_s=0.5)
    assert not any(map(os.path.exists, cgroup_dirs))
    pool.close()
    with pytest.raises(RuntimeError):
        pool.start(3, "http://x", {"case": "value"})
    with capsys.disabled():
        print(f"\n[{regime}] zygote ready in {started * 1e3:.0f} ms; first episode (forks its worker) "
              f"{first * 1e3:.0f} ms; close with 2 hanging agents {closing * 1e3:.0f} ms")


def zygote_of(pool: AgentPool) -> psutil.Process:
    """The zygote's host process: the launcher's one child."""
    [zygote] = psutil.Process(pool._zygote.pid).children()
    return zygote


def test_zygote_death_fails_its_jobs_restarts_then_breaks(agents_dir):
    """The zygote SIGKILLed (its pid namespace ends with it, every worker and episode in it): the
    running job fails naming the zygote's exit (the pid named is the launcher's, pool._zygote), the
    zygote is started again and the next job succeeds; once `zygote_restarts` are used up the pool
    is broken, and every job fails at once saying why."""
    pool = make_pool(agents_dir, "cgroups" if CGROUPS else "fallback", limits=AgentLimits(timeout_s=1000),
                     kwargs={"offset": 0.5}, zygote_restarts=1)
    try:
        for n, job in enumerate(["hang", "hang2"]):
            with TreeSampler(pool, zygote=True) as sampler:
                pool.start(job, "http://x", {"case": "sleeps"})
                sampler.wait_for(4)  # the launcher, the zygote, the worker, its episode
                launcher = pool._zygote.pid
                zygote_of(pool).kill()
                [(job_id, outcome)] = pool.results(10.0)
            assert job_id == job and outcome.value is None
            assert outcome.error == f"task.agent could not finish: its zygote process exited (launcher pid {launcher})", outcome
            assert not left_alive(sampler.seen)  # the launcher too: it exits with its zygote
            if n == 0:
                outcome, _ = run_one(pool, {"case": "value"})  # waits for the new zygote
                assert outcome.error is None and outcome.value == 1.5, outcome
                assert pool.restarts == 1 and pool._zygote.pid != launcher and pool.out_of_service is None
        t0 = time.monotonic()
        while pool.out_of_service is None and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert re.match(rf"^could not run: its zygote process exited \(launcher pid {launcher}\)", pool.out_of_service or ""), \
            pool.out_of_service
        outcome, wall = run_one(pool, {"case": "value"})
        assert outcome.value is None and outcome.error == f"task.agent {pool.out_of_service}" and wall < 0.1, outcome
    finally:
        pool.close()


def test_launcher_death_ends_the_zygote(agents_dir):
    """The zygote's parent-death signal survives its change of credentials: a SIGKILLed launcher
    ends it, and the pool notices (its running job fails naming it)."""
    pool = make_pool(agents_dir, "cgroups" if CGROUPS else "fallback", limits=AgentLimits(timeout_s=1000),
                     zygote_restarts=1)
    try:
        pool.start("hang", "http://x", {"case": "sleeps"})
        t0 = time.monotonic()
        while pool.running() < 1 and time.monotonic() - t0 < 10:  # its worker has it
            time.sleep(0.02)
        zygote, launcher = zygote_of(pool), pool._zygote.pid
        os.kill(launcher, signal.SIGKILL)
        got = pool.results(5.0)
        assert not left_alive([zygote], within_s=1.0)
        assert [(j, o.error) for j, o in got] == [
            ("hang", f"task.agent could not finish: its zygote process exited (launcher pid {launcher})")]
    finally:
        pool.close()


def test_async_agent_and_load_errors_through_the_pool(agents_dir):
    pool = make_pool(agents_dir, "cgroups" if CGROUPS else "fallback", spec="agents:async_value", workers=1)
    try:
        assert run_one(pool, {})[0].value == 2.5
    finally:
        pool.close()
    with pytest.raises(RewardLoadError, match="task.agent_kwargs has 'foo', which agents:two_args does not take"):
        make_pool(agents_dir, "fallback", spec="agents:two_args", kwargs={"foo": 1})
    with pytest.raises(RewardLoadError, match="module 'no_such_agents' not found"):
        make_pool(agents_dir, "fallback", spec="no_such_agents:solve")


LOAD_ERRORS = [  # function, kwargs, error
    ("CONSTANT", {}, r"'CONSTANT' is a int, not callable; point at a function taking \(base_url, row, \*\*kwargs\)"),
    ("needs_scale", {}, r"parameter 'scale' has no default and is not in task\.agent_kwargs"),
    ("two_args", {"foo": 1}, r"task\.agent_kwargs has 'foo', which agents\.py:two_args does not take; add it to "
                             r"its parameters or remove it from task\.agent_kwargs"),
    ("one_arg", {}, r"takes 1 positional parameter\(s\), but is called as fn\(base_url, row, \*\*task\.agent_kwargs\)"),
    ("two_args", {"row": 1}, r"task\.agent_kwargs has 'row', which agents\.py:two_args already receives"),
]


@pytest.mark.parametrize("name,kwargs,error", LOAD_ERRORS, ids=[f"{n}-{list(k)}" for n, k, _ in LOAD_ERRORS])
def test_load_agent_function_errors(agents_dir, name, kwargs, error):
    with pytest.raises(RewardLoadError, match=error) as info:
        load_agent_function(f"agents.py:{name}", agents_dir, kwargs)
    assert str(info.value).startswith(f"task.agent='agents.py:{name}': ")


@pytest.mark.parametrize("name,kwargs", [("with_kwargs", {"foo": 1}), ("needs_scale", {"scale": 2}),
                                         ("async_value", {})])
def test_load_agent_function_accepts(agents_dir, name, kwargs):
    fn = load_agent_function(f"agents.py:{name}", agents_dir, kwargs)
    assert fn.__name__ == name
