"""When a run stops at a step boundary, with a checkpoint there, instead of going on: a signal
asked for it (RunStopped), every sample's reward failed `reward.max_failed_steps` steps in a row
or in the run's last steps (RewardsFailing; EpisodesFailing for episodes, naming their most
common cause: e.g. an agent pool that can no longer run any), or the learner skipped every
update `trainer.max_skipped_steps` steps in a row (NotLearning: its gradients were not finite,
so the weights stopped changing); the policy's, or
a critic's (PPO: a critic that never updates gives GAE advantages of nothing, issue 58)."""

from __future__ import annotations

from rl.config.schema import TrainConfig
from rl.data.types import ScoredSample
from rl.actors.faults import Failures, NotLearning, RunStopped, StopRequest


class StopGuards:
    def __init__(self, cfg: TrainConfig, stop: StopRequest | None):
        self.max_failed, self.max_skipped = cfg.reward.max_failed_steps, cfg.trainer.max_skipped_steps
        self.steps, self.stop = cfg.run.steps, stop
        self.failing: list[str] = []  # the first reward error of each step, in a row, whose rewards all failed
        self.failures: Failures | None = None  # the last step's failures, its most common cause (issue 58)
        self.skipped = 0  # steps in a row whose every update the learner skipped
        self.last_finite: dict[str, float] | None = None  # the figures of the last step that was not

    def record(self, metrics: dict[str, float], scored: list[ScoredSample]) -> None:
        """What a finished step tells: its rewards all failed or not, its updates all skipped or not."""
        self.failures = Failures.of(scored)
        every = self.failures is not None and self.failures.every
        self.failing = self.failing + [scored[0].error] if every else []
        if every_update_skipped(metrics, "actor") or every_update_skipped(metrics, "critic"):
            self.skipped += 1
        else:
            self.skipped = 0
            self.last_finite = {k: metrics[k] for k in ("actor/grad_norm", "actor/loss_nats", "critic/value_loss",
                                                        "reward/mean") if k in metrics}

    def stopping(self, done: int) -> Exception | None:
        """Why the run stops after `done` steps (the caller saves a checkpoint, then raises it), or None."""
        ended = done >= self.steps  # a run whose last steps had no reward did not finish well: never rc 0
        if self.failing and (len(self.failing) >= self.max_failed or ended) and self.failures is not None:
            return self.failures.error(len(self.failing), self.failing[0], done, self.max_failed,
                                       ended and len(self.failing) < self.max_failed)
        if self.skipped >= self.max_skipped:
            return NotLearning(self.skipped, done, self.last_finite)
        if self.stop is not None and self.stop.reason is not None and done < self.steps:
            return RunStopped(self.stop.reason, done)
        return None


def every_update_skipped(metrics: dict[str, float], role: str) -> bool:
    """Whether the learner skipped every update of `role` ("actor" or "critic") this step
    (`trainer/group.py`'s `<role>/skipped_updates_count` of `<role>/updates_count`); a step
    without that role's counts (no critic) skipped none."""
    skipped = metrics.get(f"{role}/skipped_updates_count")
    return skipped is not None and skipped > 0 and skipped >= metrics.get(f"{role}/updates_count", 1)
