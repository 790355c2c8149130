"""Every wait of the reward service, the environment service and the sandbox pool has a deadline
(issue 58, point 6): a worker that hangs while it starts, stops answering, or is not started again
after its process died is named (an ActorFailure: the group's worker, the call and the setting to
raise) instead of a wait without end. Real actors on a local Ray; the faults are real processes
that sleep, are stopped (SIGSTOP) or killed (SIGKILL)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from rl.actors.faults import ActorFailure, Deadlines

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

HANGS_ON_IMPORT = """
    import time

    time.sleep(600)  # a user's module that never finishes importing


    def reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)


    class Env:
        def step(self, text, token_ids):
            return None
"""

LOADS = """
    def reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)


    class Env:
        def step(self, text, token_ids):
            return None
"""


def _within(seconds: float, fn):
    """`fn()` in a thread: what it returned or raised, failing the test if it is still waiting
    after `seconds` (the old code waited without end here)."""
    got: dict = {}

    def run():
        try:
            got["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a wait without a deadline"
    return got


def _module(tmp_path, text: str) -> str:
    path = tmp_path / "user_module.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def stopped():
    """SIGSTOP a process; every stopped one is let go again at the end (so Ray can end it)."""
    pids: list[int] = []

    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        pids.append(pid)

    yield stop
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _named(err: BaseException, actor: str, phase: str, setting: str) -> None:
    assert isinstance(err, ActorFailure), repr(err)
    assert err.actor.startswith(actor) and phase in err.phase, str(err)
    assert setting in str(err), str(err)


def test_a_reward_worker_that_hangs_loading_is_named_at_the_start_deadline(ray_local, tmp_path):
    from reward import RewardFunctionSpec
    from reward.service import RewardService

    spec = RewardFunctionSpec(f"{_module(tmp_path, HANGS_ON_IMPORT)}:reward")
    t0 = time.monotonic()
    got = _within(90, lambda: RewardService([spec], num_workers=1, deadlines=Deadlines(start_s=4)))
    _named(got.get("error"), "reward worker 0", "start-up", "run.start_timeout_s")
    assert "no answer in 4 s" in str(got["error"]) and time.monotonic() - t0 < 60


def test_an_environment_worker_that_hangs_loading_is_named_at_the_start_deadline(ray_local, tmp_path):
    from reward.envs import EnvService

    env = f"{_module(tmp_path, HANGS_ON_IMPORT)}:Env"
    got = _within(90, lambda: EnvService(env, {}, num_workers=1, deadlines=Deadlines(start_s=4)))
    _named(got.get("error"), "environment worker 0", "start-up", "run.start_timeout_s")
    assert "task.env=" in got["error"].phase


def _stopped_worker_is_named(service, stop, role: str) -> None:
    """`where()` answers, then with the worker stopped it is an ActorFailure within a call's deadline
    (max(run.call_timeout_s, factor x the first where)), not a wait without end."""
    pid = service.where()[0]["pid"]
    stop(pid)
    t0 = time.monotonic()
    got = _within(60, service.where)
    _named(got.get("error"), f"{role} 0 (pid {pid})", "where", "run.call_timeout")
    assert time.monotonic() - t0 < 30


def test_stopped_reward_and_environment_workers_are_named_when_asked_where(ray_local, tmp_path, stopped):
    from reward import RewardFunctionSpec
    from reward.envs import EnvService
    from reward.service import RewardService

    module = _module(tmp_path, LOADS)
    deadlines = lambda: Deadlines(floor_s=2, factor=2, start_s=120)  # noqa: E731
    rewards = RewardService([RewardFunctionSpec(f"{module}:reward")], num_workers=1, deadlines=deadlines())
    try:
        _stopped_worker_is_named(rewards, stopped, "reward worker")
    finally:
        rewards.shutdown()
    envs = EnvService(f"{module}:Env", {}, num_workers=1, deadlines=deadlines())
    try:
        _stopped_worker_is_named(envs, stopped, "environment worker")
    finally:
        envs.shutdown()


def test_a_stopped_sandbox_worker_is_named_when_asked_where_or_how_many_jobs(ray_local, stopped):
    from sandbox.pool import SandboxPool, SandboxSettings

    pool = SandboxPool(SandboxSettings(backend="unsafe_local", num_workers=1, num_cpus_per_worker=0.25),
                       deadlines=Deadlines(floor_s=2, factor=2, start_s=120))
    try:
        assert pool.jobs_run() == 0
        _stopped_worker_is_named(pool, stopped, "sandbox worker")
        got = _within(60, pool.jobs_run)
        _named(got.get("error"), "sandbox worker 0", "count", "run.call_timeout")
    finally:
        pool.close()


def test_a_sandbox_pool_that_cannot_start_names_the_worker_the_setting_and_the_fix(ray_local):
    from sandbox.pool import SandboxPool, SandboxSettings

    settings = SandboxSettings(backend="unsafe_local", num_workers=1, resource="no-such-node-type")
    got = _within(60, lambda: SandboxPool(settings, deadlines=Deadlines(start_s=3)))
    _named(got.get("error"), "sandbox worker 0", "start-up", "run.start_timeout_s")
    assert "sandbox.resource" in str(got["error"])


class Restarting:
    """Starts once, once more after its first death; its third start never ends (a restart that
    hangs: e.g. a node without the memory the actor needs)."""

    def __init__(self, folder: str) -> None:
        starts = len(os.listdir(folder))
        open(os.path.join(folder, str(starts)), "w").close()
        if starts >= 2:
            time.sleep(600)

    def where(self) -> dict:
        return {"pid": os.getpid()}


def test_a_group_waits_for_a_restart_with_a_deadline(ray_local, tmp_path):
    """`ActorGroup.back`: Ray starts a killed actor again and the group learns its new process; a
    restart that does not finish is `hung` by run.start_timeout_s, and `failure` names it."""
    from ray import cloudpickle

    from rl.actors.group import ActorGroup

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor's class lives in this test file
    group = ActorGroup(ray, Restarting, 1, role="test worker", args=lambda i: (str(tmp_path),),
                       options={"num_cpus": 0, "max_restarts": -1}, deadlines=Deadlines(start_s=60))
    try:
        first = group.started().results[0]["pid"]
        os.kill(first, signal.SIGKILL)
        out = _within(90, lambda: group.back([0])).get("value")
        assert out is not None and list(out.results) == [0]
        assert group.where[0]["pid"] not in (None, first)
        os.kill(group.where[0]["pid"], signal.SIGKILL)  # its next start hangs
        t0 = time.monotonic()
        out = _within(60, lambda: group.back([0], deadline_s=4)).get("value")
        assert out is not None and list(out.hung) == [0] and time.monotonic() - t0 < 30
        err = group.failure(0, "restart", out)
        _named(err, "test worker 0", "restart", "run.start_timeout_s")
    finally:
        group.shutdown()


class NiceProbe:
    """An actor that reports its process's CPU priority (nice value)."""

    def niceness(self) -> int:
        return os.nice(0)

    def where(self) -> dict:
        return {"pid": os.getpid()}


