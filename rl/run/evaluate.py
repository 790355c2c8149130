"""Evaluation during training: held-out rows (`eval.files`), answered greedily once and sampled
`eval.n` times (0: greedy only), scored like training samples (reward functions, or an episode's environment).

Logged in the step's metrics (so in metrics.jsonl and TensorBoard) before that step's update:
`eval/greedy_mean_reward`, `eval/sampled_mean_reward`, `eval/greedy_pass_frac` and
`eval/pass_at_1`, `eval/pass_at_<n>` (the unbiased pass@k of Chen et al. 2021 over the n samples),
where a sample passes when its reward is at least `eval.pass_threshold`.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

from rl.config.schema import EvalConfig
from rl.data.dataset import PromptDataset
from rl.data.types import GenerationRequest, Sample, ScoredSample


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, passes)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def due(settings: EvalConfig, step: int) -> bool:
    """Evaluate before step `step`'s update: before the first one, then every `every_steps`."""
    return settings.every_steps > 0 and step % settings.every_steps == 0


def eval_metrics(greedy: list[ScoredSample], sampled: list[ScoredSample], n: int,
                 threshold: float) -> dict[str, float]:
    """Figures over scored samples; a sample whose reward failed counts as not passing (and as an
    error), so a broken scorer cannot make the model look better."""
    def reward(s: ScoredSample) -> float:
        return s.reward if s.reward is not None else 0.0

    def passes(s: ScoredSample) -> bool:
        return s.reward is not None and s.reward >= threshold

    out = {"eval/rows_count": float(len(greedy)),
           "eval/errors_count": float(sum(s.error is not None for s in greedy + sampled))}
    if greedy:
        out["eval/greedy_mean_reward"] = statistics.fmean(map(reward, greedy))
        out["eval/greedy_pass_frac"] = statistics.fmean(map(passes, greedy))
    if sampled:
        out["eval/sampled_mean_reward"] = statistics.fmean(map(reward, sampled))
        by_row: dict[int, list[bool]] = {}
        for s in sampled:
            by_row.setdefault(s.sample.group_id, []).append(passes(s))
        for k in sorted({1, n}):
            out[f"eval/pass_at_{k}"] = statistics.fmean(pass_at_k(len(p), sum(p), k) for p in by_row.values())
    return out


def evaluate(settings: EvalConfig, data: PromptDataset, generate: Callable[[list[GenerationRequest]], list[Sample]],
             score: Callable[[list[Sample]], list[ScoredSample]]) -> dict[str, float]:
    """One evaluation of the current policy; the same rows and seeds every time."""
    t0 = time.perf_counter()
    greedy_requests = data.eval_requests(settings.max_rows, 1, 0.0, seed=1)
    # two batches: a row's greedy and sampled requests share their (group, index) keys
    greedy = score(generate(greedy_requests))
    sampled = score(generate(data.eval_requests(settings.max_rows, settings.n, settings.temperature, seed=2))) \
        if settings.n > 0 else []
    metrics = eval_metrics(greedy, sampled, settings.n, settings.pass_threshold)
    metrics["time/eval_s"] = time.perf_counter() - t0
    return metrics
