"""The planner's step time for peers' published GPU runs, beside their published figures.

For each published configuration (NVIDIA NeMo-RL's performance summary, v0.5; verl's fully-async
recipe) the same work is described to our planner (`rl.plan.step_time.predict_step`): the model's
shape, the GPUs' datasheet peak and bandwidth (`rl/plan/flops.py`), the prompts x samples of a step,
the published mean generation length and its cap, the split of GPUs between generation and
training (colocated: they take turns; split with one step off-policy: they overlap), and how many
optimizer steps a GRPO step makes. The ratio is predicted / published step time. What the
planner does not model (KV-cache reads at long contexts, pipeline bubbles, FP8, stragglers) and
what is assumed where a figure was not published is stated per row; the published figures are
data, in bench/peer_figures.json. No GPU is needed: this is the planner's arithmetic. Results:
bench/results/peer_predictions.json, the table in docs/benchmarks.md.

    python -m bench.peer_predictions [--out bench/results/peer_predictions.json]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.machine import machine_info, parse_flags, write_result


@dataclass(frozen=True)
class Published:
    source: str
    model: str
    card: str
    gen_gpus: int  # GPUs generating (colocated: all of them)
    train_gpus: int
    colocated: bool
    tp: int  # generation tensor parallelism
    prompts: int
    n: int
    optimizer_steps: int  # per GRPO step (global batch / train batch)
    prompt_len: float  # mean prompt tokens (not published: assumed, see note)
    completion_len: float  # mean generated tokens
    longest: float  # the generation cap
    off_policy: int
    step_s: float  # published
    note: str
    length_published: bool = True  # False: completion_len is assumed (the implied one is solved for too)


FIGURES = json.loads(Path(__file__).with_name("peer_figures.json").read_text())
MODELS = FIGURES["models"]  # standard Hugging Face configs of the published models (the keys the FLOP count reads)
ROWS = [Published(**{**run, "source": FIGURES["sources"][run["source"]]}) for run in FIGURES["runs"]]


def implied_length(row: Published) -> float:
    """The mean generation length at which the prediction equals the published step (bisection)."""
    from dataclasses import replace

    low, high = 1.0, row.longest
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(replace(row, completion_len=mid)).step_s < row.step_s else (low, mid)
    return (low + high) / 2


def predict(row: Published):
    from rl.plan.flops import DATASHEET_GBPS, DATASHEET_TFLOPS
    from rl.plan.memory_plan import Settings
    from rl.plan.step_time import Host, Lengths, predict_step

    config = {k: v for k, v in MODELS[row.model].items() if k != "params"}
    params = MODELS[row.model]["params"]
    s = Settings(dtype="bfloat16", learners=row.train_gpus, rollout_workers=row.gen_gpus // row.tp,
                 tensor_parallel_size=row.tp, prompts_per_step=row.prompts, n=row.n, kl_coef=0.0,
                 mini_batches=row.optimizer_steps, recompute_old_logprobs=True, off_policy_steps=row.off_policy,
                 shared_prefix=False, gpus_per_learner=1.0, gpus_per_rollout_worker=1.0, hybrid=row.colocated)
    lengths = Lengths(row.prompt_len, row.completion_len, row.longest, "published mean; cap")
    host = Host(DATASHEET_TFLOPS[row.card][0], DATASHEET_GBPS[row.card], f"{row.card} datasheet")
    return predict_step(config, params * 2, s, lengths, host, trainable=int(params))


def main(argv: list[str] | None = None) -> None:
    args = parse_flags(__doc__, argv, out="bench/results/peer_predictions.json")
    out = []
    print(f"{'source':8} {'model':16} {'GPUs':>12} {'P x n':>8} {'mean/cap':>11} | {'published':>9} {'predicted':>9} "
          f"{'ratio':>6} | rollout learner sync")
    for row in ROWS:
        t = predict(row)
        ratio = t.step_s / row.step_s
        gpus = f"{row.gen_gpus}+{row.train_gpus} {row.card}" if not row.colocated else f"{row.gen_gpus} {row.card}"
        print(f"{row.source.split()[0]:8} {row.model:16} {gpus:>12} {row.prompts:>3} x {row.n:<3} "
              f"{row.completion_len:>5.0f}/{row.longest:<5.0f} | {row.step_s:>8.1f}s {t.step_s:>8.1f}s {ratio:>6.2f} | "
              f"{t.rollout_s:7.1f} {t.learner_s:7.1f} {t.sync_s:4.1f}   {row.note}")
        implied = None if row.length_published else implied_length(row)
        if implied is not None:
            print(f"{'':8} (the published step is predicted at a mean generation of {implied:,.0f} tokens)")
        out.append({**vars(row), "predicted_step_s": t.step_s, "ratio": ratio, "rollout_s": t.rollout_s,
                    "learner_s": t.learner_s, "sync_s": t.sync_s, "implied_completion_len": implied})
    write_result(args.out, {"machine": machine_info(), "rows": out})


if __name__ == "__main__":
    sys.exit(main())
