"""DAPO's dynamic sampling, the one policy both schedules follow (lock-step or ahead:
rl/run/collect.py; streaming: rl/run/streaming.py).

A group whose rewards are all equal has every advantage zero: it is set aside and more prompts
are drawn instead, up to `algorithm.max_sampling_rounds` steps' worth of groups looked at per
step. A step takes P = `task.prompts_per_step` kept groups as soon as there are that many; once
the rounds are used up (or nothing more can come) it is filled up with set-aside groups, so its
size stays fixed. The schedules decide only when groups arrive; what to keep, when to fill, how,
and what is logged are decided here.
"""

from __future__ import annotations

from typing import TypeVar

from rl.config.schema import TrainConfig
from rl.data.types import ScoredSample
from rl.run.scoring import informative

G = TypeVar("G")  # a group, as the schedule holds it


class DynamicSampling:
    def __init__(self, groups_per_step: int, max_rounds: int):
        """`groups_per_step`: P, the groups a step trains on; `max_rounds`: at most this many
        steps' worth of groups are looked at per step before set-aside ones fill it."""
        self.P, self.max_rounds = groups_per_step, max_rounds

    @classmethod
    def of(cls, cfg: TrainConfig) -> DynamicSampling | None:
        """The policy `algorithm.dynamic_sampling` turns on, or None (every group counts)."""
        if not cfg.algorithm.dynamic_sampling:
            return None
        return cls(cfg.task.prompts_per_step, cfg.algorithm.max_sampling_rounds)

    def keeps(self, group: list[ScoredSample]) -> bool:
        """A group is kept when its rewards are not all equal; otherwise it is set aside."""
        return informative(group)

    def rounds_used_up(self, looked: int) -> bool:
        """`looked` groups finished since the previous step: no more may be drawn for this one."""
        return looked >= self.max_rounds * self.P

    def refills(self, set_aside: int, steps: int) -> int:
        """How many more groups may be drawn, for `set_aside` groups set aside over `steps` steps:
        one for each, up to `max_rounds - 1` steps' worth per step (what the rounds allow)."""
        return min(set_aside, steps * (self.max_rounds - 1) * self.P)

    def choose(self, kept: list[G], set_aside: list[G], looked: int, exhausted: bool = False) -> list[G] | None:
        """The step's P groups, kept ones first, or None while it should wait for more: set-aside
        ones fill it only once the rounds are used up or nothing more can come (`exhausted`)."""
        if len(kept) >= self.P:
            return kept[: self.P]
        if (self.rounds_used_up(looked) or exhausted) and len(kept) + len(set_aside) >= self.P:
            return kept + set_aside[: self.P - len(kept)]
        return None

    def metrics(self, kept: int, looked: int) -> dict[str, float]:
        """A step's line, `kept` groups at hand when `choose` chose: the steps' worth of groups
        looked at (`sampling_rounds`: whole rounds in a batch, a share in a stream), and of the
        step's P groups the kept ones (`choose` takes them first) and the set-aside ones filled in."""
        informative_chosen = min(kept, self.P)
        return {"dapo/sampling_rounds": looked / self.P, "dapo/looked_groups": float(looked),
                "dapo/informative_groups": float(informative_chosen),
                "dapo/filled_groups": float(self.P - informative_chosen)}
