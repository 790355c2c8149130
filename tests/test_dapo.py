"""DAPO helpers against hand-computed values."""

import pytest
import torch

from rl.algo.dapo import informative_groups, overlong_penalty


def test_informative_groups_drop_all_equal_and_single_valid_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    # group 0: all 1 -> dropped; 1: {0, 1} -> kept; 2: all 0.5 -> dropped; 3: one valid -> dropped
    assert informative_groups(rewards, groups, valid) == [1]
    assert informative_groups(rewards, groups, torch.ones(8, dtype=torch.bool)) == [1, 3]


def test_overlong_penalty_is_soft_in_the_buffer():
    # budget 20, buffer 4: no penalty up to 16, then (16 - L) / 4, -1 from 20 on
    got = overlong_penalty(torch.tensor([5, 16, 17, 18, 20, 25]), max_len=20, buffer=4, factor=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_penalty(torch.tensor([20]), 20, 0).tolist() == [0.0]
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 4, 8)
