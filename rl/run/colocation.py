"""Who holds the GPU memory when: the hand-over between rollout engines and learner ranks.

With `rollout.sleep_between_steps` the engines free their GPU memory while the learner scores
and trains, and take it back for the next rollout. With `cluster.placement_mode=hybrid` a learner
rank and an engine share each GPU, so the learner also moves its states to the host while the
engine runs, and the weight sync sits in between, when both hold only weights:

    rollout           engines awake; learner offloaded
    to_learner()      engines sleep (level 2: weights and KV cache dropped); learner states back
    score, train
    to_sync()         learner offloads all but its 16-bit weights; engines get their weight memory
    policy_sync.sync  learner -> engines (CUDA IPC on a shared GPU)
    to_rollout()      learner weights off too; engines get their KV cache and generate

A checkpoint between steps (`learner_resident`) puts the engines to sleep at level 1, which keeps
their weights, since no sync follows. Plain calls on the fleet and learner (no Ray here).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Protocol


class SleepingFleet(Protocol):
    def sleep(self, level: int | None = None) -> None: ...
    def wake(self, tags: tuple[str, ...] | None = None) -> None: ...


class OffloadingLearner(Protocol):
    def offload(self, keep_weights: bool = False) -> None: ...
    def onload(self) -> None: ...


class GpuHandover:
    def __init__(self, fleet: SleepingFleet, learner: OffloadingLearner, *, sleep: bool, colocated: bool):
        self.fleet, self.learner, self.sleep, self.colocated = fleet, learner, sleep, colocated

    @classmethod
    def of(cls, cfg, fleet: SleepingFleet, learner: OffloadingLearner) -> GpuHandover:
        return cls(fleet, learner, sleep=bool(cfg.rollout.sleep_between_steps),
                   colocated=cfg.cluster.placement_mode == "hybrid")

    def to_learner(self, keep_engine_weights: bool = False) -> None:
        if self.sleep:
            self.fleet.sleep(1 if keep_engine_weights else None)
        if self.colocated:
            self.learner.onload()

    def to_sync(self) -> None:
        if self.colocated:
            self.learner.offload(keep_weights=True)
        if self.sleep:
            self.fleet.wake(("weights",))

    def to_rollout(self) -> None:
        if self.colocated:
            self.learner.offload()
        if self.sleep:
            self.fleet.wake()

    @contextmanager
    def learner_resident(self):
        """The learner's states on its GPUs between steps (a checkpoint), the engines' weights kept."""
        if not self.colocated:
            yield
            return
        self.to_learner(keep_engine_weights=True)
        try:
            yield
        finally:
            self.to_rollout()
