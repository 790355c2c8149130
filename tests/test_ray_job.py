"""`ray job submit` against a real (single-node) Ray cluster, as a user of `cluster=ray` would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NOISE = ("Setting accelerator to CPU", "Triton not available", "NUMA binding", "Loading safetensors checkpoint shards",
         "Loading weights", "Writing model shards", "Generating train split")


def test_ray_job_submit_runs_the_same_config(tiny_dir, tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], RAY_AUTH_MODE="disabled")
    ray = os.path.join(bin_dir, "ray")
    # own session dir, short: Ray's unix socket paths inside it must stay under 108 bytes
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    subprocess.run([ray, "start", "--head", "--num-cpus=4", "--disable-usage-stats", "--port=0",
                    "--dashboard-port=8277", f"--temp-dir={temp}"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        run_dir = tmp_path / "run"
        proc = subprocess.run(
            [ray, "job", "submit", "--address=http://127.0.0.1:8277", f"--working-dir={ROOT}", "--",
             "python", "-m", "launch.train", "cluster=ray", "run.steps=2",
             "task.prompts_per_step=8", f"run.dir={run_dir}", f"model.path={tiny_dir}/model",
             f"task.train_files=[{tiny_dir}/data/train.jsonl]"],
            env=env, capture_output=True, text=True, timeout=400,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "succeeded" in proc.stdout + proc.stderr
        assert (run_dir / "final_model" / "config.json").exists()
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
        # job logs are not a terminal: plain step lines, no progress bar glued to them, no start-up noise
        logs = proc.stdout + proc.stderr
        assert "\nstep 1/2 | reward" in logs and "\nstep 2/2 | reward" in logs and "\r" not in logs
        for noise in NOISE:
            assert noise not in logs, noise
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
