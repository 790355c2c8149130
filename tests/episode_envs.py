"""Environments the episode tests load by path (`tests/episode_envs.py:Class`), as a user would."""

from __future__ import annotations

import asyncio
import time

from rl.data.env import Environment, StepResult


class KeepGoing(Environment):
    """Answers every turn with the same text (`obs`), rewarding each turn with its number of tokens;
    never done: episodes end at task.max_turns."""

    def __init__(self, obs: str = "+1=", **kwargs):
        super().__init__(**kwargs)
        self.obs = obs

    def step(self, text, token_ids):
        return StepResult(self.obs, reward=float(len(token_ids)), done=False)


class Moody(Environment):
    """Misbehaves by the prompt's first digit: 1 raises, 2 hangs, 3 answers a string, 4 an
    observation of the wrong type, 5 raises in reset; any other ends well after one turn.
    Async on purpose (the API takes both)."""

    def reset(self, row):
        self.first = row["prompt"][0]
        if self.first == "5":
            raise RuntimeError("no such row")

    async def step(self, text, token_ids):
        if self.first == "1":
            raise KeyError("boom")
        if self.first == "2":
            await asyncio.sleep(60)
        if self.first == "3":
            return "done"
        if self.first == "4":
            return StepResult(observation=42)
        return StepResult(None, reward=1.0, done=True)


class SleepsInThread(Environment):
    """A plain `step` that blocks well past task.env_timeout_s."""

    def step(self, text, token_ids):
        time.sleep(30)
        return StepResult(None, 1.0, True)
