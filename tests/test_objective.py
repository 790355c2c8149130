"""The learner's objective (rl/algo/objective.py) branch by branch, on hand-computed values.

Every tensor is [B, T]. Log-probs are written as logs of probabilities so that the ratios are
round numbers: r = exp(logp - base) = p / p_base. PPO's clip band is [0.8, 1.2] unless said.
The normalizers are "global" (counting more tokens and sequences than the micro-batch holds), as
the learner's are, so a loss divided by the micro-batch's own counts would show.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rl.algo.losses import LossNormalizer
from rl.algo.objective import policy_objective, ratio_base, value_objective
from rl.config.schema import AlgorithmConfig

ON_POLICY = AlgorithmConfig(importance_correction="none", off_policy_steps=0, entropy_coef=0.0)


def _lp(*rows: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def test_ppo_clip_against_the_old_policy():
    logp = _leaf(_lp([0.75, 0.25, 0.9]))
    old = behaviour = _lp([0.5, 0.5, 0.5])  # r = 1.5, 0.5, (1.8 off-mask)
    adv = torch.tensor([[1.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_objective(logp, old, behaviour, adv, mask, ON_POLICY, LossNormalizer(tokens=4, sequences=2), 0.5)
    # token 0: -min(1.5 * 1, 1.2 * 1) = -1.2, clipped; token 1: -min(0.5, 0.8) = -0.5 (the low clip
    # does not bind for A > 0); token 2 is off the mask.
    assert out.pg_loss_sum == pytest.approx(-1.7)
    assert out.clipped_sum == 1.0
    assert out.loss.item() == pytest.approx(-1.7 / 4)  # the global token count, not the 2 here
    assert out.kl_sum is None  # no reference log-probs
    # no weights with importance_correction=none, but the ratio sums are reported: old == behaviour
    assert out.importance_sums == {"_is/w_sum": pytest.approx(2.0), "_is/w_sq_sum": pytest.approx(2.0)}
    out.loss.backward()
    # d/dlogp: token 0 clipped -> 0; token 1: -A * r / 4 = -0.5 / 4; token 2 off-mask -> 0
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.0])


def _off_policy_batch():
    logp = _lp([0.3, 0.3])
    old = _lp([0.3, 0.3])  # r against old: 1, 1
    behaviour = _lp([0.2, 0.6])  # r against behaviour: 1.5, 0.5
    return logp, old, behaviour, torch.ones(1, 2), torch.ones(1, 2)


def test_behaviour_clip_takes_the_ratio_against_the_behaviour_policy_when_off_policy():
    logp, old, behaviour, adv, mask = _off_policy_batch()
    algo = AlgorithmConfig(importance_correction="behaviour_clip", off_policy_steps=1)
    assert ratio_base(old, behaviour, algo) is behaviour
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 0.0)
    # r = 1.5 -> -1.2 (clipped), r = 0.5 -> -0.5
    assert out.pg_loss_sum == pytest.approx(-1.7)
    assert out.clipped_sum == 1.0
    assert out.loss.item() == pytest.approx(-0.85)
    # behaviour_clip puts no weight on the tokens; the ratio old/behaviour = 1.5, 0.5 is reported
    assert out.importance_sums == {"_is/w_sum": pytest.approx(2.0), "_is/w_sq_sum": pytest.approx(2.5)}


def test_behaviour_clip_on_policy_keeps_the_ratio_against_the_old_policy():
    logp, old, behaviour, adv, mask = _off_policy_batch()
    algo = AlgorithmConfig(importance_correction="behaviour_clip", off_policy_steps=0)
    assert ratio_base(old, behaviour, algo) is old
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 0.0)
    # r = 1, 1: -1 each, nothing clipped
    assert out.pg_loss_sum == pytest.approx(-2.0)
    assert out.clipped_sum == 0.0
    assert out.loss.item() == pytest.approx(-1.0)


def test_other_corrections_keep_the_old_policy_as_ratio_base_even_off_policy():
    logp, old, behaviour, adv, mask = _off_policy_batch()
    algo = AlgorithmConfig(importance_correction="none", off_policy_steps=2)
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 0.0)
    assert out.pg_loss_sum == pytest.approx(-2.0)  # r = 1, 1 as on-policy


def _exploded_ratio():
    # r = 5 on a negative advantage: PPO's clip does not bind (-min(-5, -1.2) = 5)
    return _leaf(_lp([0.5])), _lp([0.1]), torch.tensor([[-1.0]]), torch.ones(1, 1)


def test_dual_clip_caps_the_loss_of_negative_advantages_at_clip_ratio_c():
    logp, old, adv, mask = _exploded_ratio()
    algo = replace(ON_POLICY, policy_loss="ppo_dual_clip", clip_ratio_c=4.0)
    out = policy_objective(logp, old, old, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 0.0)
    # capped at -c * A = 4 (the config's c, not the loss's default 3), and flagged as clipped
    assert out.pg_loss_sum == pytest.approx(4.0)
    assert out.clipped_sum == 1.0
    assert out.loss.item() == pytest.approx(2.0)
    out.loss.backward()
    assert logp.grad.tolist() == [[0.0]]  # the cap is a constant


def test_plain_ppo_clip_ignores_clip_ratio_c():
    logp, old, adv, mask = _exploded_ratio()
    algo = replace(ON_POLICY, policy_loss="ppo_clip", clip_ratio_c=4.0)
    out = policy_objective(logp, old, old, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 0.0)
    assert out.pg_loss_sum == pytest.approx(5.0)
    assert out.clipped_sum == 0.0
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-(-1.0) * 5.0 / 2])  # -A * r / tokens


def test_token_tis_weights_each_token_by_its_capped_ratio():
    old = _lp([0.6, 0.3, 0.1])
    behaviour = _lp([0.2, 0.2, 0.1])  # old / behaviour = 3, 1.5, 1 -> weights min(., 2) = 2, 1.5, 1
    logp = _leaf(old)  # r against old = 1: pg loss -A = -1 per token
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    # off-policy: with token_tis the PPO ratio is still against old (against behaviour it would clip)
    algo = AlgorithmConfig(importance_correction="token_tis", tis_cap=2.0, off_policy_steps=1)
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=3, sequences=1), 0.0)
    assert out.pg_loss_sum == pytest.approx(-3.0)  # before the weights
    assert out.clipped_sum == 0.0
    assert out.loss.item() == pytest.approx(-(2.0 + 1.5 + 1.0) / 3)
    assert out.importance_sums == {
        "is/capped_frac": 1.0,
        "_is/w_sum": pytest.approx(3.0 + 1.5 + 1.0),
        "_is/w_sq_sum": pytest.approx(9.0 + 2.25 + 1.0),
    }
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2.0 / 3, -1.5 / 3, -1.0 / 3])  # -w * A * r / tokens


def test_seq_mask_drops_whole_sequences():
    # sequence 0: old / behaviour = 9, 1 -> geometric mean 3 > 2: dropped (its second token alone
    # would be fine); sequence 1: 1, 1 -> kept
    old = _lp([0.9, 0.5], [0.5, 0.5])
    behaviour = _lp([0.1, 0.5], [0.5, 0.5])
    logp = _leaf(old)
    adv, mask = torch.tensor([[1.0, 1.0], [2.0, 3.0]]), torch.ones(2, 2)
    algo = AlgorithmConfig(importance_correction="seq_mask", seq_mask_low=0.5, seq_mask_high=2.0)
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=5, sequences=2), 0.0)
    assert out.pg_loss_sum == pytest.approx(-(1.0 + 1.0 + 2.0 + 3.0))  # before the mask
    assert out.loss.item() == pytest.approx(-(2.0 + 3.0) / 5)
    assert out.importance_sums["is/masked_frac"] == 2.0
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -2.0 / 5, -3.0 / 5])


def _kl_batch():
    logp = _leaf(torch.tensor([[-1.0, -2.0]]))
    ref = torch.tensor([[-1.5, -2.0]])  # k1 = logp - ref = 0.5, 0
    return logp, ref, torch.ones(1, 2), torch.ones(1, 2)


def test_kl_term_uses_the_estimator_and_the_passed_coefficient():
    logp, ref, adv, mask = _kl_batch()
    algo = replace(ON_POLICY, kl_estimator="k1", kl_in_reward=False, kl_coef=0.001)
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, algo, LossNormalizer(tokens=2, sequences=1),
                           kl_coef=0.5, ref_logprobs=ref)
    # per token: pg -1 (r = 1) + 0.5 * k1 -> -0.75, -1.0
    assert out.kl_sum == pytest.approx(0.5)
    assert out.pg_loss_sum == pytest.approx(-2.0)  # the KL is not in the pg sum
    assert out.loss.item() == pytest.approx(-1.75 / 2)
    out.loss.backward()
    # pg: -A * r = -1; k1: +0.5 * 1 -> -0.5 per token, / 2 tokens
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25])


def test_k3_estimator_value():
    logp, ref, adv, mask = _kl_batch()
    algo = replace(ON_POLICY, kl_estimator="k3")
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, algo, LossNormalizer(tokens=2, sequences=1),
                           kl_coef=1.0, ref_logprobs=ref)
    k3 = math.exp(-0.5) - 1.0 + 0.5  # exp(ref - logp) - 1 - (ref - logp); the second token is 0
    assert out.kl_sum == pytest.approx(k3)
    assert out.loss.item() == pytest.approx((-2.0 + k3) / 2)


def test_no_kl_term_when_it_is_in_the_reward_or_there_is_no_reference():
    logp, ref, adv, mask = _kl_batch()
    norm = LossNormalizer(tokens=2, sequences=1)
    in_reward = replace(ON_POLICY, kl_estimator="k1", kl_in_reward=True)
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, in_reward, norm, 0.5, ref_logprobs=ref)
    assert out.kl_sum is None
    assert out.loss.item() == pytest.approx(-1.0)
    in_loss = replace(in_reward, kl_in_reward=False)
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, in_loss, norm, 0.5, ref_logprobs=None)
    assert out.kl_sum is None
    assert out.loss.item() == pytest.approx(-1.0)


def test_entropy_bonus_is_subtracted_per_token_and_gets_the_gradient():
    logp = _leaf(torch.tensor([[-1.0, -1.0]]))
    entropy = _leaf(torch.tensor([[2.0, 1.0]]))
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    algo = replace(ON_POLICY, entropy_coef=0.1)
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, algo, LossNormalizer(tokens=2, sequences=1),
                           0.0, entropy=entropy)
    # per token: -1 - 0.1 * H -> -1.2, -1.1
    assert out.loss.item() == pytest.approx(-2.3 / 2)
    assert out.pg_loss_sum == pytest.approx(-2.0)  # the bonus is not in the pg sum
    out.loss.backward()
    assert entropy.grad.flatten().tolist() == pytest.approx([-0.05, -0.05])


def test_no_entropy_bonus_without_a_coefficient():
    logp = _leaf(torch.tensor([[-1.0, -1.0]]))
    entropy = _leaf(torch.tensor([[2.0, 1.0]]))
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    norm = LossNormalizer(tokens=2, sequences=1)
    out = policy_objective(logp, logp.detach(), logp.detach(), adv, mask, ON_POLICY, norm, 0.0, entropy=entropy)
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    assert entropy.grad is None
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_objective(logp, logp.detach(), logp.detach(), adv, mask, replace(ON_POLICY, entropy_coef=0.1), norm, 0.0)


@pytest.mark.parametrize("mode, expected", [
    # per-token pg loss (r = 1): row 0 [-1, -2, off], row 1 [-3, off, off]; the global normalizer
    # counts 6 tokens, 4 sequences, a budget of 5 tokens
    ("token_mean", (-1 - 2 - 3) / 6),
    ("seq_mean_token_mean", (-3 / 2 + -3 / 1) / 4),
    ("seq_mean_token_sum", (-3 + -3) / 4),
    ("seq_mean_token_sum_norm", (-3 + -3) / (5 * 4)),
])
def test_each_aggregation_divides_by_the_global_normalizer(mode, expected):
    logp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])  # the 9s are off the mask
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    algo = replace(ON_POLICY, loss_agg=mode)
    norm = LossNormalizer(tokens=6, sequences=4, max_response_len=5)
    out = policy_objective(logp, logp, logp, adv, mask, algo, norm, 0.0)
    assert out.loss.item() == pytest.approx(expected)
    assert out.pg_loss_sum == pytest.approx(-6.0)


def test_the_gradient_goes_to_logp_only():
    logp = _leaf(_lp([0.5, 0.45]))
    old, behaviour = _leaf(_lp([0.5, 0.5])), _leaf(_lp([0.4, 0.5]))  # r against old: 1, 0.9
    adv, ref = _leaf(torch.tensor([[1.0, -1.0]])), _leaf(_lp([0.25, 0.5]))
    mask = torch.ones(1, 2)
    algo = replace(ON_POLICY, importance_correction="token_tis", kl_estimator="k1")
    out = policy_objective(logp, old, behaviour, adv, mask, algo, LossNormalizer(tokens=2, sequences=1), 1.0,
                           ref_logprobs=ref)
    assert out.loss.requires_grad
    out.loss.backward()
    assert all(t.grad is None for t in (old, behaviour, adv, ref))
    # weights old / behaviour = 1.25, 1; k1's gradient is 1. Token 0: -w * A * r + 1 = -1.25 + 1;
    # token 1 (r = 0.9 in the band): -w * A * r + 1 = 0.9 + 1; both / 2 tokens
    assert logp.grad.flatten().tolist() == pytest.approx([(-1.25 + 1.0) / 2, (0.9 + 1.0) / 2])


def test_value_objective_clips_around_the_old_values():
    values = _leaf(torch.tensor([[1.0, 2.0, 5.0]]))
    old = _leaf(torch.tensor([[0.0, 2.25, 0.0]]))
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # loss_agg is the policy's: the critic always averages over tokens
    algo = AlgorithmConfig(value_clip=0.5, loss_agg="seq_mean_token_sum")
    out = value_objective(values, old, returns, mask, algo, LossNormalizer(tokens=4, sequences=3))
    # token 0: plain (1 - 2)^2 = 1; clipped value 0 + clamp(1, +-0.5) = 0.5 -> (0.5 - 2)^2 = 2.25: the
    # larger, so 0.5 * 2.25, flagged. Token 1: V - V_old = -0.25 within the band -> both terms 1 -> 0.5
    assert out.loss.item() == pytest.approx((1.125 + 0.5) / 4)
    assert out.clipped_sum == 1.0
    assert out.abs_error_sum == pytest.approx(1.0 + 1.0)
    out.loss.backward()
    assert old.grad is None
    # token 0: the clipped term is flat in V; token 1: V - R = 1, / 4 tokens
    assert values.grad.flatten().tolist() == pytest.approx([0.0, 0.25, 0.0])


def test_value_objective_unclipped_when_value_clip_is_zero():
    values = torch.tensor([[1.0, 2.0, 5.0]])
    old = torch.tensor([[0.0, 2.25, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = value_objective(values, old, returns, mask, AlgorithmConfig(value_clip=0.0), LossNormalizer(4, 3))
    assert out.loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 4)
    assert out.clipped_sum == 0.0


def test_the_routers_load_balancing_loss_joins_by_the_micro_batch_s_token_share():
    """algorithm.router_aux_loss_coef (MoE): the micro-batch's mean load-balancing loss, weighted by
    its share of the mini-batch's tokens (2 of 4 here) and the coefficient, adds to the loss; its
    gradient flows; without the coefficient it is not asked for, with it it must be given."""
    logp = _leaf(_lp([0.75, 0.25]))
    old = behaviour = _lp([0.5, 0.5])
    adv, mask, norm = torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 1.0]]), LossNormalizer(tokens=4, sequences=2)
    plain = policy_objective(logp, old, behaviour, adv, mask, ON_POLICY, norm, 0.0)
    assert plain.router_aux is None
    aux = torch.tensor(0.8, requires_grad=True)
    algo = replace(ON_POLICY, router_aux_loss_coef=0.5)
    out = policy_objective(logp, old, behaviour, adv, mask, algo, norm, 0.0, router_aux=aux)
    assert out.router_aux == pytest.approx(0.8 * 2 / 4)
    assert out.loss.item() == pytest.approx(plain.loss.item() + 0.5 * 0.8 * 2 / 4)
    out.loss.backward()
    assert aux.grad.item() == pytest.approx(0.5 * 2 / 4)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        policy_objective(logp, old, behaviour, adv, mask, algo, norm, 0.0)
