"""When a run stops at a step boundary, with a checkpoint there, instead of going on: a signal
asked for it (RunStopped), every sample's reward failed `reward.max_failed_steps` steps in a row
(RewardsFailing), or the learner skipped every update `trainer.max_skipped_steps` steps in a row
(NotLearning: its gradients were not finite, so the weights stopped changing)."""

from __future__ import annotations

from rl.config.schema import TrainConfig
from rl.data.types import ScoredSample
from rl.run.faults import NotLearning, RewardsFailing, RunStopped, StopRequest


class StopGuards:
    def __init__(self, cfg: TrainConfig, stop: StopRequest | None):
        self.max_failed, self.max_skipped = cfg.reward.max_failed_steps, cfg.trainer.max_skipped_steps
        self.steps, self.stop = cfg.run.steps, stop
        self.failing: list[str] = []  # the first reward error of each step, in a row, whose rewards all failed
        self.skipped = 0  # steps in a row whose every update the learner skipped
        self.last_finite: dict[str, float] | None = None  # the figures of the last step that was not

    def record(self, metrics: dict[str, float], scored: list[ScoredSample]) -> None:
        """What a finished step tells: its rewards all failed or not, its updates all skipped or not."""
        self.failing = self.failing + [scored[0].error] if all(s.error is not None for s in scored) else []
        if metrics.get("actor/skipped_updates_count", 0) >= metrics.get("actor/updates_count", 1):
            self.skipped += 1
        else:
            self.skipped = 0
            self.last_finite = {k: metrics[k] for k in ("actor/grad_norm", "actor/loss_nats", "reward/mean")
                                if k in metrics}

    def stopping(self, done: int) -> Exception | None:
        """Why the run stops after `done` steps (the caller saves a checkpoint, then raises it), or None."""
        if len(self.failing) >= self.max_failed:
            return RewardsFailing(len(self.failing), self.failing[0], done)
        if self.skipped >= self.max_skipped:
            return NotLearning(self.skipped, done, self.last_finite)
        if self.stop is not None and self.stop.reason is not None and done < self.steps:
            return RunStopped(self.stop.reason, done)
        return None
