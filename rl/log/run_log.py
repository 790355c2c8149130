"""The run directory's writer, shared by RL, SFT and reward-model runs: config.yaml, metrics
(JSONL + TensorBoard), sample generations, summary.json, and the console.

On a terminal the console shows a progress bar with one line per step above it; anywhere else
(CI logs, `ray job submit` logs, a file) it prints the plain lines only, since a bar's carriage
returns would be glued to every line there.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rl.actors.faults import Failures

if TYPE_CHECKING:
    from rl.data.types import ScoredSample

SUMMARY_KEYS = (("reward/mean", "reward {:.3f}"), ("episode/turns_mean", "{:.1f} turns"),
                ("eval/greedy_mean_reward", "eval greedy {:.3f}"), ("eval/pass_at_1", "pass@1 {:.3f}"),
                ("actor/kl_nats", "kl {:.4f}"),
                ("actor/kl_in_reward_nats", "kl {:.4f}"), ("rollout/tokens_per_s", "{:.0f} tok/s"),
                ("perf/mfu", "eff. MFU {:.0%}"), ("cost/step_usd", "${:.4f}"), ("time/step_s", "{:.1f} s"))
# the step's time split, e.g. `(rollout 1.2 reward 0.1 score 0.0 train 1.9 sync 0.1)`
TIME_KEYS = (("time/rollout_s", "rollout"), ("time/reward_s", "reward"), ("time/score_s", "score"),
             ("time/train_s", "train"), ("time/sync_s", "sync"), ("time/wait_rollout_s", "waited"),
             ("time/eval_s", "eval"))


def summary_line(step: int, total: int, metrics: dict[str, float], failures: Failures | None = None) -> str:
    """The RL step line: reward, KL, throughput and time, e.g. `step 3/60 | reward 0.412 | ...`;
    `failures`: the step's failed samples, named by their most common cause (issue 58: a step whose
    every episode failed because the agent pool could not run them showed only a count)."""
    parts = [f"step {step + 1}/{total}" + _mode(metrics)]
    for k, fmt in SUMMARY_KEYS:
        if k == "perf/mfu":
            parts += utilisation_parts(metrics)
        elif k in metrics:
            parts.append(fmt.format(metrics[k]))
    split = [f"{name} {metrics[k]:.2f}" for k, name in TIME_KEYS if k in metrics and metrics[k] > 0]
    if split and "time/step_s" in metrics:
        parts[-1] += f" ({' '.join(split)})"
    if metrics.get("actor/skipped_updates_count"):  # never silent (issue 47)
        parts.append(f"{int(metrics['actor/skipped_updates_count'])} of {int(metrics.get('actor/updates_count', 1))} "
                     "updates skipped (gradients not finite)")
    if metrics.get("critic/skipped_updates_count"):  # the critic's too (issue 58)
        parts.append(f"{int(metrics['critic/skipped_updates_count'])} of {int(metrics.get('critic/updates_count', 1))} "
                     "critic updates skipped (gradients not finite)")
    signal = no_learning_signal(metrics)
    if signal:
        parts.append(signal)
    if failures is not None and failures.every:  # e.g. `32 of 32 episodes failed: task.agent=...: could not run`
        parts.append(failures.line())
    elif metrics.get("reward/errors_count"):
        agents = (f" ({int(metrics['agent/errors_count'])} agents failed, {int(metrics['agent/timeouts_count'])} "
                  "of them killed at task.agent_timeout_s)") if metrics.get("agent/errors_count") else ""
        parts.append(f"{int(metrics['reward/errors_count'])} reward errors{agents}"
                     + (f"; most often: {failures.cause}" if failures is not None else ""))
    return " | ".join(parts)


def utilisation_parts(metrics: dict[str, float]) -> list[str]:
    """The learner's utilisation in the step line, each figure named for what it is
    (rl/plan/flops.py `utilisation`): `HW 48%` (FLOPs the kernels computed per second over the
    measured peak) and `eff. MFU 91%` (the unshared model FLOPs of the trained tokens per second
    over the same peak; above HW where prefixes are shared). A hardware figure over 100% is
    printed as it is, with a warning naming the peak probe (it read the host too low)."""
    parts = []
    hw = metrics.get("perf/hw_util_frac")
    if hw is not None:
        part = f"HW {hw:.0%}"
        if hw > 1:
            peak = metrics.get("perf/peak_tflops")
            at = f" of {peak:.3g} TFLOP/s" if peak else ""
            part += (f" (warning: over 100%: the matmul peak probe, rl.plan.flops.matmul_peak_tflops{at}, "
                     "measured this host too low; set cluster.peak_tflops)")
        parts.append(part)
    effective = metrics.get("perf/effective_mfu_frac", metrics.get("perf/mfu"))
    if effective is not None:
        parts.append(f"eff. MFU {effective:.0%}")
    return parts


def no_learning_signal(metrics: dict[str, float]) -> str | None:
    """Why the step could not learn from its rewards, when it could not (issue 58: rewards that
    zeroed every advantage ran on with rc 0 and only `actor/grad_norm 0` in metrics.jsonl), else None.

    Every advantage 0 (`adv/nonzero_frac`, rl/algo/estimate.py): no sample had a reward, or every
    group's rewards were equal (`adv/flat_groups_frac`: group-relative estimators, GRPO, DAPO, GSPO,
    CISPO, RLOO, Dr.GRPO, give such a group 0); else an update that was applied with a gradient
    norm of exactly 0."""
    if metrics.get("adv/nonzero_frac", 1.0) == 0:
        if "reward/mean" not in metrics:
            cause = "no sample has a reward (every one is an error)"
        elif metrics.get("adv/flat_groups_frac", 0.0) >= 1:
            cause = "every group's rewards are equal"
        else:
            cause = "every advantage is 0"
        return f"no learning signal: {cause}"
    updates, skipped = metrics.get("actor/updates_count", 1), metrics.get("actor/skipped_updates_count", 0)
    if metrics.get("actor/grad_norm") == 0 and skipped < updates:
        return "no learning signal: actor/grad_norm 0 (the update changed nothing)"
    return None


def _mode(metrics: dict[str, float]) -> str:
    """How the step's samples were made, e.g. ` [streaming, <=1 behind]` (never a silent fallback)."""
    bound = int(metrics.get("policy/staleness_bound", 0))
    if metrics.get("rollout/streaming"):
        return f" [streaming, <={bound} behind]"
    return f" [batches <={bound} ahead]" if bound else ""


