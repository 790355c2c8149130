"""Issue 58.5, rewards in bounds everywhere: a reward function's value (and the weighted sum) beyond
+-reward.bound is an error for that sample naming the function and the value; the advantage
estimators stay finite for any reward within the bound (also in fp32); a critic whose every
update is skipped counts toward trainer.max_skipped_steps like the policy; and a step that cannot
learn from its rewards says so on its step line. Values below are computed by hand."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from reward.scorer import RewardScorer
from rl.algo.advantages import grpo_advantages, group_success_stats, rloo_advantages, whiten
from rl.algo.estimate import estimate_advantages
from rl.config.compose import compose
from rl.config.schema import AlgorithmConfig, ConfigError, TrainConfig
from rl.data.types import Sample, ScoredSample
from rl.actors.faults import NotLearning
from rl.run.guards import StopGuards
from rl.log.run_log import no_learning_signal, summary_line
from rl.run.scoring import reward_metrics, reward_tensors, score_samples
from trainer.group import reduce_metrics

ALGORITHMS = sorted(os.path.basename(f)[:-5] for f in os.listdir(Path(__file__).parent.parent / "configs/algorithm"))

REWARDS = """
def huge(prompts, completions, value=1e300, **kwargs):
    # `value` for the completion "big", else its length
    return [value if c == "big" else float(len(c)) for c in completions]

def constant(prompts, completions, value=1.0, **kwargs):
    return [value] * len(completions)

def as_given(prompts, completions, given, **kwargs):
    return list(given)
