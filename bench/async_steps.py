"""Asynchronous rollouts: synchronous steps vs batches made one step ahead
(`algorithm.off_policy_steps=1`) vs streaming (`rollout.mode=streaming`, in-flight weight
updates, same staleness bound), in one job.

Generation of the next batch overlaps the update on this one only where rollout and learner have
compute of their own. This 2-core machine has two phases that each use both cores, so the bench
runs the disaggregated layout a GPU cluster has: one core per role (`cluster.threads_per_worker=1`:
the rollout worker on one core, the learner rank on the other). Same shape as `bench.vs_trl`'s
27m row (8 prompts x 4 samples x 128 tokens, random-init 27M Llama, bf16).

Targets: off_policy_steps=1 median step time <= 0.75x of off_policy_steps=0; streaming >= 1.3x
the samples/s of off_policy_steps=1. Streaming gains where lengths have a long tail (`--shape
varlen`, geometric lengths of mean 40 cut at 128; or the real model with a large
max_new_tokens): a batch waits for its slowest sample, a stream does not.

On GPUs (`--device cuda`, the default where torch sees one; two needed) the roles have devices of
their own already: both runs use the GPU profile (`cluster=local_gpu`, the learner rank and the
rollout worker on a GPU each) instead of `cluster.threads_per_worker=1`.

    python -m bench.async_steps [--shape 27m] [--dtype bf16] [--steps 8] [--device cpu|cuda]
                                [--modes sync,ahead,streaming] [--out bench/results/async_steps.json]
"""

from __future__ import annotations

import argparse
import statistics

from bench import models
from bench.machine import add_device_arg, machine_info, resolve_device, write_result
from bench.vs_trl import CHAT_SHAPES, SHAPES, Case, run_ours, train_file_for

TARGET = 0.75
STREAM_TARGET = 1.3
MODES = {"sync": "algorithm.off_policy_steps=0", "ahead": "algorithm.off_policy_steps=1",
         "streaming": "algorithm.off_policy_steps=1 rollout.mode=streaming",
         # a looser staleness bound: batches 2 ahead; a stream whose slow groups may land a step later
         "ahead2": "algorithm.off_policy_steps=2", "streaming2": "algorithm.off_policy_steps=2 rollout.mode=streaming"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="27m", choices=list(SHAPES))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up, first sync)")
    p.add_argument("--extra", default="", help="more overrides for both runs")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default="bench/results/async_steps.json")
    p.add_argument("--modes", default="sync,ahead,streaming", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--verbose", action="store_true")
    add_device_arg(p, "both runs")
    args = p.parse_args(argv)
    gpu = resolve_device(p, args, 2, "a learner rank and a rollout worker on a GPU each") == "cuda"
    # CPU: one core per role; GPUs: run_ours adds the GPU profile (a GPU per role)
    layout = "cluster=local_gpu" if gpu else "cluster.threads_per_worker=1"

    prompts, samples, new_tokens, _ = SHAPES[args.shape]
    case = Case(args.shape, args.dtype, prompts, samples, new_tokens, TARGET)
    # a chat shape (smollm2, ...): the real model on bench.vs_trl's chat prompts; else a built model on sums
    model = models.build(CHAT_SHAPES.get(args.shape, args.shape))
    data = train_file_for(args.shape) if args.shape in CHAT_SHAPES else models.write_data()
    results = {}
    for mode in args.modes.split(","):
        run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, verbose=args.verbose,
                                      timeout_s=args.timeout_s, device=args.device,
                                      ours=f"{'' if gpu else layout + ' '}{MODES[mode]} {args.extra}")
        print(f"{mode} ({MODES[mode]}): running {args.steps} steps ...", flush=True)
        results[mode] = run_ours(case, model, data, run_args)
    print(f"\n{'mode':>10} | {'median step s':>13} | {'samples/s':>9} | split (mean s)")
    for mode, r in results.items():
        split = " ".join(f"{key.split('/')[1][:-2]} {v:.2f}" for key, v in r["mean_split_s"].items()
                         if key != "time/step_s")
        print(f"{mode:>10} | {r['median_step_s']:>13.2f} | {r['samples_per_s']:>9.2f} | {split}")
    out = {"machine": machine_info(), "shape": args.shape, "dtype": args.dtype, "device": args.device,
           "layout": layout.removeprefix("cluster."), **results,
           "reward_mean": {m: statistics.fmean(x for x in r["reward_mean"] if x is not None)
                           for m, r in results.items()}}
    if {"sync", "ahead"} <= results.keys():
        ratio = results["ahead"]["median_step_s"] / results["sync"]["median_step_s"]
        out.update(ratio_step_time=ratio, target=TARGET, passed=ratio <= TARGET)
        print(f"step time ratio ahead/sync: {ratio:.2f} (target <= {TARGET}) {'PASS' if ratio <= TARGET else 'FAIL'}")
    if {"ahead", "streaming"} <= results.keys():
        gain = results["streaming"]["samples_per_s"] / results["ahead"]["samples_per_s"]
        out.update(streaming_vs_ahead=gain, streaming_target=STREAM_TARGET, streaming_pass=gain >= STREAM_TARGET)
        print(f"samples/s streaming/ahead: {gain:.2f}x (target >= {STREAM_TARGET}) "
              f"{'PASS' if gain >= STREAM_TARGET else 'FAIL'}")
    write_result(args.out, out)


if __name__ == "__main__":
    main()
