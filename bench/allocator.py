"""Allocator benchmark: a CPU learner's train step with glibc's default malloc against the settings
our CPU actors start with (launch/allocator.py: freed memory kept for reuse, no mmap'd chunks).

The work is one GRPO update as the recipe makes it: SmolLM2-135M-Instruct (or `--model`), 8 chat
prompts of 47 tokens x 4 samples, completion lengths spread as sampled ones are (10-96 tokens,
four at the 96-token cap), the learner's default layout (shared prefix under `auto`); our
`LearnerWorker` (world size 1, ZeRO-2, DeepSpeed on gloo) as `bench.learner` builds it, learning
rate 1e-6 (a larger one drives random advantages into denormal weights within a few steps, which
slows fp32 matmuls on x86 and would time the denormals, not the allocator).

Each setting runs in its own child process (glibc reads the settings once, at start-up); the
children take turns (default, kept, default, kept...) so that load from other processes falls on
both alike. Per child: warm-up steps are excluded and the median train step is reported, with the
child's peak RSS (VmHWM). Ratio = default / kept step time (> 1: the kept heap is faster).

`--recipe`: instead, the whole run as `bench.vs_trl` runs our side of its `smollm2` case (8 chat
prompts x 4 samples x up to 96 tokens, 6 steps, a real rollout, batches of another length every
step), once with glibc's defaults forced (`MALLOC_MMAP_MAX_=65536 MALLOC_TRIM_THRESHOLD_=131072
MALLOC_ARENA_MAX=8` in the driver's environment, which the actors inherit in place of ours) and
once with ours, taking turns `--rounds` times; reported: the mean train phase of steps 2-6.

    python -m bench.allocator [--dtypes bfloat16,float32] [--rounds 2] [--steps 5] [--warmup 2]
                              [--model PATH] [--recipe] [--out bench/results/allocator.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.machine import REPO, machine_info, write_result

PROMPT_TOKENS, GROUPS, GROUP_SIZE = 47, 8, 4
COMPLETIONS = [96, 20, 30, 41, 12, 96, 35, 28, 50, 22, 18, 96, 40, 33, 27, 60,
               15, 25, 35, 45, 96, 10, 22, 38, 31, 29, 55, 70, 12, 24, 36, 48]


def grpo_batch(vocab: int, seed: int = 0):
    """A right-padded TrainBatch of GROUPS prompts x GROUP_SIZE samples, each group's rows sharing
    their prompt's token ids (what lets the shared-prefix layout compute it once)."""
    import torch

    from rl.data.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    rows, width = GROUPS * GROUP_SIZE, PROMPT_TOKENS + max(COMPLETIONS)
    ids = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask, rollout_lp = torch.zeros((rows, width - 1)), torch.zeros((rows, width - 1))
    for group in range(GROUPS):
        prompt = torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g)
        for k in range(GROUP_SIZE):
            i = group * GROUP_SIZE + k
            c = COMPLETIONS[i]
            ids[i, :PROMPT_TOKENS] = prompt
            ids[i, PROMPT_TOKENS:PROMPT_TOKENS + c] = torch.randint(3, vocab, (c,), generator=g)
            attention[i, :PROMPT_TOKENS + c] = 1
            loss_mask[i, PROMPT_TOKENS - 1:PROMPT_TOKENS - 1 + c] = 1.0
            rollout_lp[i, PROMPT_TOKENS - 1:PROMPT_TOKENS - 1 + c] = -3.0 + 0.1 * torch.randn(c, generator=g)
    advantages = torch.randn(rows, generator=g)[:, None] * loss_mask
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, rollout_logprobs=rollout_lp,
                      advantages=advantages, group_ids=torch.arange(rows) // GROUP_SIZE, policy_version=0)


def child(model: str, dtype: str, steps: int, warmup: int) -> None:
    """One setting's measurement, printed as one JSON line (runs in the child process)."""
    import torch
    from transformers import AutoConfig

    from bench.learner import Ours

    ours = Ours(model, dtype, zero_stage=2, budget=0, kl=False, threads=torch.get_num_threads(), peak=1.0,
                lr=1e-6)  # see the module doc: no denormal weights
    batch = grpo_batch(AutoConfig.from_pretrained(model).vocab_size)
    times = [ours.step(batch)["train_s"] for _ in range(warmup + steps)][warmup:]
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"train_s": times, "peak_rss_gib": hwm / 2**20}), flush=True)


