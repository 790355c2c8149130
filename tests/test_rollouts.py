"""One rollout path (rl/run/rollouts.py, rl/loop.py): every kind of sample scored by one function,
the schedules behind one face, environment episodes as a stream source."""

from __future__ import annotations

import threading
import time

import pytest

from rl.data.types import GenerationRequest, Sample, ScoredSample, Turn
from rl.run.scoring import score_samples
from rl.run.pipeline import RolloutPipeline
from rl.run.rollouts import EnvEpisodes, LockStep
from tests.conftest import compose_config


class Functions:
    """Reward functions that give every sample 0.5 (what `RewardService.score` returns)."""

    def score(self, samples):
        return [ScoredSample(s, 0.5, {"half": 0.5}) for s in samples]


def _sample(i, turns=None, error=None, mask=None):
    ids = [5, 6, 7]
    return Sample([1, 2], ids, [-1.0] * 3, "stop", 0, "p", "c", i, 0, completion_mask=mask, turns=turns, error=error)


def test_every_kind_of_sample_is_scored_by_one_function():
    cfg = compose_config([])
    single = _sample(0)
    episode = _sample(1, turns=[Turn("model", 0, 1, "a", reward=1.0), Turn("observation", 1, 2, "o"),
                                Turn("model", 2, 3, "b", reward=2.0)], mask=[1, 0, 1])
    refused = Sample([1, 2], [], [], "stop", 0, "p", "", 2, 0, error="the rollout engine refused this request: x")
    failed_agent = _sample(3, turns=[], error="task.agent=m:f on prompt 'p': raised ValueError: no")
    scored = score_samples(cfg, Functions(), [single, episode, refused, failed_agent])
    assert (scored[0].reward, scored[0].components) == (0.5, {"half": 0.5})  # the functions' alone
    assert scored[1].reward == 0.5 + 3.0 and scored[1].components == {"half": 0.5, "env": 3.0}
    assert scored[2].reward is None and scored[2].error.startswith("the rollout engine refused")
    assert scored[3].reward is None and "raised ValueError" in scored[3].error
    # no reward functions: an episode's own rewards, and an agent that returned None is no reward at all
    no_reward = _sample(4, turns=[Turn("model", 0, 3, "a", reward=None)], mask=[1, 1, 1])
    alone = score_samples(cfg, None, [episode, no_reward])
    assert alone[0].reward == 3.0 and alone[1].reward is None and "no reward" in alone[1].error


def test_the_schedules_share_one_face():
    """LockStep, the ahead pipeline and the stream each take a step's batch, open a window for the
    weight sync, report what is in flight and close, the way rl/loop.py calls them. Every wait
    here has a deadline: a schedule that never delivers fails the test instead of hanging it."""
    from rl.run.rollouts import Rollouts
    from rl.run.streaming import StreamingRollouts
    from tests.test_streaming import QueueFleet, _draw, _score, _until

    made = []

    def produce(step):
        made.append(step)
        return [], [], {"time/rollout_s": 1.0}

    lock_step = LockStep(produce)
    assert lock_step.take(3)[2] == {"time/rollout_s": 1.0, "time/wait_rollout_s": 0.0}  # made now: no wait
    with lock_step.between_batches():
        pass
    assert lock_step.in_flight() == {} and made == [3]

    repairs = []
    slow = threading.Event()

    def produce_slowly(step):
        slow.wait(2)
        return step

    ahead = RolloutPipeline(produce_slowly, depth=1, end=5, repair=lambda: repairs.append(1), poll_s=0.01)
    try:
        threading.Timer(0.2, slow.set).start()
        assert ahead.take(0) == 0 and len(repairs) >= 5  # the driver repairs while it waits
        with ahead.between_batches():
            pass
        assert ahead.in_flight(whole=False) == {}  # the fleet broken: batches are made again on resume
        assert ahead.in_flight() == {1: 1}
    finally:
        ahead.close()

    fleet = QueueFleet()
    stream = StreamingRollouts(fleet, _draw(2, 2), _score, groups_per_step=2, max_staleness=1, start_step=0,
                               steps=3, poll_s=0.01, stall_s=5.0)
    try:
        _until(lambda: fleet.started_groups() == {0, 1, 2, 3})  # two steps' prompts: the learner at 0, k=1
        fleet.finish()
        scored, samples, figures = stream.take(0)
        assert sorted(s.sample.group_id for s in scored) == [0, 0, 1, 1] and len(samples) == 4
        assert "time/rollout_s" in figures
        with stream.between_batches():  # engines pause with their requests kept: no boundary
            pass
        kept = stream.in_flight()["streaming"]
        assert {g.requests[0].group_id for g in kept["ready"]} | {r.group_id for r in kept["pending"]} == {2, 3}
    finally:
        stream.close()
    assert not stream._thread.is_alive()
    face = [name for name in vars(Rollouts) if not name.startswith("_")]
    assert sorted(face) == ["between_batches", "close", "in_flight", "take"]
    for schedule in (lock_step, ahead, stream):
        assert all(callable(getattr(schedule, name)) for name in face), schedule


def test_environment_episodes_stream_batch_by_batch_and_a_failed_batch_raises():
    class Episodes:
        def run(self, requests, generate):
            if requests[0].group_id == 9:
                raise RuntimeError("the fleet is gone")
            time.sleep(0.05)
            return [_sample(r.group_id) for r in requests]

    class Fleet:
        repaired = 0

        def generate(self, requests):
            raise AssertionError("Episodes.run calls it")

        def repair(self):
            self.repaired += 1

    fleet = Fleet()
    source = EnvEpisodes(Episodes(), fleet, fleet)
    try:
        source.submit([GenerationRequest([1], "p", g, 0, seed=g) for g in (0, 1)])
        source.submit([GenerationRequest([1], "p", 2, 0, seed=2)])
        got = []
        end = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < end:
            got += source.drain(0.1)
        assert sorted(s.group_id for s in got) == [0, 1, 2]
        source.submit([GenerationRequest([1], "p", 9, 0, seed=9)])
        with pytest.raises(RuntimeError, match="the fleet is gone"):
            end = time.monotonic() + 5  # a source that swallowed the error fails here, not hangs
            while time.monotonic() < end:
                source.drain(0.1)
    finally:
        source.close()


def test_a_blocking_run_waits_on_a_helper_thread_while_this_thread_repairs():
    """`repaired_while`: the work (a fleet call that lost its worker) waits for the replacement,
    which only the caller's thread makes; the caller polls `repair` until the work ends, and the
    work's error reaches the caller. Without the polling the work would wait forever."""
    from rl.run.rollouts import Completions, repaired_while

    class Repairs:
        def __init__(self):
            self.threads, self.done = set(), threading.Event()

        def repair(self):
            self.threads.add(threading.get_ident())
            self.done.set()  # the replacement is up: the waiting call goes on

    class Fleet:
        def generate(self, requests):
            assert threading.current_thread() is not threading.main_thread()
            assert repairs.done.wait(10), "nobody repaired"
            return ["sample"] * len(requests)

    repairs = Repairs()
    assert Completions(Fleet(), repairs).run([1, 2]) == ["sample", "sample"]
    assert repairs.threads == {threading.get_ident()}  # repaired on the caller's thread only
    with pytest.raises(ValueError, match="the engine's own error"):
        repaired_while(lambda: (_ for _ in ()).throw(ValueError("the engine's own error")), repairs, poll_s=0.01)
