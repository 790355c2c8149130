"""Allocator benchmark: a CPU learner's train step under glibc's default malloc, glibc's heap with
freed memory kept and jemalloc with freed memory kept (launch/allocator.py: CPU learners start
with jemalloc, `trainer.cpu_allocator`).

The work is one GRPO update as the recipe makes it: SmolLM2-135M-Instruct (or `--model`), 8 chat
prompts of 47 tokens x 4 samples, completion lengths spread as sampled ones are (10-96 tokens,
four at the 96-token cap), the learner's default layout (shared prefix under `auto`); our
`LearnerWorker` (world size 1, ZeRO-2, DeepSpeed on gloo) as `bench.learner` builds it, learning
rate 1e-6 (a larger one drives random advantages into denormal weights within a few steps, which
slows fp32 matmuls on x86 and would time the denormals, not the allocator).

Each setting runs in its own child process (malloc reads its settings once, at start-up); the
children take turns (default, glibc, jemalloc, default...) so that load from other processes
falls on all alike. Per child: warm-up steps are excluded and the median train step is reported,
with the child's peak RSS (VmHWM). Ratios: default / setting step time (> 1: faster than glibc's
default) and jemalloc against glibc's kept heap.

`--recipe`: instead, the whole run as `bench.vs_trl` runs our side of its `smollm2` case (8 chat
prompts x 4 samples x up to 96 tokens, 6 steps, a real rollout, batches of another length every
step), once per setting (default: glibc's kept heap, `trainer.cpu_allocator=glibc`, and
jemalloc, the default), taking turns `--rounds` times; reported: the mean train phase and step of
steps 2-6. The `default` setting there forces glibc's defaults (`MALLOC_MMAP_MAX_=65536
MALLOC_TRIM_THRESHOLD_=131072 MALLOC_ARENA_MAX=8` in the driver's environment, which the actors
inherit in place of ours).

    python -m bench.allocator [--dtypes bfloat16,float32] [--rounds 2] [--steps 5] [--warmup 2]
                              [--settings default,glibc,jemalloc] [--model PATH] [--recipe]
                              [--out bench/results/allocator.json]
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


GLIBC_DEFAULTS = {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "8"}
SETTINGS = ("default", "glibc", "jemalloc")


def setting_env(name: str) -> dict[str, str]:
    """This process's environment less any malloc setting, plus setting `name`'s: glibc's defaults
    written out, or the settings a CPU learner actor starts with (launch/allocator.py `malloc_env`)."""
    from launch.allocator import jemalloc_library, malloc_env
    from trainer.heap import JEMALLOC_KEEP_FREED, KEEP_FREED_MEMORY

    env = {k: v for k, v in os.environ.items()
           if k not in {*KEEP_FREED_MEMORY, *JEMALLOC_KEEP_FREED, *GLIBC_DEFAULTS, "LD_PRELOAD"}}
    if name == "default":
        return {**env, **GLIBC_DEFAULTS}
    if name == "jemalloc" and jemalloc_library() is None:
        raise SystemExit("--settings jemalloc: this Ray build ships no libjemalloc.so")
    return {**env, **malloc_env(False, name, environ=env)}


def run_child(model: str, dtype: str, steps: int, warmup: int, setting: str) -> dict:
    code = f"from bench.allocator import child; child({model!r}, {dtype!r}, {steps}, {warmup})"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=setting_env(setting), capture_output=True,
                         text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"child ({dtype}, {setting}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def recipe_run(dtype: str, setting: str, work: str) -> dict:
    """Our side of bench.vs_trl's smollm2 case under `setting`; its steps 2-6 train phase and step."""
    env = {k: v for k, v in os.environ.items() if k not in GLIBC_DEFAULTS}
    if setting == "default":
        env.update(GLIBC_DEFAULTS)  # the actors inherit the driver's values in place of ours
    ours = "" if setting == "jemalloc" else "trainer.cpu_allocator=glibc"
    out = os.path.join(work, f"{dtype}-{setting}.json")
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    subprocess.run([sys.executable, "-m", "bench.vs_trl", "--shapes", "smollm2", "--dtypes", short, "--only", "ours",
                    "--steps", "6", "--warmup", "1", "--ours", ours, "--out", out], cwd=REPO, env=env, check=True,
                   capture_output=True, text=True, timeout=1800)
    ours_side = json.load(open(out))["cases"][0]["ours"]
    return {"train_s": ours_side["mean_split_s"]["time/train_s"], "step_s": ours_side["mean_step_s"]}


