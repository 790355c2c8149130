"""The run directory's writers: metrics (JSONL + TensorBoard), sample generations, progress."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rl.types import ScoredSample

SUMMARY_KEYS = (("reward/mean", "reward {:.3f}"), ("actor/kl_nats", "kl {:.4f}"),
                ("actor/kl_in_reward_nats", "kl {:.4f}"), ("rollout/tokens_per_s", "{:.0f} tok/s"),
                ("time/step_s", "{:.1f} s"))


def summary_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step + 1}/{total}"]
    parts += [fmt.format(metrics[k]) for k, fmt in SUMMARY_KEYS if k in metrics]
    if metrics.get("reward/errors_count"):
        parts.append(f"{int(metrics['reward/errors_count'])} reward errors")
    return " | ".join(parts)


class RunLog:
    """Appends to <run>/metrics.jsonl, <run>/samples.jsonl and TensorBoard events in <run>/tb."""

    def __init__(self, run_dir: str, total_steps: int, progress: bool = True, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self._samples = open(os.path.join(run_dir, "samples.jsonl"), "a", buffering=1)
        self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step", disable=not progress,
                         dynamic_ncols=True)
        self.total_steps = total_steps

    def metrics(self, step: int, values: dict[str, float]) -> None:
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}
        self._metrics.write(json.dumps({"step": step, **clean}) + "\n")
        for k, v in clean.items():
            if v is not None:
                self._tb.add_scalar(k, v, step)
        self._tb.flush()
        self._bar.update(1)
        self._bar.write(summary_line(step, self.total_steps, values))

    def samples(self, step: int, scored: list[ScoredSample], keep: int) -> None:
        """The first `keep` samples of the step, plus every sample whose reward failed."""
        for i, s in enumerate(scored):
            if i < keep or s.error is not None:
                self._samples.write(json.dumps({"step": step, **s.to_log()}, default=str) + "\n")

    def write(self, message: str) -> None:
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        self._tb.close()
        self._metrics.close()
        self._samples.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """One row per step in step order; a step redone after a resume keeps its latest row."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]
