"""KL coefficient controllers (Ziegler et al. 2019, 'Fine-Tuning Language Models from Human
Preferences'), registered by name (`algorithm.kl_ctrl`).

A controller holds the current coefficient `value`; the loop calls `update(current_kl, n_steps)`
once per step with the measured KL (nats per token, or whatever unit the target uses) and the
number of samples the step used. `to_dict()` / `kl_controller_from_dict()` save and restore the
state for checkpoint resume. A controller is registered with its kind ("constant" or "feedback")
and the AlgorithmConfig fields its constructor takes (`KL_CONTROLLERS.settings(name, config)`).
"""

from __future__ import annotations

from typing import Any

from rl.algo.registry import Registry

KL_CONTROLLERS = Registry("KL controller", "algorithm.kl_ctrl", kinds=("constant", "feedback"))


@KL_CONTROLLERS.register("fixed", kind="constant", settings={"coef": "kl_coef"})
class FixedKLController:
    """A constant coefficient: `update` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self.value}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "FixedKLController":
        return cls(state["value"])


@KL_CONTROLLERS.register("adaptive", kind="feedback",
                         settings={"init_coef": "kl_coef", "target_kl": "kl_target", "horizon": "kl_horizon"})
class AdaptiveKLController:
    """Proportional controller towards a target KL (Ziegler et al. 2019, section 2.2):

        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        coef <- coef * (1 + error * n_steps / horizon)

    The coefficient grows while the KL is above target and shrinks while below, by at most 20% of
    n_steps / horizon per update (the paper uses horizon = 10,000 samples).
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL control needs algorithm.target_kl > 0 and algorithm.kl_horizon > 0 "
                f"(got {target_kl}, {horizon}), e.g. target_kl=0.1, kl_horizon=10000"
            )
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "AdaptiveKLController":
        return cls(state["value"], state["target_kl"], state["horizon"])


def kl_controller_from_dict(state: dict[str, Any]) -> FixedKLController | AdaptiveKLController:
    """Rebuild a controller saved with `to_dict()` (its kind names the class)."""
    return KL_CONTROLLERS.get(state["kind"]).from_dict(state)
