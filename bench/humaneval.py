"""HumanEval pass@1 and pass@10 of the real model before and after a short run of the Python code
task (issue 35.4): `python -m launch.train model=smollm2 task=python_funcs` (examples/python_funcs.py:
GRPO on small functions judged by hidden tests in the sandbox), which evaluates on HumanEval's 164
problems (greedy, and 10 samples each at temperature 0.8, scored by `reward.humaneval:passes` in the
sandbox) before the first update and after the last.

    python -m bench.humaneval [--steps 10] [--out bench/results/humaneval.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench.machine import launch_train, machine_info, write_result

FIGURES = ("eval/greedy_pass_frac", "eval/pass_at_1", "eval/pass_at_10", "eval/errors_count", "time/eval_s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="bench/results/humaneval.json")
    args = parser.parse_args(argv)
    info = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        rows = launch_train(["model=smollm2", "task=python_funcs", f"run.steps={args.steps}",
                             f"eval.every_steps={args.steps}", "run.save_final_model=false"], f"{tmp}/run")
        wall = time.monotonic() - start
    evals = [{"step": r["step"], **{k: r[k] for k in FIGURES if k in r}} for r in rows if "eval/pass_at_1" in r]
    train = [{"step": r["step"], "reward": r["reward/mean"]} for r in rows if "reward/mean" in r]
    for e in evals:
        print(f"HumanEval after {e['step']} updates: greedy {e['eval/greedy_pass_frac']:.3f}, pass@1 "
              f"{e['eval/pass_at_1']:.3f}, pass@10 {e['eval/pass_at_10']:.3f} ({e['time/eval_s']:.0f} s)", flush=True)
    print(f"training reward (share of passing programs) by step: {[round(t['reward'], 3) for t in train]}; "
          f"{wall / 60:.1f} min in all", flush=True)
    write_result(args.out, {"machine": info, "settings": vars(args), "evals": evals, "train_reward": train,
                            "wall_s": wall})


if __name__ == "__main__":
    sys.exit(main())
