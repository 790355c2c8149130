"""Delta weight syncs on the real model: bytes and seconds per sync with `trainer.delta_sync` on
and off, in real training runs.

Each configuration is a short real run of the SmolLM2 recipe (`python -m launch.train
model=smollm2 task=math_chat`, lr 1e-5 after a 2-step warm-up, its own run.dir) that logs every
step's `sync/weights_mb`, `sync/sent_frac` (of the whole weights) and `time/sync_s` (the driver's
wall time of the sync: the learner's export, the wire, the receiver's load into vLLM). The first
delta sync after the engines joined is whole by design, so the figures are taken from step 2 on.
Runs: bf16 (the recipe's dtype) with and without delta syncs, and fp32 with them (every fp32
value moves each step: the delta falls back to whole buckets). Runs take turns (2 cores).

    python -m bench.delta_sync [--steps 4] [--runs bf16,bf16_delta,fp32_delta] [--out bench/results/delta_sync.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import machine_info, write_result

RECIPE = ["model=smollm2", "task=math_chat", "eval.every_steps=0", "run.save_every=0"]
RUNS = {
    "bf16": ["model.dtype=bfloat16", "trainer.delta_sync=false"],
    "bf16_delta": ["model.dtype=bfloat16", "trainer.delta_sync=true"],
    "fp32_delta": ["model.dtype=float32", "trainer.delta_sync=true"],
}


def run(name: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "launch.train", *RECIPE, *RUNS[name], f"run.steps={steps}", f"run.dir={run_dir}"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    rows = [r for r in rows if "sync/weights_mb" in r]
    later = rows[1:]
    out = {"per_step": [{"step": r.get("step"), "mb": r["sync/weights_mb"], "sent_frac": r["sync/sent_frac"],
                         "sync_s": r["time/sync_s"]} for r in rows],
           "mb": statistics.median(r["sync/weights_mb"] for r in later),
           "sent_frac": statistics.median(r["sync/sent_frac"] for r in later),
           "sync_s": statistics.median(r["time/sync_s"] for r in later)}
    print(f"{name:>11}: {out['mb']:8.1f} MiB per sync ({out['sent_frac']:.3%} of the weights), "
          f"{out['sync_s']:.3f} s per sync (median of steps 2-{steps})", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", default="bench/results/delta_sync.json")
    args = parser.parse_args(argv)
    info = machine_info()
    results = {name: run(name, args.steps) for name in args.runs.split(",")}
    summary = {}
    if "bf16" in results and "bf16_delta" in results:
        full, delta = results["bf16"], results["bf16_delta"]
        summary = {"bf16_bytes_ratio": delta["mb"] / full["mb"], "bf16_seconds_ratio": delta["sync_s"] / full["sync_s"]}
        print(f"bf16 delta / whole: bytes {summary['bf16_bytes_ratio']:.3f}x, seconds {summary['bf16_seconds_ratio']:.2f}x")
    write_result(args.out, {"machine": info, "settings": {"steps": args.steps, "recipe": RECIPE, "runs": RUNS},
                            "results": results, "summary": summary})


if __name__ == "__main__":
    sys.exit(main())
