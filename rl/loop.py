"""The driver loop: generate -> reward -> learner scores -> advantages -> train -> sync weights.

It owns the step counter, the policy version and the logging, and talks to the rollout fleet,
reward service and learner only through the small protocols below, so the same loop runs
colocated on a laptop or spread over a Ray cluster (and imports neither Ray nor DeepSpeed).
Samples come from a `Source` (rl/run/rollouts.py): single completions, environment episodes
(`task.env`, rl/data/episodes.py) or agent episodes (`task.agent`, rl/run/agents.py), all scored by
one function (`score_samples`). A `Rollouts` schedule hands each step its groups: lock-step
(on-policy), batches made up to k = `algorithm.off_policy_steps` steps ahead in a background
thread (weight syncs wait for a batch boundary), or a stream (`rollout.mode=streaming`: requests
flow continuously, weight syncs land mid-generation, samples at most k versions old at their
oldest token). With `eval.every_steps` held-out rows are evaluated before the first update, every
N steps and after the last one.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from functools import partial
from typing import Callable, Protocol

import torch

from rl.run import checkpoint
from rl.algo.advantages import group_success_stats
from rl.data.batch import build_train_batch
from rl.run.colocation import GpuHandover
from rl.algo.dapo import informative_groups, overlong_penalty
from rl.data.dataset import PromptDataset
from rl.config.schema import AlgorithmConfig, TrainConfig
from rl.data.episodes import with_episode_rewards
from rl.algo.estimate import estimate_advantages
from rl.run.evaluate import due, evaluate
from rl.run.faults import ActorFailure, NotLearning, RewardsFailing, RunStopped, StopRequest
from rl.plan.flops import step_cost
from rl.algo.kl_control import KL_CONTROLLERS, kl_controller_from_dict
from rl.run.pipeline import RolloutPipeline
from rl.run.rollouts import LockStep, Rollouts, Source
from rl.run.streaming import StreamingRollouts
from rl.run.run_log import RunLog
from rl.data.types import GenerationRequest, Sample, ScoredSample, TrainBatch


class Fleet(Protocol):
    def sleep(self, level: int | None = None) -> None: ...
    def wake(self, tags: tuple[str, ...] | None = None) -> None: ...


class Weights(Protocol):
    """The weight sync (trainer/sync/): learner -> rollout workers."""

    bytes_per_sync: float  # the whole weights (a delta sync sends less)

    def sync(self, version: int) -> float: ...


class Rewards(Protocol):
    def score(self, samples: list[Sample]) -> list[ScoredSample]: ...


class Learner(Protocol):
    def score(self, batch: TrainBatch) -> TrainBatch: ...
    def train_step(self, batch: TrainBatch, step: int, kl_coef: float) -> dict[str, float]: ...
    def save_checkpoint(self, path: str) -> None: ...
    def offload(self, keep_weights: bool = False) -> None: ...
    def onload(self) -> None: ...


def make_kl_controller(a: AlgorithmConfig):
    """The controller algorithm.kl_ctrl names, built from the settings its registration declares."""
    return KL_CONTROLLERS.get(a.kl_ctrl)(**KL_CONTROLLERS.settings(a.kl_ctrl, a))


def score_samples(cfg: TrainConfig, rewards: Rewards | None, samples: list[Sample]) -> list[ScoredSample]:
    """Every kind of sample scored one way: the reward functions (if any), plus an episode's turn
    rewards (an environment's or an agent's), plus DAPO's overlong penalty. A sample that failed
    (its episode, or a request the engine refused) keeps its error and gets no reward."""
    functions = rewards.score(samples) if rewards is not None else None
    if functions is not None and not any(s.turns is not None or s.error is not None for s in samples):
        return _shape_rewards(cfg, functions)
    return _shape_rewards(cfg, with_episode_rewards(samples, functions))


def collect(cfg: TrainConfig, data: PromptDataset, source: Source, score: Callable[[list[Sample]], list[ScoredSample]],
            step: int) -> tuple[list[ScoredSample], list[Sample], dict[str, float]]:
    """Generate and score one step's groups. With DAPO's dynamic sampling, groups whose rewards
    are all equal are set aside and more prompts are drawn (up to max_sampling_rounds); the
    batch is filled up with set-aside groups only if the rounds run out (its size is fixed)."""
    P, n, a = cfg.task.prompts_per_step, cfg.rollout.n, cfg.algorithm
    kept: list[list[ScoredSample]] = []
    flat: list[list[ScoredSample]] = []
    generated: list[Sample] = []
    timing = {"time/rollout_s": 0.0, "time/reward_s": 0.0}
    rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
    for rnd in range(rounds):
        t0 = time.perf_counter()
        samples = source.run(data.requests(step, P, n, round=rnd))
        t1 = time.perf_counter()
        scored = score(samples)
        timing["time/rollout_s"] += t1 - t0
        timing["time/reward_s"] += time.perf_counter() - t1
        generated += samples
        groups = _by_group(scored)
        if data.curriculum is not None:  # flat groups' prompts rest (task.curriculum_epochs)
            if rnd == 0:
                timing.update(data.curriculum.metrics(P))
            data.curriculum.record({g: [s.reward if s.error is None else None for s in group]
                                    for g, group in groups.items()})
        if not a.dynamic_sampling:
            return scored, generated, timing
        kept += [g for g in groups.values() if _informative(g)]
        flat += [g for g in groups.values() if not _informative(g)]
        if len(kept) >= P:
            break
    metrics = {**timing, "dapo/sampling_rounds": float(rnd + 1), "dapo/informative_groups": float(len(kept)),
               "dapo/filled_groups": float(max(0, P - len(kept)))}
    chosen = (kept + flat)[:P]
    return [s for g in chosen for s in g], generated, metrics


def make_rollouts(cfg: TrainConfig, data: PromptDataset, source: Source,
                  score: Callable[[list[Sample]], list[ScoredSample]], start_step: int,
                  in_flight: dict | None) -> Rollouts:
    """What makes each step's groups: the step's batch when it starts (on-policy, lock-step),
    batches generated up to k steps ahead, or a stream (`rollout.mode=streaming`), all from
    `source` (completions, environment episodes or agent episodes). `in_flight`: what a
    checkpoint recorded of it."""
    a, P, n = cfg.algorithm, cfg.task.prompts_per_step, cfg.rollout.n
    streaming = cfg.rollout.mode == "streaming"
    if in_flight and streaming != ("streaming" in in_flight):
        was = "streaming" if "streaming" in in_flight else "batch"
        raise ValueError(f"the checkpoint holds rollouts in flight of rollout.mode={was}: resume it with "
                         f"rollout.mode={was}")
    if streaming:
        def draw(b: int) -> list[GenerationRequest]:  # prompt batch b, group ids unique over the run
            requests = data.requests(b, P, n)
            for r in requests:
                r.group_id += b * P
            return requests

        rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
        # a sample ends within a request's deadline (or an agent's) or its worker is replaced: a
        # stream with nothing finishing for longer than that, start-up included, is stuck
        stall_s = cfg.run.start_timeout_s + cfg.run.call_timeout_s + (cfg.task.agent_timeout_s if cfg.task.agent else 0)
        return StreamingRollouts(source, draw, score, groups_per_step=P, max_staleness=a.off_policy_steps,
                                 start_step=start_step, steps=cfg.run.steps,
                                 informative=_informative if a.dynamic_sampling else None, max_rounds=rounds,
                                 state=(in_flight or {}).get("streaming"), stall_s=stall_s,
                                 stall_hint="run.start_timeout_s + run.call_timeout_s"
                                            + (" + task.agent_timeout_s" if cfg.task.agent else ""))
    produce = partial(collect, cfg, data, source, score)
    if a.off_policy_steps:
        return RolloutPipeline(produce, a.off_policy_steps, cfg.run.steps, in_flight, repair=source.repair)
    return LockStep(produce)


def student_logprobs(batch: TrainBatch) -> torch.Tensor:
    """The policy's log-probs of the sampled tokens before this update: the learner's where it
    scored them (trainer.recompute_old_logprobs), else the rollout engine's."""
    return batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs


