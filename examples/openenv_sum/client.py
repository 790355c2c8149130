"""The sum environment's client: what any OpenEnv trainer connects with."""

from typing import Any, Dict

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from examples.openenv_sum.models import SumAction, SumObservation


class SumEnv(EnvClient[SumAction, SumObservation, State]):
    def _step_payload(self, action: SumAction) -> Dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: Dict[str, Any]) -> StepResult[SumObservation]:
        obs = payload.get("observation", {})
        observation = SumObservation(text=obs.get("text", ""), done=payload.get("done", False),
                                     reward=payload.get("reward"), metadata=obs.get("metadata", {}))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: Dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))
