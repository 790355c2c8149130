"""The driver loop, one step top to bottom: sample -> score -> advantages -> train -> sync -> log.

It owns the step counter (the policy version is the number of updates so far, the step index,
also on resume; where a run starts, fresh or from a checkpoint, is `checkpoint.loop_start`'s
`LoopStart`) and talks to the rollout fleet, reward service and learner only through the small
protocols below, so the same loop runs colocated on a laptop or spread over a Ray cluster (and
imports neither Ray nor DeepSpeed). What the config turns on lives in the stages it calls:

- `make_rollouts` (rl/run/collect.py): each step's scored groups, lock-step, made ahead
  (`algorithm.off_policy_steps`) or streamed (`rollout.mode=streaming`), through DAPO's dynamic
  sampling (rl/run/dynamic_sampling.py) and the curriculum, from a `Source`: completions,
  environment or agent episodes;
- `score_samples` (rl/run/scoring.py): every kind of sample scored one way;
- `learner.update` (trainer/group.py): the learner ranks score the batch (old, reference
  log-probs, values), estimate its advantages from the rewards (rl/algo/estimate.py) and train,
  where the batch is: its tensors cross once, only metrics come back;
- `Evaluation` (rl/run/evaluate.py): held-out rows before the first update, every N steps, after;
- `StopGuards` (rl/run/guards.py): a signal, failing rewards or skipped updates stop the run at a
  step boundary, after `checkpoint.save_step` (rl/run/checkpoint.py: the run's lifecycle);
- `step_metrics` (rl/run/step_metrics.py): the step's line in metrics.jsonl.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Protocol

from rl.config.schema import TrainConfig
from rl.data.batch import build_train_batch
from rl.data.dataset import PromptDataset
from rl.data.types import Outcomes, Sample, ScoredSample, TrainBatch
from rl.run import checkpoint
from rl.run.checkpoint import LoopStart
from rl.run.collect import make_rollouts
from rl.run.colocation import GpuHandover
from rl.run.evaluate import Evaluation
from rl.actors.faults import ActorFailure, StopRequest
from rl.run.guards import StopGuards
from rl.run.rollouts import Rollouts, Source
from rl.log.run_log import RunLog
from rl.run.scoring import reward_tensors, score_samples
from rl.run.step_metrics import StepTimes, logprob_mismatch_warning, step_metrics


class PolicySync(Protocol):
    """What brings a new policy version from the learner to every rollout worker, replacing the
    workers lost on the way: the driver's `Cluster` (launch/cluster.py), over rl/wire/."""

    bytes_per_sync: float  # the whole weights (a delta sync sends less)

    def sync(self, version: int) -> float: ...


class Rewards(Protocol):
    def score(self, samples: list[Sample]) -> list[ScoredSample]: ...


class Learner(Protocol):
    def update(self, batch: TrainBatch, outcomes: Outcomes, step: int, kl_coef: float) -> dict[str, float]: ...
    def save_checkpoint(self, path: str) -> None: ...
    def offload(self, keep_weights: bool = False) -> None: ...
    def onload(self) -> None: ...