def _informative(group: list[ScoredSample]) -> bool:
    """DAPO's filter: the group's rewards are not all equal (its advantages are not all zero)."""
    reward, valid, ids = _reward_tensors(group)
    return bool(informative_groups(reward, ids, valid))


def _shape_rewards(cfg: TrainConfig, scored: list[ScoredSample]) -> list[ScoredSample]:
    """DAPO's overlong penalty, added to every scored sample's reward."""
    a = cfg.algorithm
    if a.overlong_buffer <= 0:
        return scored
    lengths = torch.tensor([len(s.sample.completion_ids) for s in scored])
    penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    for s, p in zip(scored, penalty.tolist()):
        if s.error is None:
            s.components["overlong_penalty"] = p
            s.reward = s.reward + p
    return scored


def _by_group(scored: list[ScoredSample]) -> dict[int, list[ScoredSample]]:
    groups: dict[int, list[ScoredSample]] = {}
    for s in scored:
        groups.setdefault(s.sample.group_id, []).append(s)
    return groups


def _reward_tensors(scored: list[ScoredSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    valid = torch.tensor([s.error is None for s in scored])
    reward = torch.tensor([s.reward if s.error is None else 0.0 for s in scored], dtype=torch.float64)
    groups = torch.tensor([s.sample.group_id for s in scored])
    return reward, valid, groups


def reward_metrics(scored: list[ScoredSample]) -> dict[str, float]:
    ok = [s for s in scored if s.error is None]
    out: dict[str, float] = {"reward/errors_count": float(len(scored) - len(ok))}
    if ok:
        out["reward/mean"] = statistics.fmean(s.reward for s in ok)
        out["reward/std"] = statistics.pstdev([s.reward for s in ok])
        for name in ok[0].components:
            values = [s.components.get(name) for s in ok if s.components.get(name) is not None]
            if values:
                out[f"reward/{name}_mean"] = statistics.fmean(values)
    return out


def logprob_mismatch_warning(step: int, diff: float, threshold: float) -> str | None:
    """The loud warning for when learner and rollout disagree on the sampled tokens' log-probs."""
    if diff <= threshold:
        return None
    return (
        f"WARNING: step {step}: learner and rollout log-probs of the same tokens differ by {diff:.4f} "
        f"nats on average (> trainer.logprob_warn_threshold={threshold}): the rollout engines are not "
        "sampling from the learner's weights (weight sync, dtype or temperature mismatch); training is off-policy"
    )


def run_loop(cfg: TrainConfig, pad_id: int, data: PromptDataset, fleet: Fleet, source: Source,
             rewards: Rewards | None, learner: Learner, weights: Weights, log: RunLog, start_step: int = 0,
             kl_state: dict | None = None, stop: StopRequest | None = None, in_flight: dict | None = None,
             eval_data: PromptDataset | None = None) -> list[dict[str, float]]:
    """Run steps [start_step, run.steps) of the run `cfg` describes; returns each step's metrics.

    The policy version equals the number of updates so far, i.e. the step index, also on resume.
    A run ends early at a step boundary, with a checkpoint there, when `stop` is requested (a
    signal: RunStopped) or when every reward failed `reward.max_failed_steps` steps in a row
    (RewardsFailing); an actor lost for good ends it with an ActorFailure naming the step.
    `source`: where samples come from (the fleet's completions, environment or agent episodes:
    rl/run/rollouts.py); `fleet`: the engines that sleep while the learner works; `weights`: the
    weight sync from the learner to them (trainer/sync/). `in_flight`: what a checkpoint
    recorded of the rollouts made ahead. `rewards`: None when only the episodes reward (an
    environment's or an agent's); `eval_data`: `eval.files`.
    """
    a, run = cfg.algorithm, cfg.run
    history = []
    kl_ctrl = kl_controller_from_dict(kl_state) if kl_state else make_kl_controller(a)
    version = start_step
    failing: list[str] = []  # the first reward error of each step, in a row, whose rewards all failed
    skipped, last_finite = 0, None  # steps in a row whose every update the learner skipped; the last other's figures
    score = partial(score_samples, cfg, rewards)
    rollouts = make_rollouts(cfg, data, source, score, start_step, in_flight)
    handover = GpuHandover.of(cfg, fleet, learner)

    def save(next_step: int, with_in_flight: bool = True) -> None:
        ahead = rollouts.in_flight(whole=with_in_flight)
        with handover.learner_resident() if with_in_flight else nullcontext():  # (else the fleet is broken)
            curriculum = data.curriculum.to_dict() if data.curriculum is not None else None
            checkpoint.save(log.run_dir, checkpoint.LoopState(next_step, version, kl_ctrl.to_dict(), curriculum),
                            learner.save_checkpoint, run.keep_checkpoints, in_flight=ahead)

    try:
        for step in range(start_step, run.steps):
            evaluated = evaluate(cfg.eval, eval_data, source.run, score) \
                if eval_data is not None and due(cfg.eval, step) else {}
            metrics, scored = _step(cfg, pad_id, learner, weights, log, step, version, kl_ctrl, rollouts, save,
                                    evaluated, handover)
            version += 1
            history.append(metrics)
            done = step + 1
            failing = failing + [scored[0].error] if all(s.error is not None for s in scored) else []
            if metrics.get("actor/skipped_updates_count", 0) >= metrics.get("actor/updates_count", 1):
                skipped += 1
            else:
                skipped, last_finite = 0, {k: metrics[k] for k in ("actor/grad_norm", "actor/loss_nats", "reward/mean")
                                           if k in metrics}
            stopping = stop is not None and stop.reason is not None
            if (run.save_every and (done % run.save_every == 0 or done == run.steps)) or stopping \
                    or len(failing) >= cfg.reward.max_failed_steps or skipped >= cfg.trainer.max_skipped_steps:
                save(done)
            if len(failing) >= cfg.reward.max_failed_steps:
                raise RewardsFailing(len(failing), failing[0], done)
            if skipped >= cfg.trainer.max_skipped_steps:
                raise NotLearning(skipped, done, last_finite)
            if stopping and done < run.steps:
                raise RunStopped(stop.reason, done)
        if eval_data is not None and cfg.eval.every_steps > 0 and start_step < run.steps:
            # the trained policy's own evaluation: a row of its own, at step run.steps
            final = evaluate(cfg.eval, eval_data, source.run, score)
            log.metrics(run.steps, final, advance=False, echo=False)
            log.write(f"evaluation after step {run.steps}: " + " | ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in final.items() if not k.endswith("_count")))
    finally:
        rollouts.close()
    return history


def _step(cfg: TrainConfig, pad_id: int, learner: Learner, weights: Weights, log: RunLog, step: int, version: int,
          kl_ctrl, rollouts: Rollouts, save, evaluated: dict[str, float],
          handover: GpuHandover) -> tuple[dict[str, float], list[ScoredSample]]:
    """One step trained at policy `version`: its batch (made now, ahead, or streamed), scores,
    advantages, the update, the weight sync; logs and returns its metrics (with the evaluation
    made before it, `evaluated`) and samples."""
    a = cfg.algorithm
    t0 = time.perf_counter()
    try:
        scored, samples, collect_metrics = rollouts.take(step)
    except ActorFailure as err:  # a rollout worker is lost for good; the learner is whole
        save(step, with_in_flight=False)  # batches made ahead are made again on resume
        raise err.at_step(step) from None
    t_rew = time.perf_counter()

    reward, valid, groups = _reward_tensors(scored)
    batch = build_train_batch(scored, pad_id, version, mask_truncated=a.mask_truncated,
                              max_staleness=a.off_policy_steps)
    try:
        handover.to_learner()  # engines free the GPU for the learner (rl/run/colocation.py)
        batch = learner.score(batch)
        t_score = time.perf_counter()
        kl_coef = kl_ctrl.value  # this step's, in the reward or the loss: the controller adapts it after the update
        est = estimate_advantages(a, reward, valid, groups, batch.loss_mask, kl_coef,
                                  batch.old_logprobs, batch.ref_logprobs, batch.values, batch.turn_rewards,
                                  batch.teacher_logprobs, student_logprobs(batch))
        batch.advantages, batch.returns = est.advantages, est.returns
        train_metrics = learner.train_step(batch, step, kl_coef)
        t_train = time.perf_counter()
        handover.to_sync()  # both sides hold just their weights
        with rollouts.between_batches():
            t_hold = time.perf_counter()
            sent = weights.sync(version + 1)
            t_sync = time.perf_counter()
        handover.to_rollout()
    except ActorFailure as err:
        raise err.at_step(step) from None
    t_end = time.perf_counter()
    measured_kl = est.metrics.get("actor/kl_in_reward_nats", train_metrics.get("actor/kl_nats"))
    if measured_kl is not None:
        kl_ctrl.update(measured_kl, len(scored))

    gen_tokens = sum(sum(s.completion_mask) if s.completion_mask is not None else len(s.completion_ids)
                     for s in samples)  # the model's tokens (an episode's observations are not generated)
    behind = [version - s.sample.policy_version for s in scored if s.error is None] or [0]
    metrics = {
        **reward_metrics(scored),
        **group_success_stats(reward, groups, valid),
        **{k: v for k, v in collect_metrics.items() if k != "time/wait_rollout_s"},
        **({"actor/kl_coef": kl_coef} if a.kl_coef > 0 else {}),
        **est.metrics,
        **train_metrics,
        "rollout/tokens_per_s": gen_tokens / max(collect_metrics["time/rollout_s"], 1e-9),
        "rollout/completion_len_tokens": gen_tokens / len(samples),
        # the planner's lengths for the next run (rl/plan/step_time.py): prompts, and the decode steps
        "rollout/prompt_len_tokens": statistics.fmean(len(s.prompt_ids) for s in samples),
        "rollout/completion_len_max_tokens": float(max(len(s.completion_ids) for s in samples)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "sync/weights_mb": sent / 2**20,
        "sync/sent_frac": sent / max(weights.bytes_per_sync, 1.0),  # below 1 with trainer.delta_sync
        "time/wait_rollout_s": (t_rew - t0) + (t_hold - t_train),  # the learner idle, waiting for rollouts
        "time/score_s": t_score - t_rew,
        "time/train_s": t_train - t_score,
        "time/sync_s": t_sync - t_hold,
        "time/step_s": t_end - t0,
        "policy/version_count": float(version + 1),
        "policy/staleness_mean": statistics.fmean(behind),
        "policy/staleness_max": float(max(behind)),
        "policy/staleness_bound": float(a.off_policy_steps),
        "rollout/streaming": float(cfg.rollout.mode == "streaming"),
        **_cost_metrics(cfg, train_metrics, t_train - t_rew, t_end - t0),
        **_episode_metrics(samples),
        **evaluated,
    }
    warning = logprob_mismatch_warning(step, metrics.get("sync/logprob_abs_diff", 0.0),
                                       cfg.trainer.logprob_warn_threshold)
    if warning and not max(behind):  # samples of older versions differ by design (off_policy_steps)
        log.write(warning)
    log.samples(step, scored, cfg.run.log_samples_per_step)
    log.metrics(step, metrics)
    return metrics, scored


def _cost_metrics(cfg: TrainConfig, train_metrics: dict[str, float], learner_s: float,
                  step_s: float) -> dict[str, float]:
    """Learner MFU and trained tokens/s over its time this step (score + train), and the step's
    price at `cluster.price_per_device_hour` for every learner rank and rollout worker."""
    out: dict[str, float] = {}
    tflop, peak = train_metrics.get("perf/model_tflop"), train_metrics.get("perf/peak_tflops", 0.0)
    if tflop is not None and peak > 0 and learner_s > 0:
        out["perf/mfu"] = tflop / (learner_s * peak * cfg.trainer.num_workers)
        out["perf/trained_tokens_per_s"] = train_metrics["perf/trained_tokens"] / learner_s
    if cfg.cluster.price_per_device_hour > 0:
        devices = cfg.trainer.num_workers + cfg.rollout.num_workers
        out["cost/step_usd"] = step_cost(step_s, devices, cfg.cluster.price_per_device_hour)
    return out


def _episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Turns per episode, and the share of an episode's tokens that are observations; agents that
    failed (rl/run/agents.py names them in the error), and those killed at their deadline."""
    episodes = [s for s in samples if s.turns is not None]
    if not episodes:
        return {}
    failed = [s.error for s in episodes if s.error is not None and s.error.startswith("task.agent=")]
    agents = {"agent/errors_count": float(len(failed)),
              "agent/timeouts_count": float(sum("task.agent_timeout_s" in e for e in failed))} if failed else {}
    turns = [sum(t.role == "model" for t in s.turns) for s in episodes]
    obs = sum(len(s.completion_ids) - sum(s.completion_mask) for s in episodes)
    return {"episode/turns_mean": statistics.fmean(turns), "episode/turns_max": float(max(turns)),
            "episode/observation_tokens_frac": obs / max(1, sum(len(s.completion_ids) for s in episodes)),
            "episode/errors_count": float(sum(s.error is not None for s in episodes)), **agents}