"""


@pytest.fixture
def rewards_file(tmp_path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return str(path)


def sample(completion: str, group: int, index: int = 0, **metadata) -> Sample:
    ids = [ord(c) for c in completion]
    return Sample(prompt_ids=[1, 2], completion_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                  policy_version=0, prompt_text=f"prompt {group}", completion_text=completion, group_id=group,
                  sample_index=index, metadata=dict(metadata))


def two_groups() -> list[Sample]:
    """Group 0: "big" and rewards 1, 2, 3 (lengths); group 1: rewards 1, 1, 2, 2."""
    texts = [["big", "a", "bb", "ccc"], ["a", "a", "bb", "bb"]]
    return [sample(t, g, i) for g, row in enumerate(texts) for i, t in enumerate(row)]


# ---- the bound on reward functions (reward/scorer.py) ------------------------------------------


def test_a_value_beyond_the_bound_is_an_error_naming_the_function_and_the_value(rewards_file):
    scorer = RewardScorer([{"fn": f"{rewards_file}:huge"}])  # reward.bound's default, 1e6
    out = scorer.score([sample("big", 0), sample("a", 0, 1)])
    assert out[0].reward is None and out[0].error == (
        "reward.functions[0] huge returned 1e+300, beyond reward.bound=1e+06: return a reward within +-1e+06 "
        "(one this large overflows the update), or raise reward.bound")
    assert out[1].reward == 1.0 and out[1].error is None  # the others keep their rewards
    neg = RewardScorer([{"fn": "reward.builtin:format_number", "weight": 0.1},
                        {"fn": f"{rewards_file}:huge", "kwargs": {"value": -1e300}}]).score([sample("big", 0)])
    assert neg[0].error.startswith("reward.functions[1] huge returned -1e+300, beyond reward.bound=1e+06")


def test_the_bound_is_inclusive_and_configurable(rewards_file):
    at = RewardScorer([{"fn": f"{rewards_file}:constant", "kwargs": {"value": 1e6}}]).score([sample("x", 0)])
    assert at[0].reward == 1e6 and at[0].error is None
    past = RewardScorer([{"fn": f"{rewards_file}:constant", "kwargs": {"value": 1e6 + 1}}]).score([sample("x", 0)])
    assert "returned 1000001.0, beyond reward.bound=1e+06" in past[0].error
    raised = RewardScorer([{"fn": f"{rewards_file}:constant", "kwargs": {"value": 1e20}}], bound=1e30)
    assert raised.score([sample("x", 0)])[0].reward == 1e20
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match=r"reward.bound=.*: must be a positive finite number, e.g. reward.bound=1e6"):
            RewardScorer([{"fn": f"{rewards_file}:constant"}], bound=bad)


def test_the_weighted_sum_must_be_within_the_bound_too(rewards_file):
    both = [{"fn": f"{rewards_file}:constant", "name": "a", "kwargs": {"value": 8e5}},
            {"fn": f"{rewards_file}:constant", "name": "b", "kwargs": {"value": 8e5}, "weight": 0.5}]
    out = RewardScorer(both).score([sample("x", 0)])
    assert out[0].reward is None and out[0].error == (
        "the weighted sum of reward.functions (1 * 800000.0 + 0.5 * 800000.0 = 1200000.0) is beyond "
        "reward.bound=1e+06: lower reward.functions[i].weight, or raise reward.bound")
    assert out[0].components == {"a": 8e5, "b": 8e5}
    # a finite weight times a value within the bound can overflow: inf is beyond any bound
    inf = RewardScorer([{"fn": f"{rewards_file}:constant", "weight": 1e300, "kwargs": {"value": 1e10}}],
                       bound=1e30).score([sample("x", 0)])
    assert inf[0].reward is None and "= inf) is beyond reward.bound=1e+30" in inf[0].error


def test_an_integer_too_large_for_a_float_is_an_error_not_a_crash(rewards_file):
    out = RewardScorer([{"fn": f"{rewards_file}:as_given", "name": "g"}]).score(
        [sample("x", 0, given=10**400), sample("y", 0, 1, given=3)])
    assert out[0].error.startswith("g: returned 1000000000") and out[0].error.endswith("..., expected a finite "
                                                                                        "float or None")
    assert out[1].reward == 3.0


def test_reward_bound_is_validated_in_the_config():
    assert compose("train", []).reward.bound == 1e6
    for value in ("0", "-1", "1e31"):
        with pytest.raises(ConfigError, match=r"reward.bound=.*: must be in \(0, 1e\+30\], e.g. reward.bound=1e6"):
            compose("train", [f"reward.bound={value}"])


# ---- estimators without overflow (rl/algo/advantages.py) --------------------------------------


def test_group_std_of_huge_rewards_is_finite():
    g = torch.tensor([0, 0, 0, 0])
    # [1e6, 0, 0, 0]: mean 2.5e5, deviations 7.5e5, -2.5e5 x3, unbiased std sqrt(7.5e11 / 3) = 5e5
    assert grpo_advantages(torch.tensor([1e6, 0.0, 0.0, 0.0]), g).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # the same shape at 1e300 (before: std inf, every advantage 0)
    assert grpo_advantages(torch.tensor([1e300, 0.0, 0.0, 0.0], dtype=torch.float64), g).tolist() == \
        pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert grpo_advantages(torch.tensor([-1e300, 0.0, 0.0, 0.0], dtype=torch.float64), g).tolist() == \
        pytest.approx([-1.5, 0.5, 0.5, 0.5])
    # near float64's largest: the sum overflowed the mean (nan); in units of 1.7e308: [1, 1, 0, 0],
    # mean 0.5, unbiased std sqrt(1 / 3), advantages +-0.5 * sqrt(3) = +-0.8660254
    big = torch.tensor([1.7e308, 1.7e308, 0.0, 0.0], dtype=torch.float64)
    assert grpo_advantages(big, g).tolist() == pytest.approx([0.8660254, 0.8660254, -0.8660254, -0.8660254])
    # Dr.GRPO (no std): r - mean, in reward units
    assert grpo_advantages(torch.tensor([1e6, 0.0, 0.0, 0.0]), g, norm_by_std=False).tolist() == \
        [7.5e5, -2.5e5, -2.5e5, -2.5e5]
    # eps keeps its meaning: [1, 0] -> +-0.5 / (sqrt(0.5) + 1e-6)
    assert grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.1).tolist() == \
        pytest.approx([0.5 / (0.5**0.5 + 0.1), -0.5 / (0.5**0.5 + 0.1)])
    # RLOO: 1e6 - 0 and 0 - 1e6 / 3
    assert rloo_advantages(torch.tensor([1e6, 0.0, 0.0, 0.0]), g).tolist() == \
        pytest.approx([1e6, -1e6 / 3, -1e6 / 3, -1e6 / 3])


def test_whitening_in_fp32_does_not_overflow():
    mask = torch.ones(1, 4)
    # fp32: (7.5e19)^2 overflowed the variance, so every advantage was 0; now 1.5, -0.5 x3 as above
    out = whiten(torch.tensor([[1e20, 0.0, 0.0, 0.0]]), mask)
    assert out.dtype == torch.float32 and out.tolist()[0] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # masked entries stay 0 and do not count: [3, 1] -> mean 2, unbiased var 2
    out = whiten(torch.tensor([[3.0, 1.0, 1e30]]), torch.tensor([[1.0, 1.0, 0.0]]), shift_mean=False)
    s = (2 + 1e-8) ** 0.5
    assert out.tolist()[0] == pytest.approx([2 + 1 / s, 2 - 1 / s, 0.0])


def test_reinforce_pp_at_a_large_reward_within_the_bound_has_advantages():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    out = estimate_advantages(AlgorithmConfig(advantage="reinforce_pp"),
                              torch.tensor([1e30, 0.0]), torch.tensor([True, True]), torch.tensor([0, 1]), mask)
    # returns 1e30 on row 0's two tokens, 0 on row 1's three; in units of 1e30: mean 0.4, unbiased
    # var (2 * 0.36 + 3 * 0.16) / 4 = 0.3: 0.6 / sqrt(0.3) = 1.0954451, -0.4 / sqrt(0.3) = -0.7302967
    assert out.advantages.flatten().tolist() == pytest.approx([0, 1.0954451, 1.0954451, 0,
                                                               0, -0.7302967, -0.7302967, -0.7302967])
    assert out.metrics["adv/nonzero_frac"] == 1.0


# ---- the critic's skipped updates (trainer/group.py, rl/run/guards.py) -------------------------


def guards(max_skipped: int = 2) -> StopGuards:
    cfg = TrainConfig()
    cfg.trainer.max_skipped_steps, cfg.run.steps = max_skipped, 10
    return StopGuards(cfg, None)


def test_a_critic_whose_every_update_is_skipped_stops_the_run():
    # PPO during the critic's warm-up: no policy update; the critic's 2 updates both skipped
    ranks = [{"_updates/critic": 2.0, "_skipped/critic": 2.0, "_critic_tokens": 4.0, "critic/value_loss": 2.0,
              "_tokens": 4.0}] * 2
    metrics = reduce_metrics(ranks)
    assert metrics["critic/skipped_updates_count"] == 2 and metrics["critic/updates_count"] == 2
    assert metrics["actor/skipped_updates_count"] == 0
    assert "2 of 2 critic updates skipped (gradients not finite)" in summary_line(0, 4, metrics)
    scored = [ScoredSample(sample("a", 0), 1.0, {"f": 1.0})]  # its reward did not fail
    g = guards()
    g.record({"critic/value_loss": 0.5, "critic/updates_count": 2.0, "critic/skipped_updates_count": 0.0}, scored)
    for _ in range(2):
        g.record(metrics, scored)
    err = g.stopping(3)
    assert isinstance(err, NotLearning) and "trainer.max_skipped_steps=2" in str(err)
    assert "critic/value_loss 0.5" in str(err)  # the last step with finite figures


def test_a_critic_with_some_updates_applied_or_none_at_all_does_not_count():
    g = guards()
    some = reduce_metrics([{"_updates/critic": 2.0, "_skipped/critic": 1.0, "_updates": 1.0, "_tokens": 1.0}])
    assert some["critic/skipped_updates_count"] == 1
    for _ in range(3):
        scored = [ScoredSample(sample("a", 0), 1.0, {"f": 1.0})]
        g.record(some, scored)
        g.record(reduce_metrics([{"_updates": 1.0, "_tokens": 1.0}]), scored)  # no critic: no critic counts
    assert g.stopping(6) is None
    assert "critic/updates_count" not in reduce_metrics([{"_updates": 1.0, "_tokens": 1.0}])


# ---- the step line: no learning signal (rl/log/run_log.py) -------------------------------------


def test_the_step_line_names_why_a_step_cannot_learn():
    flat = {"reward/mean": 1.0, "adv/flat_groups_frac": 1.0, "adv/nonzero_frac": 0.0}
    assert summary_line(0, 3, flat).endswith("| no learning signal: every group's rewards are equal")
    assert no_learning_signal({"reward/errors_count": 8.0, "adv/flat_groups_frac": 1.0, "adv/nonzero_frac": 0.0}) \
        == "no learning signal: no sample has a reward (every one is an error)"
    assert no_learning_signal({"reward/mean": 1.0, "adv/flat_groups_frac": 0.5, "adv/nonzero_frac": 0.0}) \
        == "no learning signal: every advantage is 0"
    applied = {"actor/grad_norm": 0.0, "actor/updates_count": 1.0, "actor/skipped_updates_count": 0.0}
    assert no_learning_signal(applied) == "no learning signal: actor/grad_norm 0 (the update changed nothing)"
    # a skipped update's norm is recorded as 0: that is said as a skip, not as no signal
    assert no_learning_signal({**applied, "actor/skipped_updates_count": 1.0}) is None
    assert no_learning_signal({"actor/grad_norm": 0.3, "adv/nonzero_frac": 0.25, "adv/flat_groups_frac": 0.5}) is None


# ---- every algorithm, in-process: scoring -> estimator -> step line -----------------------------


def _config(algorithm: str, *overrides: str):
    teacher = ["algorithm.teacher_path=/teacher"] if algorithm == "opd" else []
    return compose("train", [f"algorithm={algorithm}", *teacher, *overrides])


def _estimate(cfg, scored, kl: float = 0.1):
    """The loop's estimate (rl/loop.py _step) on a batch whose loss mask is 3 completion tokens per
    sample (none for a failed one, as rl/data/batch.py builds it), with fixed log-probs (the
    reference's `kl` below the policy's) and values."""
    reward, valid, groups = reward_tensors(scored)
    n = len(scored)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]] * n) * valid[:, None]
    lp = torch.full((n, 4), -0.5)
    return estimate_advantages(cfg.algorithm, reward, valid, groups, mask, cfg.algorithm.kl_coef,
                               old_logprobs=lp, ref_logprobs=lp - kl,
                               values=torch.full((n, 4), 0.1) if cfg.algorithm.critic else None,
                               teacher_logprobs=lp + 0.1, student_logprobs=lp), mask


@pytest.mark.parametrize("value", [1e300, -1e300])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_refuses_a_huge_reward_naming_the_function(algorithm, value, rewards_file):
    cfg = _config(algorithm)
    scorer = RewardScorer([{"fn": f"{rewards_file}:huge", "name": "my_fn", "kwargs": {"value": value}}],
                          bound=cfg.reward.bound)
    scored = score_samples(cfg, scorer, two_groups())
    assert scored[0].reward is None and scored[0].error.startswith(
        f"reward.functions[0] my_fn returned {value!r}, beyond reward.bound=1e+06: ")
    assert all(s.error is None for s in scored[1:])
    est, mask = _estimate(cfg, scored)
    adv = est.advantages
    assert torch.isfinite(adv).all() and (adv[0] == 0).all() and est.metrics["adv/nonzero_frac"] > 0
    per_sample = adv[:, 1].tolist()
    # the rest of group 0 (rewards 1, 2, 3) and group 1 (1, 1, 2, 2) still learn, by hand:
    a = cfg.algorithm
    if a.advantage == "grpo" and a.distill_coef == 0:
        if a.norm_by_std:  # std 1 and sqrt(1/3): +-1 and +-0.5 * sqrt(3)
            expected = [0, -1, 0, 1, -0.8660254, -0.8660254, 0.8660254, 0.8660254]
        else:  # Dr.GRPO: r - mean
            expected = [0, -1, 0, 1, -0.5, -0.5, 0.5, 0.5]
        assert per_sample == pytest.approx(expected, abs=1e-5)
    elif a.advantage == "rloo":  # r - mean of the others (the KL term is the same for every sample)
        assert per_sample == pytest.approx([0, -1.5, 0, 1.5, -2 / 3, -2 / 3, 2 / 3, 2 / 3], abs=1e-5)
    assert no_learning_signal({**reward_metrics(scored), **est.metrics}) is None


@pytest.mark.parametrize("value", [1e30, -1e30])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_has_finite_advantages_at_the_largest_bound(algorithm, value, rewards_file):
    """reward.bound at its ceiling (1e30): a reward there is accepted and every estimator gives
    finite advantages that are not all 0 (REINFORCE++ and PPO's whitening were 0 in fp32)."""
    cfg = _config(algorithm, "reward.bound=1e30")
    scorer = RewardScorer([{"fn": f"{rewards_file}:huge", "kwargs": {"value": value}}], bound=cfg.reward.bound)
    scored = score_samples(cfg, scorer, two_groups())
    assert all(s.error is None for s in scored) and scored[0].reward == value
    est, _ = _estimate(cfg, scored)
    assert torch.isfinite(est.advantages).all() and est.metrics["adv/nonzero_frac"] > 0.5
    if est.returns is not None:
        assert torch.isfinite(est.returns).all()
    if cfg.algorithm.advantage == "grpo" and cfg.algorithm.norm_by_std and cfg.algorithm.distill_coef == 0:
        # group 0 in units of 1e30: [+-1, ~0, ~0, ~0] -> +-1.5, -+0.5 x3 (as [1e6, 0, 0, 0] above)
        sign = 1 if value > 0 else -1
        assert est.advantages[:4, 1].tolist() == pytest.approx([1.5 * sign] + [-0.5 * sign] * 3, abs=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_equal_rewards_say_no_learning_signal_where_they_zero_every_advantage(algorithm, rewards_file):
    cfg = _config(algorithm)
    scored = score_samples(cfg, RewardScorer([{"fn": f"{rewards_file}:constant"}]), two_groups())
    reward, valid, groups = reward_tensors(scored)
    est, _ = _estimate(cfg, scored, kl=0.0)  # no KL in the reward either
    metrics = {**reward_metrics(scored), **group_success_stats(reward, groups, valid), **est.metrics}
    line = summary_line(0, 3, metrics)
    # group-relative estimators (and REINFORCE++'s batch whitening) give equal rewards 0; a critic's
    # values (PPO) or a teacher (OPD) still give a signal
    zero = cfg.algorithm.advantage in ("grpo", "rloo", "reinforce_pp") and cfg.algorithm.distill_coef == 0
    assert (est.metrics["adv/nonzero_frac"] == 0) == zero
    assert ("no learning signal: every group's rewards are equal" in line) == zero, line


def test_an_environment_episode_beyond_the_bound_is_an_error(rewards_file):
    from rl.data.types import Turn

    cfg = TrainConfig()
    cfg.task.env = "my_env.py:Env"
    episodes = []
    for i, r in enumerate([2e6, 5.0]):
        s = sample("ab", 0, i)
        s.turns = [Turn("model", 0, 2, "ab", reward=r)]
        s.completion_mask = [1, 1]
        episodes.append(s)
    scored = score_samples(cfg, None, episodes)
    assert scored[0].reward is None and scored[0].error.startswith(
        "task.env=my_env.py:Env: the episode's turn rewards sum to 2000000.0, beyond reward.bound=1e+06")
    assert scored[1].reward == 5.0 and scored[1].error is None


HUGE_CRITIC_REWARD = '''
def huge(prompts, completions, **kwargs):
    return [1e30] * len(completions)
'''


@pytest.mark.slow
def test_ppo_stops_when_every_critic_update_overflows(make_config, tmp_path, capfd):
    """End to end (tiny model, 2 steps): rewards of 1e30 (reward.bound raised to allow them) overflow
    the critic's squared error during its warm-up, when the policy does not update; the step line
    says so and the run stops with NotLearning after trainer.max_skipped_steps (before: rc 0)."""
    from launch.train import train
    from rl.log.run_log import read_metrics

    reward_file = tmp_path / "huge.py"
    reward_file.write_text(HUGE_CRITIC_REWARD)
    cfg = make_config("run.steps=3", "task.prompts_per_step=4", "algorithm=ppo", "trainer.max_skipped_steps=2",
                      "reward.bound=1e30", f'reward.functions=[{{fn: "{reward_file}:huge"}}]')
    with pytest.raises(NotLearning, match=r"skipped every update for 2 steps in a row \(trainer.max_skipped_steps=2\)"):
        train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2
    assert all(m["critic/skipped_updates_count"] == m["critic/updates_count"] for m in metrics)
    assert "critic updates skipped (gradients not finite)" in capfd.readouterr().out
