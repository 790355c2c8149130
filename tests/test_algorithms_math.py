"""Advantage estimators, policy/value losses, aggregation, KL estimators and controllers against
hand-computed values (the expected numbers are worked out in the comments, not by the formula)."""

import math

import pytest
import torch

from rl.algo.advantages import (
    ADVANTAGES,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    last_valid_index,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from rl.config.schema import AlgorithmConfig
from rl.algo.kl import KL_ESTIMATORS
from rl.algo.kl_control import KL_CONTROLLERS, AdaptiveKLController, FixedKLController, kl_controller_from_dict
from rl.algo.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossNormalizer,
    aggregate,
    entropy_from_logits,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
    with_entropy_bonus,
)

approx = pytest.approx


# ---- registries -----------------------------------------------------------------------------


def test_registries_list_every_algorithm():
    assert ADVANTAGES.names() == ["gae", "grpo", "reinforce_pp", "rloo"]
    assert {n: ADVANTAGES.entry(n).kind for n in ADVANTAGES.names()} == {
        "gae": "token", "grpo": "outcome", "reinforce_pp": "token", "rloo": "outcome"}
    assert ADVANTAGES.entry("gae").inputs == ("values",) and ADVANTAGES.entry("grpo").inputs == ("group_ids",)
    assert ADVANTAGES.settings("gae", AlgorithmConfig(gamma=0.5, lam=0.9)) == {
        "gamma": 0.5, "lam": 0.9, "whiten_advantages": True}
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip", "ppo_dual_clip"]
    assert POLICY_LOSSES.settings("ppo_dual_clip", AlgorithmConfig(clip_ratio_c=4.0))["clip_ratio_c"] == 4.0
    assert "clip_ratio_c" not in POLICY_LOSSES.settings("ppo_clip", AlgorithmConfig())


def test_a_registry_refuses_a_contract_the_config_cannot_see():
    """Names come only from rl/config/algorithm_names.py; kinds, inputs and settings are checked."""
    from rl.algo.registry import Registry

    fresh = Registry("advantage estimator", "algorithm.advantage", kinds=("outcome", "token"),
                     inputs=("group_ids", "values"))
    with pytest.raises(ValueError, match="add it to rl/config/algorithm_names.py"):
        fresh.register("my_adv", kind="outcome")
    with pytest.raises(ValueError, match="kind 'sample'"):
        fresh.register("grpo", kind="sample", inputs=("group_ids",))
    with pytest.raises(ValueError, match="unknown inputs"):
        fresh.register("grpo", kind="outcome", inputs=("group_ids", "rewards_model"))
    with pytest.raises(ValueError, match="make them agree"):  # the list says grpo needs group ids
        fresh.register("grpo", kind="outcome")
    with pytest.raises(ValueError, match="not AlgorithmConfig fields"):
        fresh.register("grpo", kind="outcome", inputs=("group_ids",), settings=("norm_by_sd",))
    with pytest.raises(ValueError, match="no list of names"):
        Registry("reward shaping", "algorithm.reward_shaping", kinds=("token",))
    fresh.register("grpo", kind="outcome", inputs=("group_ids",))(grpo_advantages)
    with pytest.raises(ValueError, match="registered twice"):
        fresh.register("grpo", kind="outcome", inputs=("group_ids",))(grpo_advantages)
    with pytest.raises(KeyError, match="algorithm.advantage='rloo': unknown advantage estimator; choose one of grpo"):
        fresh.get("rloo")
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "k3_clamped"]
    assert KL_CONTROLLERS.names() == ["adaptive", "fixed"]
    assert ADVANTAGES.get("rloo") is rloo_advantages


# ---- outcome-reward estimators ----------------------------------------------------------------

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])


def test_rloo_hand_values_with_flat_group_and_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 5.0])
    adv = rloo_advantages(rewards, GROUPS)
    # group 0, sample 0: others [0, 0, 1] mean 1/3 -> 1 - 1/3 = 2/3; sample 1: others [1, 0, 1] -> 0 - 2/3
    # group 1 all equal -> 0; group 2 has one member -> 0
    assert adv.tolist() == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], abs=1e-6)


def test_rloo_one_success_in_four():
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long))
    # sample 0: 1 - mean(0, 0, 0) = 1; others: 0 - mean(1, 0, 0) = -1/3
    assert adv.tolist() == approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-6)


