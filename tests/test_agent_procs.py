"""reward.agents.pool: agent functions in worker processes that deadlines, crashes and floods cannot
take down with them, in both isolation regimes (cgroups, and the fallback forced by hand); and
reward.loader.load_agent_function's errors. Real processes throughout."""

from __future__ import annotations

import glob
import os
import re
import signal
import threading
import time

import psutil
import pytest

from reward.agents import pool as agent_procs
from reward.agents.pool import AgentLimits, AgentPool
from reward.loader import RewardLoadError, load_agent_function

TIMEOUT_S = 2.0
LIMITS = AgentLimits(timeout_s=TIMEOUT_S, memory_mb=512, max_processes=32)
CGROUPS = agent_procs._cgroups_usable()

AGENTS = '''
import asyncio, ctypes, os, subprocess, sys, time

CONSTANT = 3

def behave(base_url, row, offset=0.0):
    if "path" in row:  # written whole, then renamed: the test reads it as soon as it exists
        open(row["path"] + ".tmp", "w").write(str(os.getpid()))
        os.rename(row["path"] + ".tmp", row["path"])
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
    """Bypasses the worker's size check: writes a 100 MB message header on the result socket."""
    for fd in range(3, 64):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                os.write(fd, (100_000_000).to_bytes(8, "big") + b"x" * (1 << 20))
        except OSError:
            pass
    time.sleep(1000)

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
    return subprocess.Popen(["sleep", "1000"], start_new_session=True).pid

def pid(row):
    return os.getpid()

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
    """Looks for what an earlier episode left (globals, threads, cwd, environment), then leaves all
    of it, with a thread that keeps writing to row["path"] after the episode returned."""
    import threading
    seen = dict(left=list(LEFT), threads=threading.active_count(), env=os.environ.get("LEAKED"), cwd=os.getcwd())
    LEFT.append(row["n"])
    os.environ["LEAKED"] = "1"
    os.chdir("/")
    def keep_writing():
        while True:
            with open(row["path"], "a") as f:
                f.write("x")
            time.sleep(0.005)
    threading.Thread(target=keep_writing, daemon=True).start()
    time.sleep(0.02)
    return seen

async def async_value(base_url, row):
    await asyncio.sleep(0.01)
    return 2.5
'''


@pytest.fixture(scope="module")
def agents_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("agents")
    (d / "agents.py").write_text(AGENTS)
    return str(d)


def make_pool(agents_dir: str, regime: str, spec: str = "agents:behave", workers: int = 2, **kw) -> AgentPool:
    """A pool in `regime` ("cgroups", or "fallback" forced where cgroups work)."""
    if regime == "cgroups" and not CGROUPS:
        pytest.skip("no writable v1 memory/pids cgroups here")
    with pytest.MonkeyPatch.context() as mp:
        if regime == "fallback":
            mp.setattr(agent_procs, "_cgroups_usable", lambda: False)
        return AgentPool(spec, agents_dir, workers, kw.pop("limits", LIMITS), **kw)


@pytest.fixture(scope="module", params=["cgroups", "fallback"])
def pool(request, agents_dir):
    p = make_pool(agents_dir, request.param, kwargs={"offset": 0.5})
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


def peak_rss_reset() -> None:
    """Reset this process's VmHWM, so that a later read gives the peak since now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


TIMED_OUT = r"^task\.agent did not return within task\.agent_timeout_s=2 s: killed$"
MEMORY = {"cgroups": r"^task\.agent was killed at its memory limit, task\.agent_memory_mb=512$",
          "fallback": r"^task\.agent raised MemoryError"}

# case, expected value (None: an error), error pattern, most wall seconds (every worker dies after
# its episode: retired, issue 47)
CASES = [
    ("value", 1.5, None, 1),
    ("raises", None, r"^task\.agent raised ValueError: bad row 7 \(at agents\.py:\d+ in raises\)$", 1),
    ("exits", None, r"^task\.agent called sys\.exit\(3\)$", 1),
    ("os_exit", None, r"^task\.agent exited with code 0 before returning$", 1),
    ("segfault", None, r"^task\.agent was killed by signal SIGSEGV$", 1),
    ("busy", None, TIMED_OUT, TIMEOUT_S + 1),
    ("sleeps", None, TIMED_OUT, TIMEOUT_S + 1),
    ("big_return", None, r"^task\.agent returned 95\.4 MiB pickled, over the 1\.0 MiB limit$", 5),
    ("rogue_result", None, r"^task\.agent sent an unreadable result \(a 100000000-byte message, over the "
                           r"\d+-byte limit\): killed$", 1),
    ("unpicklable", None, r"^task\.agent returned a function that cannot be pickled", 1),
    ("floods", 2.0, None, 10),
    ("hog", None, MEMORY, 10),  # the fallback's MemoryError is caught
    ("fork_bomb", None, TIMED_OUT, TIMEOUT_S + 1),
    ("detached", int, None, 1),
]


class CgroupSampler:
    """During a case: the most tasks seen in each of this process's agent pids cgroups, and every pid."""

    def __init__(self):
        self.most: dict[str, int] = {}
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            for d in glob.glob(f"/sys/fs/cgroup/pids/rlpost-sandbox/{os.getpid()}-agent-*"):
                try:
                    current = int(open(f"{d}/pids.current").read())
                    self.pids.update(int(p) for p in open(f"{d}/cgroup.procs").read().split())
                except OSError:
                    continue
                self.most[d] = max(self.most.get(d, 0), current)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("case,value,error,most_s", CASES, ids=[c[0] for c in CASES])
