"""Bradley-Terry loss, pairwise accuracy and the tiny preference task, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algo.preference import bradley_terry_loss, pairwise_accuracy, preference_metrics
from examples.preference import WRONG_KINDS, answer_distance, preference_splits


def _nll(x: float) -> float:
    """-log sigmoid(x), written out."""
    return math.log(1.0 + math.exp(-x))


def test_bt_loss_matches_hand_values() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # gaps 2, 0, -2: log(1+e^-2) = 0.126928, log 2 = 0.693147, log(1+e^2) = 2.126928
    per_pair = bradley_terry_loss(chosen, rejected, reduction="none")
    assert per_pair.tolist() == pytest.approx([0.126928, 0.693147, 2.126928], abs=1e-6)
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx((0.126928 + 0.693147 + 2.126928) / 3, abs=1e-6)
    assert float(bradley_terry_loss(chosen, rejected, reduction="sum")) == pytest.approx(2.947003, abs=1e-5)
    # the loss only sees the gap
    assert torch.allclose(bradley_terry_loss(chosen + 5, rejected + 5, reduction="none"), per_pair)


def test_bt_loss_with_margin() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    # constant margin 1: gaps become 1 and -1
    assert bradley_terry_loss(chosen, rejected, 1.0, reduction="none").tolist() == pytest.approx(
        [_nll(1.0), _nll(-1.0)], abs=1e-6)
    assert [_nll(1.0), _nll(-1.0)] == pytest.approx([0.313262, 1.313262], abs=1e-6)
    # per-pair margins (Llama 2 style)
    got = bradley_terry_loss(chosen, rejected, torch.tensor([0.5, -3.0]), reduction="none")
    assert got.tolist() == pytest.approx([_nll(1.5), _nll(3.0)], abs=1e-6)


def test_bt_loss_gradient_and_stability() -> None:
    chosen = torch.tensor([0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([0.0, -1.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    # d/dc mean(-logsig(c - r)) = -sigmoid(r - c) / n: gaps 0 and 2
    expected = [-0.5 / 2, -(1 / (1 + math.exp(2.0))) / 2]
    assert chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected], abs=1e-6)
    huge = bradley_terry_loss(torch.tensor([0.0, 200.0]), torch.tensor([200.0, 0.0]), reduction="none")
    assert huge.tolist() == pytest.approx([200.0, 0.0], abs=1e-4)  # no inf / nan


def test_bt_loss_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="reduction"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(2), reduction="max")


def test_pairwise_accuracy_counts_ties_as_half() -> None:
    chosen, rejected = torch.tensor([3.0, 1.0, 2.0, 5.0]), torch.tensor([1.0, 1.0, 4.0, 0.0])
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(2.5 / 4)  # win, tie, loss, win
    assert pairwise_accuracy(torch.zeros(5), torch.zeros(5)) == 0.5  # a constant model is at chance
    assert math.isnan(pairwise_accuracy(torch.zeros(0), torch.zeros(0)))


def test_preference_metrics() -> None:
    m = preference_metrics(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert m["loss"] == pytest.approx((_nll(2.0) + _nll(-1.0)) / 2, abs=1e-6)
    assert m["pairwise_accuracy"] == 0.5
    assert m["reward_gap_mean"] == pytest.approx(0.5)
    assert m["chosen_reward_mean"] == pytest.approx(1.0) and m["rejected_reward_mean"] == pytest.approx(0.5)


def test_answer_distance() -> None:
    assert answer_distance("37+25=", "62") == 0
    assert answer_distance("37+25=", " 72 ") == 10
    assert answer_distance("37+25=", "52") == 10
    assert answer_distance("37+25=", "") == math.inf
    assert answer_distance("37+25=", "6+2") == math.inf


def test_preference_splits_are_labelled_right_disjoint_and_deterministic() -> None:
    train, test = preference_splits(600, 200, seed=3)
    assert len(train) == 600 and len(test) == 200
    assert preference_splits(600, 200, seed=3) == (train, test)
    assert preference_splits(600, 200, seed=4)[0] != train
    assert not {p.prompt for p in train} & {p.prompt for p in test}  # held-out prompts
    for p in train + test:
        d_chosen, d_rejected = answer_distance(p.prompt, p.chosen), answer_distance(p.prompt, p.rejected)
        assert d_chosen < math.inf and d_chosen < d_rejected
        assert d_rejected >= 3  # never a +/-1 or 2 near miss (below what the tiny RM can resolve)
        if p.kind.startswith("correct>"):
            assert d_chosen == 0 and p.kind.split(">")[1] in WRONG_KINDS
        else:
            assert d_chosen > 0 and d_rejected >= 2 * d_chosen + 5
        assert set(p.chosen + p.rejected) <= set("0123456789+=")  # the tiny tokenizer's symbols
    kinds = {p.kind for p in train}
    assert {"correct>carry", "correct>far", "correct>near", "correct>swap", "correct>malformed"} <= kinds
    assert any(k.startswith("wrong>") for k in kinds)
