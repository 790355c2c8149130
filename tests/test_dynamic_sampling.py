"""DAPO's dynamic sampling (rl/run/dynamic_sampling.py), the one policy the batch modes
(rl/run/collect.py) and the stream (rl/run/streaming.py, tests/test_streaming.py) follow: its
decisions and metrics by hand, then lock-step `collect` driven round by round through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl.config.schema import TrainConfig
from rl.data.types import GenerationRequest, Sample, ScoredSample
from rl.run.collect import collect
from rl.run.dynamic_sampling import DynamicSampling


def _group(gid: int, rewards: list[float | None]) -> list[ScoredSample]:
    out = []
    for k, r in enumerate(rewards):
        sample = Sample([1], [2], [-0.1], "stop", 0, "", "x", gid, k)
        out.append(ScoredSample(sample, r, {}, None if r is not None else "boom"))
    return out


def test_a_group_is_kept_only_when_its_rewards_differ():
    policy = DynamicSampling(2, max_rounds=3)
    assert policy.keeps(_group(0, [1.0, 0.0]))
    assert not policy.keeps(_group(0, [1.0, 1.0]))  # every advantage zero: set aside
    assert not policy.keeps(_group(0, [0.5, 0.5, 0.5]))
    assert not policy.keeps(_group(0, [1.0, None]))  # one valid sample: nothing to compare it with


def test_rounds_refills_and_the_fill():
    policy = DynamicSampling(2, max_rounds=3)  # P = 2: at most 6 groups looked at per step
    assert [policy.rounds_used_up(n) for n in (0, 2, 5, 6, 7)] == [False, False, False, True, True]
    # one more draw per set-aside group, at most (3 - 1) x 2 = 4 per step
    assert [policy.refills(n, steps=1) for n in (0, 3, 4, 9)] == [0, 3, 4, 4]
    assert policy.refills(9, steps=2) == 8
    assert DynamicSampling(2, max_rounds=1).refills(5, steps=3) == 0  # one round: no refills

    a, b, c, x, y, z = "abcxyz"  # kept groups a-c, set-aside x-z
    assert policy.choose([a, b, c], [x], looked=3) == [a, b]  # enough kept: at once
    assert policy.choose([a], [x, y], looked=4) is None  # rounds left: draw more
    assert policy.choose([a], [x, y], looked=6) == [a, x]  # rounds used up: kept first, then filled
    assert policy.choose([a], [x, y], looked=2, exhausted=True) == [a, x]  # nothing more can come
    assert policy.choose([], [x, y, z], looked=6) == [x, y]
    assert policy.choose([a], [], looked=6) is None  # too few even filled


def test_the_metrics_count_the_steps_groups():
    policy = DynamicSampling(2, max_rounds=3)
    assert policy.metrics(kept=1, looked=6) == {"dapo/sampling_rounds": 3.0, "dapo/looked_groups": 6.0,
                                                "dapo/informative_groups": 1.0, "dapo/filled_groups": 1.0}
    # more kept than a step takes: its P groups are all kept ones; 3 groups are 1.5 steps' worth
    assert policy.metrics(kept=3, looked=3) == {"dapo/sampling_rounds": 1.5, "dapo/looked_groups": 3.0,
                                                "dapo/informative_groups": 2.0, "dapo/filled_groups": 0.0}


def test_the_config_turns_it_on():
    cfg = TrainConfig()
    assert DynamicSampling.of(cfg) is None
    cfg.algorithm.dynamic_sampling, cfg.algorithm.max_sampling_rounds, cfg.task.prompts_per_step = True, 4, 8
    policy = DynamicSampling.of(cfg)
    assert (policy.P, policy.max_rounds) == (8, 4)


class _Rounds:
    """A prompt table and a fleet in one: round r of a step draws groups 2r, 2r + 1 (as
    `PromptDataset.requests` numbers them); a group in `flat` scores 1.0 for every sample, the
    others their sample index (0, 1: informative)."""

    curriculum = None

    def __init__(self, flat: set[int]):
        self.flat, self.rounds = flat, []

    def requests(self, step, P, n, sampling_round=0):
        self.rounds.append(sampling_round)
        return [GenerationRequest([step], f"p{g}", sampling_round * P + g, k, seed=k) for g in range(P)
                for k in range(n)]

    def run(self, requests):
        return [Sample(r.prompt_ids, [1], [-0.1], "stop", 0, r.prompt_text, "x", r.group_id, r.sample_index)
                for r in requests]

    def score(self, samples):
        return [ScoredSample(s, 1.0 if s.group_id in self.flat else float(s.sample_index)) for s in samples]


def _collect(flat: set[int], sampling: DynamicSampling | None):
    cfg = SimpleNamespace(task=SimpleNamespace(prompts_per_step=2), rollout=SimpleNamespace(n=2))
    rounds = _Rounds(flat)
    scored, generated, metrics = collect(cfg, rounds, rounds, rounds.score, sampling, 0)
    return sorted({s.sample.group_id for s in scored}), len(generated), rounds.rounds, metrics


@pytest.mark.parametrize("flat, groups, rounds, kept, looked", [
    (set(), [0, 1], [0], 2, 2),  # both informative: one round
    ({1}, [0, 2], [0, 1], 2, 4),  # round 0 keeps group 0, round 1 adds group 2 (and 3, not needed)
    ({1, 2, 3, 4, 5}, [0, 1], [0, 1, 2], 1, 6),  # 3 rounds, 1 kept: filled with the first set aside
    ({0, 1, 2, 3, 4, 5}, [0, 1], [0, 1, 2], 0, 6),  # nothing informative: all filled
])
def test_lock_step_collect_draws_rounds_until_the_policy_chooses(flat, groups, rounds, kept, looked):
    got, generated, drawn, metrics = _collect(flat, DynamicSampling(2, max_rounds=3))
    assert (got, drawn, generated) == (groups, rounds, 2 * 2 * len(rounds))
    assert metrics["dapo/sampling_rounds"] == len(rounds) and metrics["dapo/looked_groups"] == looked
    assert (metrics["dapo/informative_groups"], metrics["dapo/filled_groups"]) == (kept, 2 - kept)


def test_lock_step_collect_without_dynamic_sampling_takes_every_group():
    got, generated, drawn, metrics = _collect({0, 1}, None)
    assert (got, generated, drawn) == ([0, 1], 4, [0])
    assert not any(k.startswith("dapo/") for k in metrics)