def _settings(arg: str) -> list[str]:
    names = [n for n in arg.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise SystemExit(f"--settings: unknown {unknown or arg!r}; choose from {', '.join(SETTINGS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=2, help="child processes per setting, taking turns")
    p.add_argument("--steps", type=int, default=5, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settings", default=None,
                   help="comma-separated, of default, glibc, jemalloc (default: all three; --recipe: glibc,jemalloc)")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (bench.models.REAL_MODELS)")
    p.add_argument("--recipe", action="store_true", help="whole runs of bench.vs_trl's smollm2 case instead")
    p.add_argument("--out", default=None, help="default: bench/results/allocator.json (allocator_recipe.json)")
    args = p.parse_args(argv)
    if args.recipe:
        return main_recipe(args)
    args.out = args.out or "bench/results/allocator.json"
    from bench.models import real_model

    model = args.model or str(real_model("smollm2").resolve())
    settings = _settings(args.settings or ",".join(SETTINGS))
    rows = []
    for dtype in args.dtypes.split(","):
        runs: dict[str, list[dict]] = {name: [] for name in settings}
        for _ in range(args.rounds):
            for name in settings:
                runs[name].append(run_child(model, dtype, args.steps, args.warmup, name))
        row: dict = {"dtype": dtype}
        for name, results in runs.items():
            row[name] = {"median_train_s": statistics.median(t for r in results for t in r["train_s"]),
                         "train_s": [r["train_s"] for r in results],
                         "peak_rss_gib": max(r["peak_rss_gib"] for r in results)}
        _add_ratios(row, settings, "median_train_s")
        rows.append(row)
        print(f"{dtype}: " + "; ".join(f"{name} {row[name]['median_train_s']:.2f} s, peak RSS "
                                       f"{row[name]['peak_rss_gib']:.2f} GiB" for name in settings)
              + "; " + ", ".join(f"{k} {v:.2f}x" for k, v in row.items() if k.startswith("speedup")), flush=True)
    write_result(args.out, {"machine": machine_info(), "model": model, "settings": vars(args), "rows": rows})
    print(f"wrote {args.out}")


def _add_ratios(row: dict, settings: list[str], key: str) -> None:
    """Speed-ups of each setting against glibc's default and of jemalloc against glibc's kept heap."""
    for name in settings:
        if name != "default" and "default" in settings:
            row[f"speedup_{name}_vs_default"] = row["default"][key] / row[name][key]
    if "glibc" in settings and "jemalloc" in settings:
        row["speedup_jemalloc_vs_glibc"] = row["glibc"][key] / row["jemalloc"][key]


def main_recipe(args: argparse.Namespace) -> None:
    import tempfile

    settings = _settings(args.settings or "glibc,jemalloc")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[dict]] = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name in settings:
                    runs[name].append(recipe_run(dtype, name, work))
            row: dict = {"dtype": dtype, **{name: {"mean_train_s": statistics.mean(r["train_s"] for r in rs),
                                                   "mean_step_s": statistics.mean(r["step_s"] for r in rs), "runs": rs}
                                            for name, rs in runs.items()}}
            _add_ratios(row, settings, "mean_train_s")
            rows.append(row)
            print(f"{dtype} recipe: " + "; ".join(f"{name} train phase {row[name]['mean_train_s']:.2f} s, step "
                                                   f"{row[name]['mean_step_s']:.2f} s" for name in settings)
                  + "; " + ", ".join(f"train {k} {v:.2f}x" for k, v in row.items() if k.startswith("speedup")),
                  flush=True)
    out = args.out or "bench/results/allocator_recipe.json"
    write_result(out, {"machine": machine_info(), "settings": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