def run_loop(cfg: TrainConfig, pad_id: int, data: PromptDataset, source: Source, rewards: Rewards | None,
             learner: Learner, policy_sync: PolicySync, log: RunLog, handover: GpuHandover, start: LoopStart,
             stop: StopRequest | None = None, eval_data: PromptDataset | None = None) -> list[dict[str, float]]:
    """Run steps [start.step, run.steps) of the run `cfg` describes; returns each step's metrics.

    `source`: where samples come from (rl/run/rollouts.py); `policy_sync`: what syncs each new
    policy version to the engines (the driver's `Cluster`); `handover`: who holds the GPUs when
    they are shared (rl/run/colocation.py). `rewards`: None when only the episodes reward (an environment's or an
    agent's); `start`: where the run starts (`checkpoint.loop_start`: step 0 or a checkpoint's,
    the KL controller, the rollouts in flight); `eval_data`: `eval.files`. A run ends early at a
    step boundary, with a checkpoint there, as `StopGuards` says; an actor lost for good ends it
    with an ActorFailure naming the step."""
    run, kl_ctrl = cfg.run, start.kl_ctrl
    score = partial(score_samples, cfg, rewards)
    rollouts = make_rollouts(cfg, data, source, score, start.step, start.in_flight)
    evaluation = Evaluation(cfg.eval, eval_data, source.run, score)
    guards = StopGuards(cfg, stop)
    history: list[dict[str, float]] = []

    def save(next_step: int, with_in_flight: bool = True) -> None:
        checkpoint.save_step(log.run_dir, next_step, kl_ctrl, data.curriculum, learner, rollouts,
                             handover, run.keep_checkpoints, with_in_flight)

    try:
        for step in range(start.step, run.steps):
            evaluated = evaluation.before(step)
            metrics, scored = _step(cfg, pad_id, learner, policy_sync, log, step, kl_ctrl, rollouts, save,
                                    evaluated, handover)
            history.append(metrics)
            guards.record(metrics, scored)
            stopping = guards.stopping(step + 1)
            if checkpoint.due(run, step + 1) or stopping is not None:
                save(step + 1)
            if stopping is not None:
                raise stopping
        evaluation.after(log, start.step, run.steps)
    finally:
        rollouts.close()
    return history


def _step(cfg: TrainConfig, pad_id: int, learner: Learner, policy_sync: PolicySync, log: RunLog, step: int,
          kl_ctrl, rollouts: Rollouts, save, evaluated: dict[str, float],
          handover: GpuHandover) -> tuple[dict[str, float], list[ScoredSample]]:
    """One step trained at policy version `step`: its batch (made now, ahead, or streamed), scores,
    advantages, the update, the weight sync; logs and returns its metrics (with the evaluation
    made before it, `evaluated`) and samples."""
    a = cfg.algorithm
    t0 = time.perf_counter()
    try:
        scored, samples, collected = rollouts.take(step)
    except ActorFailure as err:  # a rollout worker is lost for good; the learner is whole
        save(step, with_in_flight=False)  # batches made ahead are made again on resume
        raise err.at_step(step) from None
    t_batch = time.perf_counter()

    batch = build_train_batch(scored, pad_id, step, mask_truncated=a.mask_truncated, max_staleness=a.off_policy_steps,
                              segment_rows=True)
    try:
        handover.to_learner()  # engines free the GPU for the learner (rl/run/colocation.py)
        kl_coef = kl_ctrl.value  # this step's, in the reward or the loss: the controller adapts it after the update
        # the learners score the batch, estimate its advantages from the rewards and train, where it is
        trained = learner.update(batch, Outcomes(*reward_tensors(scored)), step, kl_coef)
        t_trained = time.perf_counter()
        t_scored = t_batch + trained.pop("time/score_s")
        handover.to_sync()  # both sides hold just their weights
        with rollouts.between_batches():
            t_held = time.perf_counter()
            sent = policy_sync.sync(step + 1)
            t_synced = time.perf_counter()
        handover.to_rollout()
    except ActorFailure as err:
        raise err.at_step(step) from None
    measured_kl = trained.get("actor/kl_in_reward_nats", trained.get("actor/kl_nats"))
    if measured_kl is not None:
        kl_ctrl.update(measured_kl, len(scored))

    times = StepTimes(t0, t_batch, t_scored, t_trained, t_held, t_synced, time.perf_counter())
    metrics = step_metrics(cfg, step, scored, samples, collected, trained, kl_coef, sent,
                           policy_sync.bytes_per_sync, times, evaluated)
    warning = logprob_mismatch_warning(step, metrics.get("sync/logprob_abs_diff", 0.0),
                                       cfg.trainer.logprob_warn_threshold)
    if warning and not metrics["policy/staleness_max"]:  # samples of older versions differ by design
        log.write(warning)
    log.samples(step, scored, cfg.run.log_samples_per_step)
    log.metrics(step, metrics)
    return metrics, scored