def _lowering(out) -> None:
    """In a child process (a priority once lowered stays lowered): from nice 5, lowering to 3
    keeps 5, to 9 gives 9."""
    from rl.actors.group import lower_priority

    os.nice(5 - os.nice(0))
    out.put((lower_priority(3), lower_priority(9), os.nice(0)))


def test_lowering_priority_never_raises_it() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_lowering, args=(out,))
    p.start()
    try:
        assert out.get(timeout=60) == (5, 9, 9)
    finally:
        p.join(timeout=30)


@pytest.mark.slow
def test_actors_that_run_unvetted_code_run_at_lower_priority(ray_local):
    """The reward, environment and sandbox workers run users' and generated code: their group
    lowers each actor to `UNTRUSTED_NICENESS` before its constructor runs, while other actors keep
    the run's `cluster.worker_niceness` (0: the driver's priority). The class keeps its name."""
    from ray import cloudpickle

    from rl.actors.group import UNTRUSTED_NICENESS, ActorGroup

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor's class lives in this test file
    plain = ActorGroup(ray, NiceProbe, 1, role="probe", options={"num_cpus": 0})
    untrusted = ActorGroup(ray, NiceProbe, 1, role="untrusted probe", options={"num_cpus": 0},
                           niceness=UNTRUSTED_NICENESS)
    try:
        driver = os.nice(0)
        assert plain.ask("niceness") == [driver]
        assert untrusted.ask("niceness") == [max(driver, UNTRUSTED_NICENESS)]
        assert ray.get(untrusted.handles[0].__ray_call__.remote(lambda self: type(self).__name__)) == "NiceProbe"
    finally:
        plain.shutdown()
        untrusted.shutdown()
