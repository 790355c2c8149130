"""The step-level advantage estimate against hand-computed values."""

import pytest
import torch

from rl.config.schema import AlgorithmConfig
from rl.algo.estimate import estimate_advantages

MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])  # prompt position, then completions, padding


def test_outcome_estimators_broadcast_to_completion_tokens():
    out = estimate_advantages(AlgorithmConfig(advantage="rloo"), torch.tensor([1.0, 0.0]), torch.tensor([True, True]),
                              torch.tensor([0, 0]), MASK)
    # rloo: 1 - 0 = 1 and 0 - 1 = -1
    assert out.advantages.tolist() == [[0, 1, 1, 0], [0, -1, -1, -1]] and out.returns is None


def test_kl_in_reward_lowers_the_sequence_reward_of_outcome_estimators():
    old = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, -1.0, -1.0, -1.0]])  # k1 = old - ref: 0.5 on one token
    s = AlgorithmConfig(advantage="rloo", kl_in_reward=True, kl_estimator="k1")
    out = estimate_advantages(s, torch.tensor([1.0, 1.0]), torch.tensor([True, True]), torch.tensor([0, 0]), MASK,
                              kl_coef=0.2, old_logprobs=old, ref_logprobs=ref)
    # rewards 1 - 0.2 * 0.5 = 0.9 and 1: rloo -0.1 and +0.1; mean k1 per token = 0.5 / 5
    assert out.advantages[0, 1].item() == pytest.approx(-0.1) and out.advantages[1, 3].item() == pytest.approx(0.1)
    assert out.metrics["actor/kl_in_reward_nats"] == pytest.approx(0.1)


def test_gae_with_whitening_and_returns():
    values = torch.tensor([[9.0, 0.5, 0.5, 9.0], [9.0, 0.0, 0.0, 0.0]])
    s = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    out = estimate_advantages(s, torch.tensor([1.0, 0.0]), torch.tensor([True, True]), torch.tensor([0, 1]), MASK,
                              values=values)
    # lam = gamma = 1: A_t = G_t - V_t; row 0: G = 1 at both tokens -> 0.5, 0.5; row 1: all 0
    assert out.advantages.tolist() == [[0, 0.5, 0.5, 0], [0, 0, 0, 0]]
    assert out.returns.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    whitened = estimate_advantages(AlgorithmConfig(advantage="gae", lam=1.0), torch.tensor([1.0, 0.0]),
                                   torch.tensor([True, True]), torch.tensor([0, 1]), MASK, values=values)
    a = whitened.advantages[MASK.bool()]
    assert a.mean().item() == pytest.approx(0.0, abs=1e-6) and a.std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="critic"):
        estimate_advantages(s, torch.tensor([1.0, 0.0]), torch.tensor([True, True]), torch.tensor([0, 1]), MASK)


def test_invalid_samples_get_nothing():
    out = estimate_advantages(AlgorithmConfig(advantage="reinforce_pp"), torch.tensor([5.0, float("nan")]),
                              torch.tensor([True, False]), torch.tensor([0, 1]), torch.tensor([[0.0, 1, 1, 0], [0, 0, 0, 0]]))
    assert torch.isfinite(out.advantages).all() and out.advantages[1].abs().sum() == 0


def test_episode_turn_rewards_sit_on_each_turn_s_last_token_for_gae():
    """An episode: model tokens 1-2, an observation at 3-4, model tokens 5-6. The environment
    rewarded turn 1 with 0.5 (on token 2) and turn 2 with 1.0; a reward function added 0.25, so
    the total is 1.75 and the 0.25 rest goes on the last token. lam = gamma = 1, values 0: the
    advantage is the reward-to-go, carried over the observation."""
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1, 0]])
    turns = torch.tensor([[0.0, 0, 0.5, 0, 0, 0, 1.0, 0]])
    s = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    out = estimate_advantages(s, torch.tensor([1.75]), torch.tensor([True]), torch.tensor([0]), mask,
                              values=torch.zeros(1, 8), turn_rewards=turns)
    assert out.advantages.tolist()[0] == pytest.approx([0, 1.75, 1.75, 0, 0, 1.25, 1.25, 0])
    # an outcome estimator sees the episode's total only
    grpo = estimate_advantages(AlgorithmConfig(advantage="rloo"), torch.tensor([1.75, 0.75]),
                               torch.tensor([True, True]), torch.tensor([0, 0]), mask.repeat(2, 1),
                               turn_rewards=turns.repeat(2, 1))
    assert grpo.advantages[0].tolist() == pytest.approx((mask[0] * 1.0).tolist())


def test_a_new_estimator_is_called_by_its_registered_contract(monkeypatch):
    """Adding an estimator is its registration plus its name in rl/config/algorithm_names.py: the
    step calls it by kind, with the inputs and settings it declares, and names none itself."""
    from rl.algo.advantages import ADVANTAGES
    from rl.config import algorithm_names

    monkeypatch.setattr(ADVANTAGES, "_entries", dict(ADVANTAGES._entries))  # registrations undone afterwards
    for name, needs in (("batch_mean", ()), ("token_critic", ("values",))):
        monkeypatch.setitem(algorithm_names.ADVANTAGE_NAMES, name, needs)
        monkeypatch.setitem(algorithm_names.ALGORITHM_CHOICES, "algorithm.advantage",
                            algorithm_names.ALGORITHM_CHOICES["algorithm.advantage"] + (name,))
    calls = {}

    @ADVANTAGES.register("batch_mean", kind="outcome", inputs=("ref_logprobs",), settings=("gamma",))
    def batch_mean(rewards, valid, ref_logprobs, gamma):
        calls["batch_mean"] = (valid.tolist(), ref_logprobs.dtype, gamma)
        return rewards - rewards.mean()

    @ADVANTAGES.register("token_critic", kind="token", inputs=("values",), settings={"discount": "lam"})
    def token_critic(token_rewards, mask, values, discount):
        calls["token_critic"] = discount
        return token_rewards - values, token_rewards * mask

    ref = torch.zeros(2, 4, dtype=torch.float64)
    out = estimate_advantages(AlgorithmConfig(advantage="batch_mean", gamma=0.5), torch.tensor([3.0, 1.0]),
                              torch.tensor([True, True]), torch.tensor([0, 1]), MASK, ref_logprobs=ref)
    assert out.advantages.tolist() == [[0, 1, 1, 0], [0, -1, -1, -1]] and out.returns is None
    assert calls["batch_mean"] == ([True, True], torch.float32, 0.5)
    with pytest.raises(ValueError, match="algorithm.advantage=batch_mean needs a reference model"):
        estimate_advantages(AlgorithmConfig(advantage="batch_mean"), torch.tensor([3.0, 1.0]),
                            torch.tensor([True, True]), torch.tensor([0, 1]), MASK)
    out = estimate_advantages(AlgorithmConfig(advantage="token_critic", lam=0.7), torch.tensor([2.0, 1.0]),
                              torch.tensor([True, True]), torch.tensor([0, 1]), MASK, values=torch.ones(2, 4))
    # reward on the last completion token, minus the value 1 on every completion token
    assert out.advantages.tolist() == [[0, -1, 1, 0], [0, -1, -1, 0]] and calls["token_critic"] == 0.7
    assert out.returns.tolist() == [[0, 0, 2, 0], [0, 0, 0, 1]]
    assert out.metrics["critic/returns_mean"] == pytest.approx(0.6)
