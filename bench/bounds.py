"""Each phase of a step against its own bound, on the real model, in one job (issue 62.4).

A step is rollout, then the learner's update, then the weight sync (or, one step off-policy,
rollout beside the update). Each phase is measured by its own benchmark against the bare library
doing the same work, here run one after another on SmolLM2-135M-Instruct (30 layers, 49k vocab):

| phase | ours | its bound | target |
|---|---|---|---|
| rollout | `RolloutFleet.generate` (Ray actor) | `vllm.LLM.generate`, same prompts, seeds, engine settings (`bench.rollout`) | >= 0.9x tokens/s |
| learner | `LearnerWorker` score + train, rows packed end to end | a bare PyTorch forward/backward/AdamW step over the padded rows (`bench.learner`, `varlen`) | >= 1.0x tokens/s |
| sync | `WeightSync.sync` learner -> vLLM worker (Ray actors) | a raw gloo broadcast of the same bytes plus vLLM's own `reload_weights` (`bench.weight_sync`, `raw+load`) | >= 0.8x GB/s |
| off-policy | a steady step of `algorithm.off_policy_steps=1` (median; the run's last step, with nothing generated beside it, left out) | max(rollout, train) of the lock-step run's phases, one core per role, both runs with every completion 32 tokens (`SAME_WORK`: the same work) (`bench.async_steps`) | <= 1.15x |

Each sub-benchmark writes its own JSON (its figures and splits); this one reads them back and
writes the table (`bench/results/bounds.json`). The off-policy row also gives each phase's time
beside the other against the same phase in lock step (`slowdown_beside`) and the step over
max(those) + sync (`step_over_overlap`): what the host's co-running costs, apart from what the
overlap loses. Ratios only: both sides of a row run in the
same job, interleaved where the sub-benchmark does so. A phase that fails is recorded with its
error and the others still run; `--only` reruns some phases and keeps the rows of the others
already in `--out` (same dtype), each row dated by its own run.

    python -m bench.bounds [--dtype bfloat16|float32] [--only rollout,learner,sync,offpolicy]
        [--out bench/results/bounds.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import machine_info, write_result

PHASES = ("rollout", "learner", "sync", "offpolicy")
TARGETS = {"rollout": (">=", 0.9), "learner": (">=", 1.0), "sync": (">=", 0.8), "offpolicy": ("<=", 1.15)}


def _run(module: str, args: list[str], out: Path, log: Path) -> dict:
    """`python -m <module> <args> --out <out>`, its output kept in `log`; its JSON."""
    cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    started = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{module} failed (rc {done.returncode}); its output: {log}\n"
                         + log.read_text()[-3000:])
    print(f"  {module}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(out.read_text())


def rollout(dtype: str, work: Path) -> dict:
    r = _run("bench.rollout", ["--shape", "smollm2", "--batches", "8x8", "--repeats", "3", "--dtype", dtype],
             work / "rollout.json", work / "rollout.log")["results"][0]
    return {"ratio": r["ratio"], "ours": f"{r['fleet_tokens_per_s']:.0f} tokens/s",
            "bound": f"{r['raw_tokens_per_s']:.0f} tokens/s", "batch": r["batch"], "same_tokens": r["same_tokens"]}


def learner(dtype: str, model: str, work: Path) -> dict:
    rows = _run("bench.learner", ["--model", model, "--shapes", "varlen", "--dtypes", dtype, "--steps", "3",
                                  "--warmup", "1"], work / "learner.json", work / "learner.log")["rows"]
    r = rows[0]
    return {"ratio": r["ratio"], "ours": f"{r['ours']['tokens_per_s']:.0f} tokens/s",
            "bound": f"{r['bare']['tokens_per_s']:.0f} tokens/s", "shape": r["shape"],
            "trained_tokens": r["trained_tokens"], "padded_tokens": r["padded_tokens"]}


def sync(work: Path) -> dict:
    r = _run("bench.weight_sync", ["--shapes", "smollm2", "--repeats", "5"], work / "sync.json",
             work / "sync.log")["results"][0]
    return {"ratio": r["ours_over_raw_load"], "ours": f"{r['ours_gb_per_s']:.2f} GB/s",
            "bound": f"{r['raw_load_gb_per_s']:.2f} GB/s", "mib": round(r["mib"], 1),
            "ours_split_s": r.get("ours_split_s"), "bound_split_s": r.get("raw_load_split_s")}


# Both modes do the same work: every completion runs to 32 tokens (`rollout.ignore_eos`). Stopping
# at EOS, the two runs' batches differ: lock step, each batch comes from the newest policy, which
# soon answers shorter; one ahead, from the one before (12-04, fp32: 1,414-1,574 completion tokens a
# steady step against 1,836-2,064), so the lock-step phases were a bound for less work than the
# off-policy step did.
SAME_WORK = ("rollout.ignore_eos=true", "rollout.max_new_tokens=32")


def offpolicy(dtype: str, work: Path, steps: int = 6, warmup: int = 2) -> dict:
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    # fp32 at the default micro-batch needs ~29 GiB (launch.plan's preflight refuses it on a 24 GiB
    # host): 16 rows per micro-batch, as bench.vs_trl's fp32 8x8 rows run, in both modes alike
    overrides = [*SAME_WORK, *(["trainer.micro_batch_size=16"] if dtype == "float32" else [])]
    r = _run("bench.async_steps", ["--shape", "smollm2_n8", "--dtype", short, "--modes", "sync,ahead", "--steps",
                                   str(steps), "--warmup", str(warmup), "--extra", " ".join(overrides)],
             work / "offpolicy.json", work / "offpolicy.log")
    split = r["sync"]["mean_split_s"]
    bound = max(split["time/rollout_s"], split["time/train_s"])
    tokens = {mode: r[mode]["completion_tokens"] for mode in ("sync", "ahead")}
    return {**overlap(r["ahead"]["split_s"], split, warmup), "bound": f"{bound:.2f} s (rollout "
            f"{split['time/rollout_s']:.2f}, train {split['time/train_s']:.2f})",
            "lock_step": f"{r['sync']['median_step_s']:.2f} s/step", "layout": r.get("layout"),
            "completion_tokens": tokens, "same_work": tokens["sync"] == tokens["ahead"],
            "overrides": " ".join(overrides)}


def overlap(ahead: dict[str, list[float]], lock_step: dict[str, float], warmup: int) -> dict:
    """The off-policy run's steady steps, and each phase beside the other against itself alone.

    One ahead, step k trains while batch k+1 is made, except the run's last step: nothing is made
    beside it, so it is left out of the steady steps (it would flatter the median). Batch k's
    `time/rollout_s` is the generation that ran beside step k-1's update. The slowdowns (phase beside
    the other / the same phase in lock step) tell the host's cost of running both at once from time
    the overlap itself loses (a step over max(train, rollout beside) + sync)."""
    steps = len(ahead["time/step_s"])
    steady = range(max(warmup, 1), steps - 1)
    if not steady:
        raise SystemExit(f"bench.bounds offpolicy: {steps} steps leave no steady one after {warmup} warm-up")
    pick = lambda key: [ahead[key][k] for k in steady]  # noqa: E731
    step_s, train_s, rollout_s = statistics.median(pick("time/step_s")), pick("time/train_s"), pick("time/rollout_s")
    beside = {"train_s": statistics.fmean(train_s), "rollout_s": statistics.fmean(rollout_s),
              "sync_s": statistics.fmean(pick("time/sync_s"))}
    bound = max(lock_step["time/rollout_s"], lock_step["time/train_s"])
    return {"ratio": step_s / bound, "ours": f"{step_s:.2f} s/step", "steady_steps": list(steady),
            "beside": beside, "last_step_train_alone_s": ahead["time/train_s"][-1],
            "slowdown_beside": {"train": beside["train_s"] / lock_step["time/train_s"],
                                "rollout": beside["rollout_s"] / lock_step["time/rollout_s"]},
            "step_over_overlap": step_s / (max(beside["train_s"], beside["rollout_s"]) + beside["sync_s"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32 on a host without bf16 instructions (bf16 there is emulated, ~100x slower)")
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--out", default="bench/results/bounds.json")
    args = parser.parse_args(argv)
    phases = [p for p in args.only.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"--only: unknown phase(s) {sorted(unknown)}; choose from {', '.join(PHASES)}")
    from bench.models import real_model

    model = str(real_model("smollm2").resolve())
    rows = _kept_rows(Path(args.out), args.dtype, phases)
    with tempfile.TemporaryDirectory(prefix="bench-bounds-") as tmp:
        work = Path(tmp)
        for phase in phases:
            try:
                row = (rollout(args.dtype, work) if phase == "rollout" else learner(args.dtype, model, work)
                       if phase == "learner" else sync(work) if phase == "sync" else offpolicy(args.dtype, work))
            except (SystemExit, KeyError, subprocess.TimeoutExpired) as e:  # the next phase still runs
                print(f"  {phase} failed: {str(e)[:2000]}", flush=True)
                rows[phase] = {"error": str(e)[-2000:], "passed": False, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
                continue
            op, target = TARGETS[phase]
            row.update(target=f"{op} {target}", passed=row["ratio"] >= target if op == ">=" else row["ratio"] <= target,
                       measured=time.strftime("%Y-%m-%dT%H:%M:%S"))
            rows[phase] = row
    print(f"\n{'phase':>10} | {'ours':>22} | {'bound':>40} | ratio | target")
    for phase in PHASES:
        r = rows.get(phase)
        if r is None:
            continue
        if "error" in r:
            print(f"{phase:>10} | failed: {r['error'][-200:]}")
            continue
        print(f"{phase:>10} | {r['ours']:>22} | {r['bound']:>40} | {r['ratio']:.2f}x | {r['target']} "
              f"{'PASS' if r['passed'] else 'FAIL'}")
    write_result(args.out, {"machine": machine_info(), "model": "smollm2", "dtype": args.dtype,
                            "phases": {p: rows[p] for p in PHASES if p in rows}})


def _kept_rows(out: Path, dtype: str, rerun: list[str]) -> dict:
    """The rows of `out` (an earlier run of this benchmark in `dtype`) for phases not rerun now."""
    try:
        before = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    if before.get("dtype") != dtype:
        return {}
    return {p: r for p, r in before.get("phases", {}).items() if p not in rerun and "error" not in r}


if __name__ == "__main__":
    main()