def test_outcome(pool, tmp_path, case, value, error, most_s):
    if case == "fork_bomb" and pool.regime == "fallback" and os.geteuid() == 0:
        pytest.skip("without cgroups, root ignores RLIMIT_NPROC: an unbounded fork bomb would hurt the host")
    error = error[pool.regime] if isinstance(error, dict) else error
    peak_rss_reset()
    before = peak_rss()
    with CgroupSampler() as sampler:
        outcome, wall = run_one(pool, {"case": case, "path": str(tmp_path / "pid")})
    grew = peak_rss() - before

    if error is None:
        assert outcome.error is None, outcome
        assert isinstance(outcome.value, value) if isinstance(value, type) else outcome.value == value
    else:
        assert outcome.value is None and re.search(error, outcome.error), outcome
    assert wall < most_s and outcome.seconds <= wall
    if error == TIMED_OUT:
        assert wall >= TIMEOUT_S
    assert grew < 30 << 20, f"the driver's peak RSS grew by {grew >> 20} MiB"  # never the 100 MB
    time.sleep(0.1)  # a dead worker's exit, reaped by the zygote
    assert gone(int((tmp_path / "pid").read_text()))  # retired, whatever the outcome

    if case == "value":
        assert outcome.log_tail == "thinking about value\n"
    if case == "raises":
        assert outcome.log_tail.startswith("Traceback") and outcome.log_tail.endswith("ValueError: bad row 7\n")
    if case == "segfault":  # faulthandler's stack, up to the agent's line
        assert "Segmentation fault" in outcome.log_tail and "in segfault" in outcome.log_tail
    if case == "floods":
        assert len(outcome.log_tail) == LIMITS.log_tail_bytes and outcome.log_tail.endswith("y\nthe end\n")
    if case == "detached":
        assert gone(outcome.value), "the child it left behind outlived its episode"
    if case == "fork_bomb":
        bomb = max(sampler.most, key=sampler.most.get)
        assert LIMITS.max_processes // 2 < sampler.most[bomb] <= LIMITS.max_processes, sampler.most
        time.sleep(0.3)  # the zygote's exit report, then the cgroup's removal
        assert not os.path.exists(bomb)
        assert all(gone(p) for p in sampler.pids), [p for p in sampler.pids if not gone(p)]


def test_each_episode_runs_in_a_fresh_process_and_its_cost(pool, capsys):
    """40 trivial episodes through 2 workers: each in a process of its own, forked from the loaded
    zygote (issue 47); the cost per episode is printed (before: 2 reused workers, a few ms each)."""
    run_one(pool, {"case": "pid"})
    t0 = time.monotonic()
    for i in range(40):
        pool.start(i, "http://x", {"case": "pid"})
    got = {}
    while len(got) < 40 and time.monotonic() - t0 < 20:
        got.update(pool.results(1.0))
    wall = time.monotonic() - t0
    pids = {o.value for o in got.values()}
    assert len(got) == 40 and all(o.error is None for o in got.values())
    assert len(pids) == 40 and wall < 10
    with capsys.disabled():
        print(f"\n[{pool.regime}] 40 episodes, a fresh worker each, 2 at a time: {wall * 1e3:.0f} ms, "
              f"{wall / 40 * 1e3:.1f} ms per episode wall; episode mean {sum(o.seconds for o in got.values()) / 40 * 1e3:.2f} ms")


