"""A step's samples scored, one way for every kind (completions, environment and agent
episodes), and the reward's tensors and metrics the loop and the schedules read."""

from __future__ import annotations

import statistics

import torch

from rl.algo.dapo import informative_groups, overlong_penalty
from rl.config.schema import TrainConfig
from rl.data.episodes import with_episode_rewards
from rl.data.types import Sample, ScoredSample


def score_samples(cfg: TrainConfig, rewards, samples: list[Sample]) -> list[ScoredSample]:
    """Every kind of sample scored one way: the reward functions (`rewards.score`, None when only
    the episodes reward), plus an episode's turn rewards (an environment's or an agent's), plus
    DAPO's overlong penalty. A sample that failed (its episode, or a request the engine refused)
    keeps its error and gets no reward."""
    functions = rewards.score(samples) if rewards is not None else None
    if functions is not None and not any(s.turns is not None or s.error is not None for s in samples):
        return shape_rewards(cfg, functions)
    return shape_rewards(cfg, bound_episode_rewards(cfg, with_episode_rewards(samples, functions)))


def bound_episode_rewards(cfg: TrainConfig, scored: list[ScoredSample]) -> list[ScoredSample]:
    """An environment's turn rewards (component "env"), summed, within +-reward.bound, as the reward
    functions' are (reward/scorer.py); past it the sample is an error naming the value. An agent's
    reward has its own bound (task.agent_reward_bound, reward/agents/runner.py)."""
    if cfg.task.agent:
        return scored
    bound = cfg.reward.bound
    for s in scored:
        env = s.components.get("env")
        if s.error is None and env is not None and not abs(env) <= bound:
            s.reward, s.error = None, (f"task.env={cfg.task.env}: the episode's turn rewards sum to {env!r}, beyond "
                                       f"reward.bound={bound:g}: return turn rewards within +-{bound:g} (one this "
                                       "large overflows the update), or raise reward.bound")
    return scored


def shape_rewards(cfg: TrainConfig, scored: list[ScoredSample]) -> list[ScoredSample]:
    """DAPO's overlong penalty, added to every scored sample's reward."""
    a = cfg.algorithm
    if a.overlong_buffer <= 0:
        return scored
    lengths = torch.tensor([len(s.sample.completion_ids) for s in scored])
    penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    for s, p in zip(scored, penalty.tolist()):
        if s.error is None:
            s.components["overlong_penalty"] = p
            s.reward = s.reward + p
    return scored


def by_group(scored: list[ScoredSample]) -> dict[int, list[ScoredSample]]:
    groups: dict[int, list[ScoredSample]] = {}
    for s in scored:
        groups.setdefault(s.sample.group_id, []).append(s)
    return groups


def reward_tensors(scored: list[ScoredSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, valid, group ids): a failed sample is invalid, its reward 0."""
    valid = torch.tensor([s.error is None for s in scored])
    reward = torch.tensor([s.reward if s.error is None else 0.0 for s in scored], dtype=torch.float64)
    groups = torch.tensor([s.sample.group_id for s in scored])
    return reward, valid, groups


def informative(group: list[ScoredSample]) -> bool:
    """DAPO's filter: the group's rewards are not all equal (its advantages are not all zero)."""
    reward, valid, ids = reward_tensors(group)
    return bool(informative_groups(reward, ids, valid))


def reward_metrics(scored: list[ScoredSample]) -> dict[str, float]:
    ok = [s for s in scored if s.error is None]
    out: dict[str, float] = {"reward/errors_count": float(len(scored) - len(ok))}
    if ok:
        out["reward/mean"] = statistics.fmean(s.reward for s in ok)
        out["reward/std"] = statistics.pstdev([s.reward for s in ok])
        for name in ok[0].components:
            values = [s.components.get(name) for s in ok if s.components.get(name) is not None]
            if values:
                out[f"reward/{name}_mean"] = statistics.fmean(values)
    return out