def run_child(model: str, dtype: str, steps: int, warmup: int, kept: bool) -> dict:
    from launch.allocator import KEEP_FREED_MEMORY

    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY}
    if kept:
        env.update(KEEP_FREED_MEMORY)
    code = f"from bench.allocator import child; child({model!r}, {dtype!r}, {steps}, {warmup})"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"child ({dtype}, kept={kept}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


GLIBC_DEFAULTS = {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "8"}


def recipe_run(dtype: str, kept: bool, work: str) -> dict:
    """Our side of bench.vs_trl's smollm2 case with the given heap; its steps 2-6 train phase."""
    from launch.allocator import KEEP_FREED_MEMORY

    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY}
    if not kept:
        env.update(GLIBC_DEFAULTS)
    out = os.path.join(work, f"{dtype}-{'kept' if kept else 'default'}.json")
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    subprocess.run([sys.executable, "-m", "bench.vs_trl", "--shapes", "smollm2", "--dtypes", short, "--only", "ours",
                    "--steps", "6", "--warmup", "1", "--out", out], cwd=REPO, env=env, check=True,
                   capture_output=True, text=True, timeout=1800)
    ours = json.load(open(out))["cases"][0]["ours"]
    return {"train_s": ours["mean_split_s"]["time/train_s"], "step_s": ours["mean_step_s"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=2, help="child processes per setting, taking turns")
    p.add_argument("--steps", type=int, default=5, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (bench.models.REAL_MODELS)")
    p.add_argument("--recipe", action="store_true", help="whole runs of bench.vs_trl's smollm2 case instead")
    p.add_argument("--out", default=None, help="default: bench/results/allocator.json (allocator_recipe.json)")
    args = p.parse_args(argv)
    if args.recipe:
        return main_recipe(args)
    args.out = args.out or "bench/results/allocator.json"
    from bench.models import real_model

    model = args.model or str(real_model("smollm2").resolve())
    rows = []
    for dtype in args.dtypes.split(","):
        runs: dict[str, list[dict]] = {"default": [], "kept": []}
        for _ in range(args.rounds):
            for name in ("default", "kept"):
                runs[name].append(run_child(model, dtype, args.steps, args.warmup, kept=name == "kept"))
        row = {"dtype": dtype}
        for name, results in runs.items():
            row[name] = {"median_train_s": statistics.median(t for r in results for t in r["train_s"]),
                         "train_s": [r["train_s"] for r in results],
                         "peak_rss_gib": max(r["peak_rss_gib"] for r in results)}
        row["speedup"] = row["default"]["median_train_s"] / row["kept"]["median_train_s"]
        row["rss_ratio"] = row["kept"]["peak_rss_gib"] / row["default"]["peak_rss_gib"]
        rows.append(row)
        print(f"{dtype}: train step {row['default']['median_train_s']:.2f} s (glibc default) -> "
              f"{row['kept']['median_train_s']:.2f} s (freed memory kept) = {row['speedup']:.2f}x; peak RSS "
              f"{row['default']['peak_rss_gib']:.2f} -> {row['kept']['peak_rss_gib']:.2f} GiB ({row['rss_ratio']:.2f}x)",
              flush=True)
    write_result(args.out, {"machine": machine_info(), "model": model, "settings": vars(args), "rows": rows})
    print(f"wrote {args.out}")


def main_recipe(args: argparse.Namespace) -> None:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[dict]] = {"default": [], "kept": []}
            for _ in range(args.rounds):
                for name in ("default", "kept"):
                    runs[name].append(recipe_run(dtype, name == "kept", work))
            row = {"dtype": dtype, **{name: {"mean_train_s": statistics.mean(r["train_s"] for r in rs),
                                             "mean_step_s": statistics.mean(r["step_s"] for r in rs), "runs": rs}
                                      for name, rs in runs.items()}}
            row["train_speedup"] = row["default"]["mean_train_s"] / row["kept"]["mean_train_s"]
            row["step_speedup"] = row["default"]["mean_step_s"] / row["kept"]["mean_step_s"]
            rows.append(row)
            print(f"{dtype} recipe: train phase {row['default']['mean_train_s']:.2f} s (glibc default) -> "
                  f"{row['kept']['mean_train_s']:.2f} s (kept) = {row['train_speedup']:.2f}x; step "
                  f"{row['default']['mean_step_s']:.2f} -> {row['kept']['mean_step_s']:.2f} s = "
                  f"{row['step_speedup']:.2f}x", flush=True)
    out = args.out or "bench/results/allocator_recipe.json"
    write_result(out, {"machine": machine_info(), "settings": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
