"""One rollout path (rl/run/rollouts.py, rl/loop.py): every kind of sample scored by one function,
the schedules behind one face, environment episodes as a stream source."""

from __future__ import annotations

import threading
import time

import pytest

from rl.data.types import GenerationRequest, Sample, ScoredSample, Turn
from rl.loop import score_samples
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
        assert ahead.in_flight(whole=False) == {}  # the fleet broken: batches are made again on resume
        assert ahead.in_flight() == {1: 1}
    finally:
        ahead.close()


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

    source = EnvEpisodes(Episodes(), Fleet())
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
            while True:
                source.drain(0.1)
    finally:
        source.close()
