"""Evaluation during training: held-out rows (`eval.files`), answered greedily once and sampled
`eval.n` times (0: greedy only), scored like training samples (reward functions, or an episode's environment).

Logged in the step's metrics (so in metrics.jsonl and TensorBoard) before that step's update:
`eval/greedy_mean_reward`, `eval/sampled_mean_reward`, `eval/greedy_pass_frac`, and over the n
sampled completions of each row (a sample passes when its reward is at least `eval.pass_threshold`):

- `eval/pass_at_<k>` for k = 1, n and each of `eval.k`: the unbiased pass@k of Chen et al. 2021
  (1 - C(n-c, k) / C(n, k) with c of the n passing), averaged over rows;
- `eval/avg_at_<n>`: the share of all n samples that pass (the mean accuracy of one sample);
- `eval/greedy_pass_frac/<value>`, `eval/greedy_mean_reward/<value>` (with `eval.group_by`, a
  column of the rows): the same over the rows holding each value of it (e.g. each dataset);
- `eval/maj_at_<k>` (with `eval.answer`, the answer extractor: `final_answer`, the answer
  `math_answer` checks): majority vote over the answers of each row's first k samples, the most
  frequent answer winning (ties: the one seen first; samples without an answer do not vote), right
  when the samples holding it pass; a row with no answer at all counts as wrong.
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


def answer_extractor(name: str) -> Callable[[str], str | None] | None:
    """`eval.answer`'s function giving a completion's answer for maj@k ("": none, maj@k not
    logged). Built-in ones only (the schema lists them): no user code runs in the driver."""
    if not name:
        return None
    from rl.data.answers import final_answer

    return {"final_answer": final_answer}[name]


def majority_passes(answers: list[str | None], passed: list[bool]) -> bool:
    """Majority vote: the most frequent answer (ties: the first seen; None does not vote) is right
    when the samples that gave it passed (all of them: answers are compared as strings, so two
    samples with one answer and different verdicts make it wrong)."""
    votes: dict[str, list[bool]] = {}
    for answer, ok in zip(answers, passed, strict=True):
        if answer is not None:
            votes.setdefault(answer, []).append(ok)
    if not votes:
        return False
    top = max(votes.values(), key=len)  # max keeps the first of equals: insertion order
    return all(top)


def eval_metrics(greedy: list[ScoredSample], sampled: list[ScoredSample], n: int,
                 threshold: float, ks: list[int] | tuple[int, ...] = (),
                 answer: Callable[[str], str | None] | None = None, group_by: str = "") -> dict[str, float]:
    """Figures over scored samples; a sample whose reward failed counts as not passing (and as an
    error), so a broken scorer cannot make the model look better. `ks`: more k for pass@k and
    maj@k (each at most n); `answer`: a completion's answer for maj@k (None: no maj@k); `group_by`:
    a row column whose values split the greedy figures too ("": none)."""
    def reward(s: ScoredSample) -> float:
        return s.reward if s.reward is not None else 0.0

    def passes(s: ScoredSample) -> bool:
        return s.reward is not None and s.reward >= threshold

    out = {"eval/rows_count": float(len(greedy)),
           "eval/errors_count": float(sum(s.error is not None for s in greedy + sampled))}
    if greedy:
        out["eval/greedy_mean_reward"] = statistics.fmean(map(reward, greedy))
        out["eval/greedy_pass_frac"] = statistics.fmean(map(passes, greedy))
    if group_by:
        groups: dict[str, list[ScoredSample]] = {}
        for s in greedy:
            groups.setdefault(str(s.sample.metadata.get(group_by)), []).append(s)
        for value, members in sorted(groups.items()):
            out[f"eval/greedy_mean_reward/{value}"] = statistics.fmean(map(reward, members))
            out[f"eval/greedy_pass_frac/{value}"] = statistics.fmean(map(passes, members))
    if sampled:
        out["eval/sampled_mean_reward"] = statistics.fmean(map(reward, sampled))
        by_row: dict[int, list[ScoredSample]] = {}
        for s in sorted(sampled, key=lambda s: (s.sample.group_id, s.sample.sample_index)):
            by_row.setdefault(s.sample.group_id, []).append(s)
        rows = [[passes(s) for s in row] for row in by_row.values()]
        for k in sorted({1, n, *ks}):
            out[f"eval/pass_at_{k}"] = statistics.fmean(pass_at_k(len(p), sum(p), k) for p in rows)
        out[f"eval/avg_at_{n}"] = statistics.fmean(ok for p in rows for ok in p)
        if answer is not None:
            answers = [[answer(s.sample.completion_text) for s in row] for row in by_row.values()]
            for k in sorted({1, n, *ks}):
                out[f"eval/maj_at_{k}"] = statistics.fmean(majority_passes(a[:k], p[:k]) for a, p in zip(answers, rows))
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
    metrics = eval_metrics(greedy, sampled, settings.n, settings.pass_threshold, settings.k,
                           answer_extractor(settings.answer), settings.group_by)
    metrics["time/eval_s"] = time.perf_counter() - t0
    return metrics


class Evaluation:
    """The evaluation stage of a run: before the first update, every `eval.every_steps`, and the
    trained policy's own row after the last step; nothing without `eval.files` (`data` None)."""

    def __init__(self, settings: EvalConfig, data: PromptDataset | None,
                 generate: Callable[[list[GenerationRequest]], list[Sample]],
                 score: Callable[[list[Sample]], list[ScoredSample]]):
        self.settings, self.data, self.generate, self.score = settings, data, generate, score

    def before(self, step: int) -> dict[str, float]:
        """Step `step`'s evaluation, made before its update, if one is due (else {})."""
        if self.data is None or not due(self.settings, step):
            return {}
        return evaluate(self.settings, self.data, self.generate, self.score)

    def after(self, log, start_step: int, steps: int) -> None:
        """The trained policy's evaluation: a row of its own in `log`, at step `steps`."""
        if self.data is None or self.settings.every_steps <= 0 or start_step >= steps:
            return
        final = evaluate(self.settings, self.data, self.generate, self.score)
        log.metrics(steps, final, advance=False, echo=False)
        log.write(f"evaluation after step {steps}: " + " | ".join(
            f"{k.removeprefix('eval/')} {v:.3f}" for k, v in final.items() if not k.endswith("_count")))