def row_line(title: str) -> Callable[[int, int, dict[str, float]], str]:
    """A step line that shows every finite value of the row, e.g. `sft step 20: train/loss 0.41 | ...`."""

    def line(step: int, _total: int, values: dict[str, float], _failures: Failures | None = None) -> str:
        shown = " | ".join(f"{k} {v:.4g}" for k, v in values.items() if math.isfinite(v))
        return f"{title} step {step}: {shown}"

    return line


def refuse_existing_run(run_dir: str) -> None:
    """A run directory that already holds a run (metrics.jsonl) is never written over."""
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise FileExistsError(
            f"run.dir={run_dir} already holds a run; choose another run.dir (RL runs: or continue it "
            "with run.resume=true)"
        )


def _on_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


class RunLog:
    """Appends to <run>/metrics.jsonl and <run>/samples.jsonl, and sends every row to the metric
    sinks `loggers` names (`rl.log.loggers`: TensorBoard events in <run>/tb, wandb, MLflow).

    `config_yaml` (when given) is written to <run>/config.yaml; a new run (`resume=False`) refuses
    a directory that already holds one. `config` (the resolved config as a dict) goes to the
    sinks, `sink_options` to `rl.log.loggers.make_sinks`. `line(step, total, values, failures)`
    formats a step's console line (`failures`: of the samples `samples` logged for that step).

    `rows()` is the run's metrics as this writer wrote them, the summary's source: not what
    anything else appended to metrics.jsonl meanwhile (issue 58: an agent appended rows there).
    """

    def __init__(self, run_dir: str, total_steps: int, *, title: str = "GRPO", progress: bool = True,
                 start_step: int = 0, config_yaml: str | None = None, resume: bool = False,
                 line: Callable[..., str] = summary_line,
                 loggers: Sequence[str] = ("tensorboard", "jsonl"), config: dict[str, Any] | None = None,
                 sink_options: dict[str, Any] | None = None):
        from tqdm import tqdm

        from rl.log.loggers import make_sinks

        if not resume:
            refuse_existing_run(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.total_steps, self._line = run_dir, total_steps, line
        if config_yaml is not None:
            with open(os.path.join(run_dir, "config.yaml"), "w") as f:
                f.write(config_yaml)
        path = os.path.join(run_dir, "metrics.jsonl")
        # a resumed run's steps before this one, as the file held them before anything of this run ran
        self._rows = _rows_before(path, start_step) if resume and os.path.exists(path) else {}
        self._metrics = open(path, "a", buffering=1)
        self._samples: Any = None
        self._failures: tuple[int, Failures | None] | None = None  # (step, its failed samples)
        self._sinks = make_sinks(loggers, run_dir, config or {}, **(sink_options or {}))
        self._bar = tqdm(total=total_steps, initial=start_step, desc=title, unit="step",
                         disable=not (progress and _on_terminal()), dynamic_ncols=True)
        self.started = time.perf_counter()

    def metrics(self, step: int, values: dict[str, float], *, advance: bool = True, echo: bool = True) -> None:
        """Append one row (non-finite values as null); `advance` moves the progress bar one
        step, `echo` prints the row's one-line summary."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}
        self._rows[step] = {"step": step, **clean}
        self._metrics.write(json.dumps(self._rows[step]) + "\n")
        finite = {k: v for k, v in clean.items() if v is not None}
        for sink in self._sinks:
            sink.log(step, finite)
        if advance:
            self._bar.update(1)
        if echo:
            failures = self._failures[1] if self._failures is not None and self._failures[0] == step else None
            self.write(self._line(step, self.total_steps, values, failures))

    def rows(self) -> list[dict[str, Any]]:
        """The rows `metrics` wrote (non-finite values as None), one per step in step order, after a
        resume's earlier rows (`start_step`) as metrics.jsonl held them when this writer opened it."""
        return [dict(self._rows[k]) for k in sorted(self._rows)]

    def samples(self, step: int, scored: list[ScoredSample], keep: int) -> None:
        """The first `keep` samples of the step, plus every sample whose reward failed."""
        self._failures = (step, Failures.of(scored))  # named on the step's line
        if self._samples is None:
            self._samples = open(os.path.join(self.run_dir, "samples.jsonl"), "a", buffering=1)
        for i, s in enumerate(scored):
            if i < keep or s.error is not None:
                self._samples.write(json.dumps({"step": step, **s.to_log()}, default=str) + "\n")

    def write(self, message: str) -> None:
        """A line on the console (above the bar on a terminal)."""
        if self._bar.disable:
            print(message, flush=True)
        else:
            self._bar.write(message)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write <run>/summary.json (with the run's wall time) and close; returns the summary."""
        summary = {**summary, "time/total_s": round(time.perf_counter() - self.started, 2)}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        for sink in self._sinks:
            sink.log_summary(summary)
        self.close()
        return summary

    def close(self) -> None:
        """Flush and close everything (again: a no-op)."""
        self._bar.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()


def _rows_before(path: str, step: int) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's rows of the steps before `step`."""
    return {k: row for k, row in metric_rows(path).items() if 0 <= k < step}


def metric_rows(path: str) -> dict[int, dict[str, Any]]:
    """A metrics.jsonl's rows by step (a step redone after a resume: its latest row); a line that
    does not parse (the one a running run is writing) is skipped."""
    rows: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows[row["step"]] = row
    return rows


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """One row per step in step order; a step redone after a resume keeps its latest row."""
    by_step = metric_rows(os.path.join(run_dir, "metrics.jsonl"))
    return [by_step[k] for k in sorted(by_step)]
