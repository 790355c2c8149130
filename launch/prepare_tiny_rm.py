"""Build the built-in tiny reward model with no network: `python -m launch.prepare_tiny_rm`.

Writes OUT/data/{train,test}.jsonl (the tiny preference task of `rl/preference_tasks.py`:
columns prompt, chosen, rejected, kind; test prompts never occur in training), trains a reward
model on them with `launch.train_rm` starting from the tiny policy (built first when missing),
and puts it in OUT/model (transformers `save_pretrained` folder: what `reward.model_reward`
serves) with OUT/prepare_summary.json. The training run itself stays in OUT/run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from rl.preference_tasks import preference_splits


def write_preference_data(out_dir: str, seed: int = 0, n_train: int = 8000, n_test: int = 1000) -> tuple[str, str]:
    """Write OUT/data/train.jsonl and OUT/data/test.jsonl; returns their paths."""
    train, test = preference_splits(n_train, n_test, seed=seed)
    paths = []
    for name, pairs in (("train", train), ("test", test)):
        path = Path(out_dir) / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for p in pairs:
                f.write(json.dumps(p.to_row()) + "\n")
        os.replace(tmp, path)
        paths.append(str(path))
    return paths[0], paths[1]


def build_tiny_rm(
    out_dir: str = "artifacts/tiny_rm",
    seed: int = 0,
    *,
    policy_path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Data, then a trained RM in OUT/model; returns the training summary.

    `policy_path` is the causal LM the RM starts from (default: the built-in tiny policy, built
    when missing). `overrides` are extra `launch.train_rm` config overrides (e.g. "optim.epochs=2").
    """
    from launch.train_rm import BUILTIN_POLICY_PATH, run

    out = Path(out_dir)
    if policy_path is None:
        policy_path = BUILTIN_POLICY_PATH
        if not os.path.isdir(policy_path):
            from launch.prepare_tiny import prepare_tiny

            prepare_tiny(os.path.dirname(policy_path), seed=seed)
    train_file, test_file = write_preference_data(str(out), seed=seed)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished earlier build
    summary = run([
        f"model.path={os.path.abspath(policy_path)}",
        f"data.train_files=[{os.path.abspath(train_file)}]",
        f"data.test_files=[{os.path.abspath(test_file)}]",
        f"run.dir={os.path.abspath(run_dir)}",
        f"run.seed={seed}",
        "data.group_key=kind",  # eval accuracy per kind of pair, too
        "run.progress=false",
        *overrides,
    ])
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(summary["final_model"], model_dir)  # same filesystem: atomic
    summary = {**summary, "final_model": str(model_dir), "policy_path": policy_path, "train_file": train_file,
               "test_file": test_file}
    (out / "prepare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/tiny_rm", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default=None, help="causal LM folder to start from (default: the tiny policy)")
    parser.add_argument("overrides", nargs="*", help="launch.train_rm overrides, e.g. optim.epochs=2")
    args = parser.parse_args(argv)
    print(json.dumps(build_tiny_rm(args.out, args.seed, policy_path=args.policy, overrides=args.overrides), indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
