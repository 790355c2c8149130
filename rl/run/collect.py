"""Where each step's scored groups come from: the schedule (`make_rollouts`: lock-step, batches
made ahead, or a stream) over a `Source` (completions, environment or agent episodes:
rl/run/rollouts.py), and the sampling stages a batch goes through on the way (`collect`): DAPO's
dynamic sampling (rl/run/dynamic_sampling.py) and the prompt curriculum's record. The loop asks
for a step's groups and gets them, whichever of these the config turned on."""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

from rl.config.schema import TrainConfig
from rl.data.dataset import PromptDataset
from rl.data.types import GenerationRequest, Sample, ScoredSample
from rl.run.dynamic_sampling import DynamicSampling
from rl.run.pipeline import RolloutPipeline
from rl.run.rollouts import LockStep, Rollouts, Source
from rl.run.scoring import by_group
from rl.run.streaming import StreamingRollouts

Score = Callable[[list[Sample]], list[ScoredSample]]


def collect(cfg: TrainConfig, data: PromptDataset, source: Source, score: Score, sampling: DynamicSampling | None,
            step: int) -> tuple[list[ScoredSample], list[Sample], dict[str, float]]:
    """Generate and score one step's groups. With DAPO's dynamic sampling (`sampling`,
    rl/run/dynamic_sampling.py), rounds of P more prompts are drawn until it chooses the step's
    groups. With a curriculum, every group's rewards are recorded (flat groups' prompts rest)."""
    P, n = cfg.task.prompts_per_step, cfg.rollout.n
    kept: list[list[ScoredSample]] = []
    set_aside: list[list[ScoredSample]] = []
    generated: list[Sample] = []
    timing = {"time/rollout_s": 0.0, "time/reward_s": 0.0}
    for rnd in range(sampling.max_rounds if sampling else 1):
        t0 = time.perf_counter()
        samples = source.run(data.requests(step, P, n, sampling_round=rnd))
        t1 = time.perf_counter()
        scored = score(samples)
        timing["time/rollout_s"] += t1 - t0
        timing["time/reward_s"] += time.perf_counter() - t1
        generated += samples
        groups = by_group(scored)
        if data.curriculum is not None:  # flat groups' prompts rest (task.curriculum_epochs)
            if rnd == 0:
                timing.update(data.curriculum.metrics(P))
            data.curriculum.record({g: [s.reward if s.error is None else None for s in group]
                                    for g, group in groups.items()})
        if sampling is None:
            return scored, generated, timing
        for group in groups.values():
            (kept if sampling.keeps(group) else set_aside).append(group)
        chosen = sampling.choose(kept, set_aside, looked=len(kept) + len(set_aside))
        if chosen is not None:
            break
    metrics = {**timing, **sampling.metrics(kept=len(kept), looked=len(kept) + len(set_aside))}
    return [s for g in chosen for s in g], generated, metrics


def make_rollouts(cfg: TrainConfig, data: PromptDataset, source: Source, score: Score, start_step: int,
                  in_flight: dict) -> Rollouts:
    """What makes each step's groups: the step's batch when it starts (on-policy, lock-step),
    batches generated up to k steps ahead, or a stream (`rollout.mode=streaming`), all from
    `source`, through DAPO's dynamic sampling when it is on. `start_step`, `in_flight`: where the
    run starts, and what a checkpoint recorded of its rollouts (rl/run/checkpoint.py:loop_start)."""
    a, P, n = cfg.algorithm, cfg.task.prompts_per_step, cfg.rollout.n
    sampling = DynamicSampling.of(cfg)
    if cfg.rollout.mode == "streaming":
        def draw(b: int) -> list[GenerationRequest]:  # prompt batch b, group ids unique over the run
            requests = data.requests(b, P, n)
            for r in requests:
                r.group_id += b * P
            return requests

        # a sample ends within a request's deadline (or an agent's) or its worker is replaced: a
        # stream with nothing finishing for longer than that, start-up included, is stuck
        stall_s = cfg.run.start_timeout_s + cfg.run.call_timeout_s + (cfg.task.agent_timeout_s if cfg.task.agent else 0)
        return StreamingRollouts(source, draw, score, groups_per_step=P, max_staleness=a.off_policy_steps,
                                 start_step=start_step, steps=cfg.run.steps, sampling=sampling,
                                 state=in_flight.get("streaming"), stall_s=stall_s,
                                 stall_hint="run.start_timeout_s + run.call_timeout_s"
                                            + (" + task.agent_timeout_s" if cfg.task.agent else ""))
    produce = partial(collect, cfg, data, source, score, sampling)
    if a.off_policy_steps:
        return RolloutPipeline(produce, a.off_policy_steps, cfg.run.steps, in_flight, repair=source.repair)
    return LockStep(produce)