def test_nothing_an_episode_leaves_is_seen_by_another_or_outlives_it(pool, tmp_path):
    """An agent that leaves globals, cwd, environment and a thread still writing: the next episodes
    see none of it, and the thread is dead before the outcome reaches the driver (issue 47: a
    module-global URL and a thread per worker put 107 calls into 30 later episodes)."""
    rows = [{"case": "leaky", "n": i, "path": str(tmp_path / f"w{i}")} for i in range(6)]
    for i, row in enumerate(rows):
        pool.start(i, "http://x", row)
    got, t0 = {}, time.monotonic()
    sizes = {}
    while len(got) < 6 and time.monotonic() - t0 < 20:
        for jid, o in pool.results(1.0):
            got[jid] = o
            sizes[jid] = os.path.getsize(rows[jid]["path"])
    assert len(got) == 6 and all(o.error is None for o in got.values()), got
    for jid, o in got.items():
        assert o.value == dict(left=[], threads=1, env=None, cwd=o.value["cwd"]) and o.value["cwd"] != "/", o.value
    time.sleep(0.3)
    assert {jid: os.path.getsize(rows[jid]["path"]) for jid in got} == sizes  # no thread writes after its outcome


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


def test_cancel(pool, tmp_path):
    paths = [str(tmp_path / f"pid{i}") for i in range(2)]
    for i, path in enumerate(paths):
        pool.start(f"hang{i}", "http://x", {"case": "sleeps", "path": path})
    pool.start("queued", "http://x", {"case": "value"})
    t0 = time.monotonic()
    while not all(map(os.path.exists, paths)) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert pool.running() == 2 and pool.queued() == 1
    pool.cancel("queued")
    assert pool.queued() == 0
    for i in range(2):
        pool.cancel(f"hang{i}")
    time.sleep(0.3)
    assert pool.running() == 0 and pool.results(0.5) == []
    assert all(gone(int(open(p).read())) for p in paths)
    assert run_one(pool, {"case": "value"})[0].value == 1.5


@pytest.mark.parametrize("regime", ["cgroups", "fallback"])
def test_close_kills_hanging_agents(agents_dir, tmp_path, regime, capsys):
    t0 = time.monotonic()
    pool = make_pool(agents_dir, regime, limits=AgentLimits(timeout_s=1000))
    started = time.monotonic() - t0
    outcome, first = run_one(pool, {"case": "value"})  # the first episode forks its worker
    paths = [str(tmp_path / f"pid{i}") for i in range(2)]
    for i, path in enumerate(paths):
        pool.start(i, "http://x", {"case": "sleeps", "path": path})
    pool.start(2, "http://x", {"case": "sleeps"})
    while not all(map(os.path.exists, paths)) and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    worker_pids = [int(open(p).read()) for p in paths]
    cgroup_dirs = [d for w in pool._workers if w.cg for d in w.cg.paths.values()]
    assert len(cgroup_dirs) == (6 if regime == "cgroups" else 0)
    t1 = time.monotonic()
    pool.close()
    closing = time.monotonic() - t1
    assert closing < 2.0
    assert not any(psutil.pid_exists(p) for p in worker_pids + [pool._zygote.pid])
    assert not any(map(os.path.exists, cgroup_dirs))
    pool.close()
    with pytest.raises(RuntimeError):
        pool.start(3, "http://x", {"case": "value"})
    with capsys.disabled():
        print(f"\n[{regime}] zygote ready in {started * 1e3:.0f} ms; first episode (forks its worker) "
              f"{first * 1e3:.0f} ms; close with 2 hanging agents {closing * 1e3:.0f} ms")


def test_zygote_death_fails_the_jobs_not_the_driver(agents_dir, tmp_path):
    pool = make_pool(agents_dir, "cgroups" if CGROUPS else "fallback", limits=AgentLimits(timeout_s=1000))
    path = tmp_path / "pid"
    pool.start("hang", "http://x", {"case": "sleeps", "path": str(path)})
    t0 = time.monotonic()
    while not path.exists() and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    os.kill(pool._zygote.pid, signal.SIGKILL)
    dead = rf"^task\.agent could not run: its zygote process \(pid {pool._zygote.pid}\) exited$"
    [(job_id, outcome)] = pool.results(5.0)
    assert job_id == "hang" and re.search(dead, outcome.error), outcome
    assert gone(int(path.read_text()))
    outcome, wall = run_one(pool, {"case": "value"})
    assert re.search(dead, outcome.error) and wall < 0.1
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
