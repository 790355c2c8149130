"""reward.agents.runner.episode_reward (issue 47): an agent's reward is a real number within
task.agent_reward_bound; a bool, a non-number or a huge value is an error naming the value."""

from __future__ import annotations

import pytest

from reward.agents.runner import episode_reward


@pytest.mark.parametrize("value,reward", [(None, None), (1, 1.0), (0.5, 0.5), (-1e6, -1e6)])
def test_real_rewards_in_bounds_are_taken(value, reward):
    assert episode_reward(value, 1e6) == (reward, None)


@pytest.mark.parametrize("value,named", [(True, "returned True (bool)"), (False, "returned False (bool)"),
                                         ("1", "returned '1' (str)"), (float("nan"), "returned nan"),
                                         (1e30, "returned 1e+30, beyond task.agent_reward_bound=1e+06"),
                                         (-1e30, "returned -1e+30, beyond task.agent_reward_bound=1e+06")])
def test_bools_non_numbers_and_huge_rewards_are_errors_naming_the_value(value, named):
    reward, error = episode_reward(value, 1e6)
    assert reward is None and named in error, error