def test_rloo_invalid_samples_are_no_baseline_and_get_zero():
    adv = rloo_advantages(torch.tensor([3.0, 1.0, 100.0]), torch.zeros(3, dtype=torch.long),
                          torch.tensor([True, True, False]))
    # valid [3, 1]: 3 - 1 = 2, 1 - 3 = -2; the invalid one gets 0
    assert adv.tolist() == approx([2.0, -2.0, 0.0])


def test_rloo_group_left_with_one_valid_member_gets_zero():
    adv = rloo_advantages(torch.tensor([3.0, 1.0]), torch.zeros(2, dtype=torch.long), torch.tensor([True, False]))
    assert adv.tolist() == [0.0, 0.0]


def test_grpo_one_success_in_four_and_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 5.0])
    adv = grpo_advantages(rewards, GROUPS)
    # group 0: mean 1/4; squared deviations 9/16 + 3 * 1/16 = 3/4; unbiased var 3/4 / 3 = 1/4, std 1/2
    # -> [0.75 / 0.5, -0.25 / 0.5, ...]; flat group and group of one -> 0
    assert adv.tolist() == approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-5)
    dr = grpo_advantages(rewards, GROUPS, norm_by_std=False)
    assert dr.tolist() == approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], abs=1e-6)


# ---- per-token rewards, returns, whitening ----------------------------------------------------

# row 0: one prompt position, three completion tokens, one pad; row 1: one completion token;
# row 2: a sample whose reward failed (all-zero mask)
TOK_MASK = torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])


def test_last_valid_index_handles_prompt_offset_padding_and_empty_rows():
    assert last_valid_index(TOK_MASK).tolist() == [3, 2, -1]


def test_token_level_rewards_outcome_at_last_valid_token_and_kl_penalty():
    kl = torch.tensor([[0.5, 0.1, 0.2, 0.3, 0.9], [0.4, 0.4, 0.5, 0.6, 0.7], [1.0] * 5])
    r = token_level_rewards(torch.tensor([1.0, -1.0, 7.0]), TOK_MASK, kl, kl_coef=0.1)
    # row 0: -0.1 * [0.1, 0.2, 0.3] on tokens 1..3, +1 at token 3 -> [0, -0.01, -0.02, 0.97, 0]
    # row 1: -0.1 * 0.5 - 1 = -1.05 at token 2; row 2: nothing (no valid token)
    assert r.tolist()[0] == approx([0, -0.01, -0.02, 0.97, 0], abs=1e-6)
    assert r.tolist()[1] == approx([0, 0, -1.05, 0, 0], abs=1e-6)
    assert r.tolist()[2] == [0.0] * 5
    plain = token_level_rewards(torch.tensor([1.0, -1.0, 7.0]), TOK_MASK)
    assert plain.tolist() == [[0, 0, 0, 1, 0], [0, 0, -1, 0, 0], [0] * 5]


def test_discounted_returns_hand_values():
    r = torch.tensor([[0, -0.01, -0.02, 0.97, 0], [0, 0, -1.05, 0, 0]])
    g = discounted_returns(r, TOK_MASK[:2], gamma=1.0)
    # reverse cumulative sum over the valid tokens: 0.97, 0.97 - 0.02 = 0.95, 0.95 - 0.01 = 0.94
    assert g.tolist()[0] == approx([0, 0.94, 0.95, 0.97, 0], abs=1e-6)
    assert g.tolist()[1] == approx([0, 0, -1.05, 0, 0], abs=1e-6)
    g = discounted_returns(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[1.0, 1, 1, 0]]), gamma=0.5)
    # G2 = 3; G1 = 2 + 0.5 * 3 = 3.5; G0 = 1 + 0.5 * 3.5 = 2.75; the padded 4 is ignored
    assert g.tolist()[0] == approx([2.75, 3.5, 3.0, 0.0])


def test_whiten_hand_values_and_shift_mean_false():
    x = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # valid [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    assert whiten(x, m).flatten().tolist() == approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    # scale only: (x - 3) / 2 + 3
    assert whiten(x, m, shift_mean=False).flatten().tolist() == approx([2.0, 3.0, 4.0, 0.0], abs=1e-6)


def test_reinforce_pp_whitens_returns_over_the_global_batch():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = reinforce_pp_advantages(r, m)
    # returns [[1, 1, 1], [2, 2, -]]; mean 7/5 = 1.4; squared deviations 3 * 0.16 + 2 * 0.36 = 1.2
    # unbiased var 1.2 / 4 = 0.3, std 0.5477226 -> -0.4 / std = -0.7302967, 0.6 / std = 1.0954451
    assert adv.tolist()[0] == approx([-0.7302967] * 3, abs=1e-5)
    assert adv.tolist()[1] == approx([1.0954451, 1.0954451, 0.0], abs=1e-5)


