"""The sum environment's action (the answer written) and observation (the question or a hint)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class SumAction(Action):
    message: str = Field(..., description="the answer")


class SumObservation(Observation):
    text: str = Field(default="", description="the question, or whether the answer was right")
