"""The difficulty curriculum on the real model: informative groups per step with and without it.

Two short runs of the SmolLM2 recipe (`model=smollm2 task=math_chat`) on the first `--rows` rows of
its training prompts, 8 prompts a step (an epoch every rows/8 steps), the same seed: one plain, one
with `task.curriculum_epochs` (a prompt whose group was all solved or all failed rests that many
epochs). Two figures per step, averaged over the steps after the first epoch (before it nothing
has rested yet): groups that are informative for the answer (some samples right by `math_answer`,
some wrong: what the curriculum selects for; read from every sample in samples.jsonl), and groups
whose total rewards are not all equal (1 - `adv/flat_groups_frac`; the recipe's 0.1 x format reward
makes nearly every group so); beside the curriculum's `curriculum/skipped_frac`.

    python -m bench.curriculum [--rows 32] [--steps 16] [--epochs 1] [--out bench/results/curriculum.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.machine import launch_train, machine_info, parse_flags, write_result


def run(extra: list[str], train_file: Path, steps: int) -> tuple[list[dict], list[float]]:
    """The run's metrics, and per step the share of groups mixed in `math_answer`."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = launch_train(["model=smollm2", "task=math_chat", f"task.train_files=[{train_file}]",
                                f"run.steps={steps}", "eval.every_steps=0", "run.save_every=0",
                                "run.save_final_model=false", "run.log_samples_per_step=64", *extra], f"{tmp}/run")
        groups: dict[tuple[int, int], set] = {}
        for line in open(f"{tmp}/run/samples.jsonl"):
            r = json.loads(line)
            groups.setdefault((r["step"], r["group_id"]), set()).add((r["components"] or {}).get("math_answer"))
    mixed = [statistics.fmean(len(v) > 1 for (s, _), v in groups.items() if s == step) for step in range(steps)]
    return metrics, mixed


def main(argv: list[str] | None = None) -> None:
    args = parse_flags(__doc__, argv, rows=32, steps=16, epochs=1, out="bench/results/curriculum.json")
    info = machine_info()
    rows = Path("artifacts/math_chat/data/train.jsonl").read_text().splitlines()[: args.rows]
    first_epoch = args.rows // 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        train_file = Path(tmp) / "train.jsonl"
        train_file.write_text("\n".join(rows) + "\n")
        for name, extra in (("plain", []), ("curriculum", [f"task.curriculum_epochs={args.epochs}"])):
            metrics, mixed = run(extra, train_file, args.steps)
            informative = [1.0 - m["adv/flat_groups_frac"] for m in metrics]
            results[name] = {"mixed_per_step": mixed, "mixed_after_epoch_1": statistics.fmean(mixed[first_epoch:]),
                             "informative_per_step": informative,
                             "informative_after_epoch_1": statistics.fmean(informative[first_epoch:]),
                             "skipped_frac": [m.get("curriculum/skipped_frac") for m in metrics],
                             "reward_mean": [m["reward/mean"] for m in metrics]}
            print(f"{name:>10}: groups mixed in the answer per step after the first epoch "
                  f"{8 * results[name]['mixed_after_epoch_1']:.2f} of 8 (by step: {[round(x, 2) for x in mixed]}); "
                  f"rewards not all equal {8 * results[name]['informative_after_epoch_1']:.2f} of 8", flush=True)
    ratio = results["curriculum"]["mixed_after_epoch_1"] / max(results["plain"]["mixed_after_epoch_1"], 1e-9)
    print(f"curriculum / plain: {ratio:.2f}x groups mixed in the answer per step")
    write_result(args.out, {"machine": info, "settings": vars(args), "results": results, "ratio": ratio})


if __name__ == "__main__":
    sys.exit(main())