# ---- GAE ----------------------------------------------------------------------------------------

GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
GAE_VALUES = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.5, 9.0, 9.0, 9.0]])  # 9.0 sits on padding
GAE_MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])


def test_gae_lambda_one_is_return_minus_value():
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    # row 0: G = [1, 1, 1] -> A = [1 - 0.5, 1 - 0.6, 1 - 0.7] = [0.5, 0.4, 0.3]; returns = G
    # row 1: single token, G = 2 -> A = 1.5; the padding's values (9.0) are never bootstrapped from
    assert adv.tolist()[0] == approx([0.5, 0.4, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == approx([1.0, 1.0, 1.0, 0.0], abs=1e-6)
    assert adv.tolist()[1] == approx([1.5, 0, 0, 0], abs=1e-6)
    assert ret.tolist()[1] == approx([2.0, 0, 0, 0], abs=1e-6)


def test_gae_lambda_zero_is_one_step_td():
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=0.0)
    # delta_0 = 0 + 0.6 - 0.5 = 0.1; delta_1 = 0 + 0.7 - 0.6 = 0.1; delta_2 = 1 + 0 - 0.7 = 0.3
    assert adv.tolist()[0] == approx([0.1, 0.1, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == approx([0.6, 0.7, 1.0, 0.0], abs=1e-6)


def test_gae_skips_observation_tokens_inside_an_episode():
    """Model tokens at 0, 1 and 4, an observation at 2-3 (mask 0, with junk values and rewards
    that must be ignored), then padding: the recursion carries over the gap, as on the compacted
    trajectory [t0, t1, t4], instead of restarting at it."""
    rewards = torch.tensor([[0.0, 0.3, 7.0, 7.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t4: delta = 1 - 0.2 = 0.8 = A4
    # t1: delta = 0.3 + 0.9 * 0.2 - 0.4 = 0.08; A1 = 0.08 + 0.72 * 0.8 = 0.656
    # t0: delta = 0.9 * 0.4 - 0.5 = -0.14; A0 = -0.14 + 0.72 * 0.656 = 0.33232
    assert adv.tolist()[0] == approx([0.33232, 0.656, 0.0, 0.0, 0.8, 0.0], abs=1e-6)
    assert ret.tolist()[0] == approx([0.83232, 1.056, 0.0, 0.0, 1.0, 0.0], abs=1e-6)
    compact, compact_ret = gae_advantages(rewards[:, [0, 1, 4]], values[:, [0, 1, 4]], torch.ones(1, 3), 0.9, 0.8)
    assert adv[0, [0, 1, 4]].tolist() == approx(compact[0].tolist(), abs=1e-6)
    # REINFORCE++'s returns skip the gap the same way: G4 = 1, G1 = 0.3 + 0.9, G0 = 0.9 * 1.2
    g = discounted_returns(rewards, mask, gamma=0.9)
    assert g.tolist()[0] == approx([1.08, 1.2, 0.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_gae_general_gamma_lambda():
    adv, ret = gae_advantages(GAE_REWARDS[:1], GAE_VALUES[:1], GAE_MASK[:1], gamma=0.9, lam=0.5)
    # deltas: t2 = 1 - 0.7 = 0.3; t1 = 0.9 * 0.7 - 0.6 = 0.03; t0 = 0.9 * 0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.45 * 0.3 = 0.165; A0 = 0.04 + 0.45 * 0.165 = 0.11425
    assert adv.tolist()[0] == approx([0.11425, 0.165, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == approx([0.61425, 0.765, 1.0, 0.0], abs=1e-6)


def test_gae_ignores_prompt_positions_before_the_completion():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[3.0, 0.6, 0.7, 9.0]])  # 3.0 is a prompt position
    adv, ret = gae_advantages(rewards, values, torch.tensor([[0.0, 1, 1, 0]]), gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == approx([0.0, 0.4, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == approx([0.0, 1.0, 1.0, 0.0], abs=1e-6)


# ---- policy losses ------------------------------------------------------------------------------

DUAL_LOGP = torch.log(torch.tensor([4.0, 2.0, 4.0, 0.5]))
DUAL_ADV = torch.tensor([-1.0, -1.0, 1.0, -1.0])


def test_dual_clip_active_and_inactive():
    plain, flags = ppo_clip_loss(DUAL_LOGP, torch.zeros(4), DUAL_ADV)
    # r=4,A=-1: -min(-4, -1.2) = 4; r=2,A=-1: 2; r=4,A=+1: -min(4, 1.2) = -1.2; r=0.5,A=-1: -min(-0.5, -0.8) = 0.8
    assert plain.tolist() == approx([4.0, 2.0, -1.2, 0.8], abs=1e-6)
    assert flags.tolist() == [0.0, 0.0, 1.0, 1.0]
    logp = DUAL_LOGP.clone().requires_grad_(True)
    dual, flags = ppo_clip_loss(logp, torch.zeros(4), DUAL_ADV, clip_ratio_c=3.0)
    # only the first token (A<0, loss 4 > 3 * 1) is capped at 3; 2 < 3 stays; A>0 is untouched
    assert dual.tolist() == approx([3.0, 2.0, -1.2, 0.8], abs=1e-6)
    assert flags.tolist() == [1.0, 0.0, 1.0, 1.0]
    dual.sum().backward()
    # capped and clipped tokens carry no gradient; token 1: d(-r*A)/dlogp = -r*A = 2
    assert logp.grad.tolist() == approx([0.0, 2.0, 0.0, 0.0], abs=1e-6)
    registered, _ = POLICY_LOSSES.get("ppo_dual_clip")(DUAL_LOGP, torch.zeros(4), DUAL_ADV)
    assert registered.tolist() == approx([3.0, 2.0, -1.2, 0.8], abs=1e-6)


def test_dual_clip_needs_c_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(DUAL_LOGP, torch.zeros(4), DUAL_ADV, clip_ratio_c=1.0)


def test_clip_higher_is_asymmetric():
    logp = torch.log(torch.tensor([1.25, 1.5, 0.75, 0.7]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, flags = ppo_clip_loss(logp, torch.zeros(4), adv, clip_eps_low=0.2, clip_eps_high=0.28)
    # upper bound 1.28: 1.25 unclipped (-1.25), 1.5 clipped (-1.28);
    # lower bound 0.8: 0.75 and 0.7 with A=-1 -> -min(-0.75, -0.8) = 0.8, -min(-0.7, -0.8) = 0.8
    assert loss.tolist() == approx([-1.25, -1.28, 0.8, 0.8], abs=1e-6)
    assert flags.tolist() == [0.0, 1.0, 1.0, 1.0]
    symmetric, _ = ppo_clip_loss(logp[:1], torch.zeros(1), adv[:1], 0.2, 0.2)
    assert symmetric.item() == approx(-1.2)


GSPO_LOGP = torch.tensor([[0.1, 0.3, 5.0], [-0.2, 7.0, 7.0]])  # 5.0 and 7.0 sit on padding
GSPO_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_gspo_ratio_is_exp_of_mean_log_ratio_with_token_gradient():
    logp = GSPO_LOGP.clone().requires_grad_(True)
    loss, flags = gspo_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), 10.0, 10.0, mask=GSPO_MASK)
    # row 0: mean log-ratio (0.1 + 0.3) / 2 = 0.2 -> s = e^0.2 = 1.2214028 on every token
    # row 1: mean -0.2 -> s = e^-0.2 = 0.8187308; with A = 1 and wide clipping the loss is -s
    assert loss.tolist()[0][:2] == approx([-1.2214028, -1.2214028], abs=1e-6)
    assert loss.tolist()[1][0] == approx(-0.8187308, abs=1e-6)
    assert flags.sum().item() == 0
    (loss * GSPO_MASK).sum().backward()
    # d/dlogp_t of -sg[s] * exp(logp_t - sg[logp_t]) = -s on each valid token
    assert logp.grad.flatten().tolist() == approx([-1.2214028, -1.2214028, 0.0, -0.8187308, 0.0, 0.0], abs=1e-6)


def test_gspo_clips_with_its_small_default_eps():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, flags = POLICY_LOSSES.get("gspo")(GSPO_LOGP, torch.zeros(2, 3), adv, mask=GSPO_MASK)
    # row 0: s = 1.2214 > 1 + 4e-4 with A = +1 -> clipped at -(1.0004)
    # row 1: s = 0.8187 < 1 - 3e-4 with A = -1 -> -min(-0.8187, -0.9997) = 0.9997
    assert loss.tolist()[0][:2] == approx([-1.0004, -1.0004], abs=1e-6)
    assert loss.tolist()[1][0] == approx(0.9997, abs=1e-6)
    assert flags.tolist()[0][:2] == [1.0, 1.0] and flags.tolist()[1][0] == 1.0


def test_gspo_on_policy_value_is_plain_policy_gradient():
    loss, flags = gspo_loss(GSPO_LOGP, GSPO_LOGP, torch.full((2, 3), 2.0), mask=GSPO_MASK)
    assert loss.tolist()[0][:2] == approx([-2.0, -2.0]) and flags.sum().item() == 0


def test_gspo_needs_the_mask():
    with pytest.raises(ValueError, match="mask"):
        gspo_loss(GSPO_LOGP, GSPO_LOGP, torch.ones(2, 3))


# ---- entropy and value loss ---------------------------------------------------------------------


def test_entropy_from_logits_hand_values():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [100.0, 0.0]]])
    h = entropy_from_logits(logits)
    # uniform over 2: ln 2; probs [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616; one-hot: 0
    assert h.tolist()[0] == approx([0.6931472, 0.5623351, 0.0], abs=1e-6)
    masked = entropy_from_logits(logits, torch.tensor([[1.0, 0.0, 1.0]]))
    assert masked.tolist()[0] == approx([0.6931472, 0.0, 0.0], abs=1e-6)


def test_entropy_bonus_enters_before_aggregation():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    entropy = torch.tensor([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]])
    total = with_entropy_bonus(per_token, entropy, 0.1)
    assert total.tolist()[0][:2] == approx([0.95, 1.9])
    # token_mean: (0.95 + 1.9 + 3.8) / 3 = 6.65 / 3
    assert aggregate(total, mask, "token_mean", LossNormalizer.of(mask)).item() == approx(6.65 / 3)
    assert with_entropy_bonus(per_token, entropy, 0.0) is per_token


def test_clipped_value_loss_hand_values():
    values = torch.tensor([1.0, 1.0, 0.5, 2.0], requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.5, 2.0])
    returns = torch.tensor([2.0, 0.0, 1.0, 2.0])
    loss, flags = value_loss(values, old, returns, clip_eps_v=0.2)
    # t0: clipped V = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845 (clipped term wins)
    # t1: clipped V = 0.7; max((1-0)^2, 0.7^2) = 1 -> 0.5; t2: 0.5 * 0.25 = 0.125; t3: 0
    assert loss.tolist() == approx([0.845, 0.5, 0.125, 0.0], abs=1e-6)
    assert flags.tolist() == [1.0, 0.0, 0.0, 0.0]
    loss.sum().backward()
    # t0: the clipped value is constant in V -> 0; t1: V - R = 1; t2: 0.5 - 1 = -0.5
    assert values.grad.tolist() == approx([0.0, 1.0, -0.5, 0.0], abs=1e-6)
    plain, _ = value_loss(values.detach(), old, returns, clip_eps_v=None)
    assert plain.tolist() == approx([0.5, 0.5, 0.125, 0.0], abs=1e-6)


# ---- aggregation --------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_dr_grpo_normalizer_is_a_constant():
    norm = LossNormalizer.of(MASK, max_response_len=4)
    # (1 + 2) + 4 = 7 over 4 tokens * 2 sequences = 0.875, whatever the sampled lengths
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", norm).item() == approx(0.875)
    longer = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # one more token of loss 3 adds 3 / 8 exactly: the per-token weight does not depend on length
    assert aggregate(PER_TOKEN, longer, "seq_mean_token_sum_norm", LossNormalizer.of(longer, 4)).item() == approx(1.25)


def test_dr_grpo_normalizer_needs_the_generation_budget():
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", LossNormalizer.of(MASK))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_every_mode_splits_into_micro_batches_exactly(mode):
    torch.manual_seed(1)
    per_token = torch.randn(8, 6)
    mask = (torch.rand(8, 6) > 0.3).float()
    mask[2] = 0
    norm = LossNormalizer.of(mask, max_response_len=6)
    whole = aggregate(per_token, mask, mode, norm)
    for size in (1, 3, 4):
        parts = sum(aggregate(per_token[i : i + size], mask[i : i + size], mode, norm) for i in range(0, 8, size))
        assert parts.item() == approx(whole.item(), abs=1e-6)


# ---- KL estimators and controllers --------------------------------------------------------------


def test_k3_clamped_matches_k3_in_range_and_caps_outliers():
    logp, ref = torch.log(torch.tensor([0.5, 1e-7])), torch.log(torch.tensor([0.25, 1.0]))
    k3 = KL_ESTIMATORS.get("k3")(logp, ref)
    clamped = KL_ESTIMATORS.get("k3_clamped")(logp, ref)
    # token 0: 0.5 - 1 + ln 2; token 1: d = ln 1e-7, k3 = 1e7 - 1 + ln 1e-7 ~ 1e7 -> capped at 10
    assert clamped[0].item() == approx(0.5 - 1 + math.log(2))
    assert k3[1].item() > 1e6 and clamped[1].item() == 10.0


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(current_kl=1.0, n_steps=100) == 0.05
    assert kl_controller_from_dict(ctl.to_dict()).value == 0.05


def test_adaptive_kl_controller_hand_values():
    ctl = AdaptiveKLController(init_coef=0.1, target_kl=0.5, horizon=100)
    # error = 0.6 / 0.5 - 1 = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    assert ctl.update(0.6, 10) == approx(0.102)
    # error 3.0 is clipped to 0.2 -> 0.102 * 1.02 = 0.10404
    assert ctl.update(2.0, 10) == approx(0.10404)
    # error 0.45 / 0.5 - 1 = -0.1 -> 0.10404 * (1 - 0.01) = 0.1029996
    assert ctl.update(0.45, 10) == approx(0.1029996)
    # error -1 is clipped to -0.2 -> * 0.98 = 0.100939608
    assert ctl.update(0.0, 10) == approx(0.100939608)


def test_adaptive_kl_controller_state_survives_resume():
    ctl = AdaptiveKLController(0.1, 0.5, 100)
    ctl.update(0.6, 10)
    state = ctl.to_dict()
    assert state == {"kind": "adaptive", "value": approx(0.102), "target_kl": 0.5, "horizon": 100.0}
    resumed = kl_controller_from_dict(state)
    assert isinstance(resumed, AdaptiveKLController)
    assert resumed.update(2.0, 10) == ctl.update(2.0, 10) == approx(0.10404)


def test_adaptive_kl_controller_rejects_bad_target():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)


# CISPO: three tokens with log-ratios ln 0.5, 0, ln 2 (r = 0.5, 1, 2), advantages 1, -2, 3.
CISPO_OLD = torch.zeros(1, 3)
CISPO_LOGP = torch.tensor([[math.log(0.5), 0.0, math.log(2.0)]])
CISPO_ADV = torch.tensor([[1.0, -2.0, 3.0]])


def test_cispo_loss_and_flags_by_hand():
    """el=0.2, eh=0.28: weights clip(0.5)=0.8, 1, clip(2)=1.28; loss_t = -w_t * A_t * logp_t:
    -0.8*1*ln0.5 = 0.554518, -1*(-2)*0 = 0, -1.28*3*ln2 = -2.661685; tokens 0 and 2 clipped."""
    loss, flags = POLICY_LOSSES.get("cispo")(CISPO_LOGP, CISPO_OLD, CISPO_ADV, 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([0.554518, 0.0, -2.661685], abs=1e-6)
    assert flags.tolist() == [[1.0, 0.0, 1.0]]
    # the defaults (el=1: no lower bound, eh=0.28): r=0.5 is kept, so only token 2 is clipped
    loss, flags = POLICY_LOSSES.get("cispo")(CISPO_LOGP, CISPO_OLD, CISPO_ADV)
    assert loss[0, 0].item() == pytest.approx(-0.5 * math.log(0.5), abs=1e-6) and flags.tolist() == [[0.0, 0.0, 1.0]]


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it():
    """d loss_t / d logp_t = -w_t * A_t for every token, clipped ones too (the weight is a
    constant): -0.8, 2, -3.84. PPO's clip gives token 2 (r=2 > 1.28, A>0) no gradient at all."""
    logp = CISPO_LOGP.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES.get("cispo")(logp, CISPO_OLD, CISPO_ADV, 0.2, 0.28)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.8, 2.0, -3.84], abs=1e-6)
    ppo_logp = CISPO_LOGP.clone().requires_grad_(True)
    ppo, _ = POLICY_LOSSES.get("ppo_clip")(ppo_logp, CISPO_OLD, CISPO_ADV, 0.2, 0.28)
    ppo.sum().backward()
    assert ppo_logp.grad[0, 2].item() == 0.0


def test_cispo_config_composes():
    from tests.conftest import compose_config

    cfg = compose_config(["algorithm=cispo"])
    a = cfg.algorithm
    assert (a.policy_loss, a.advantage, a.loss_agg, a.kl_coef) == ("cispo", "grpo", "token_mean", 0.0)
    assert (a.clip_eps_low, a.clip_eps_high) == (1.0, 0.28)
