"""The sum environment: `reset` asks a + b (seeded), `step` scores the answer (1.0 right); a wrong
answer gets one more try with a hint, then the episode ends."""

import random
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from examples.openenv_sum.models import SumAction, SumObservation


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._a = self._b = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> SumObservation:
        rng = random.Random(seed)
        self._a, self._b = rng.randint(1, 9), rng.randint(1, 9)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SumObservation(text=f"{self._a}+{self._b}", done=False, reward=0.0)

    def step(self, action: SumAction, timeout_s: Optional[float] = None, **kwargs: Any) -> SumObservation:
        self._state.step_count += 1
        right = action.message.strip() == str(self._a + self._b)
        if right or self._state.step_count >= 2:
            return SumObservation(text="right" if right else "wrong", done=True, reward=1.0 if right else 0.0)
        return SumObservation(text="wrong, try again", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumEnvironment, SumAction, SumObservation, env_name="sum", max_concurrent_envs=64)
