"""GRPO math against hand-computed values (rl/algo/advantages.py, rl/algo/losses.py, rl/algo/kl.py)."""

import math

import pytest
import torch

from rl.algo.advantages import ADVANTAGES, grpo_advantages, group_success_stats
from rl.algo.kl import KL_ESTIMATORS
from rl.algo.losses import LossNormalizer, aggregate, ppo_clip_loss


def test_grpo_group_normalization_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal -> 0
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_dr_grpo_is_mean_centred_only():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_invalid_samples_are_excluded_from_group_statistics():
    rewards = torch.tensor([2.0, 0.0, 100.0])
    valid = torch.tensor([True, True, False])
    adv = grpo_advantages(rewards, torch.zeros(3, dtype=torch.long), valid)
    # valid members [2, 0]: mean 1, unbiased std sqrt(2)
    assert adv.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0], abs=1e-5)


def test_flat_group_fraction():
    stats = group_success_stats(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4))
    assert stats["adv/flat_groups_frac"] == 0.5


def test_registry_names_the_config_field():
    assert ADVANTAGES.get("grpo") is grpo_advantages
    with pytest.raises(KeyError, match="algorithm.advantage='nope'"):
        ADVANTAGES.get("nope")


def test_ppo_clip_hand_values():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_loss(logp, old, adv, 0.2, 0.2)
    # ratio 1.5, A=+1 -> min(1.5, 1.2)=1.2; A=-1 -> min(-1.5,-1.2)=-1.5
    # ratio 0.5, A=+1 -> min(0.5, 0.8)=0.5; A=-1 -> min(-0.5,-0.8)=-0.8
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_ppo_clip_higher_uses_separate_upper_bound():
    loss, _ = ppo_clip_loss(torch.log(torch.tensor([1.5])), torch.zeros(1), torch.ones(1), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]))
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 1.0])


def test_kl_estimators_hand_values():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    d = math.log(2)
    assert KL_ESTIMATORS.get("k1")(logp, ref).item() == pytest.approx(d)
    assert KL_ESTIMATORS.get("k2")(logp, ref).item() == pytest.approx(d * d / 2)
    assert KL_ESTIMATORS.get("k3")(logp, ref).item() == pytest.approx(0.5 - 1 + d)
    same = KL_ESTIMATORS.get("k3")(logp, logp)
    assert same.item() == 0.0


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [("token_mean", 7 / 3), ("seq_mean_token_mean", (1.5 + 4) / 2), ("seq_mean_token_sum", (3 + 4) / 2)],
)
def test_aggregation_modes_hand_values(mode, expected):
    assert aggregate(PER_TOKEN, MASK, mode, LossNormalizer.of(MASK)).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_with_global_normalizer_sum_to_the_whole(mode):
    torch.manual_seed(0)
    per_token = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.4).float()
    mask[3] = 0  # a fully masked row (e.g. a sample whose reward failed)
    norm = LossNormalizer.of(mask)
    whole = aggregate(per_token, mask, mode, norm)
    parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], mode, norm) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_unknown_aggregation_names_the_field():
    with pytest.raises(KeyError, match="algorithm.loss_agg"):
        aggregate(PER_TOKEN, MASK, "sum", LossNormalizer.of(MASK))


def test_logprob_mismatch_warning_is_loud_only_above_threshold():
    from rl.run.step_metrics import logprob_mismatch_warning

    assert logprob_mismatch_warning(3, 0.01, 0.05) is None
    text = logprob_mismatch_warning(3, 0.2, 0.05)
    assert text.startswith("WARNING: step 3") and "trainer.logprob_warn_threshold=0.05" in text
