"""`ray job submit` against a real (single-node) Ray cluster, as a user of `cluster=ray` would."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.full]  # a Ray cluster and a submitted job: the full lane

NOISE = ("Setting accelerator to CPU", "Triton not available", "NUMA binding", "Loading safetensors checkpoint shards",
         "Loading weights", "Writing model shards", "Generating train split")


def test_ray_job_submit_runs_the_same_config(tiny_dir, tmp_path, ray_cluster):
    ray_cluster.start(["--head", f"--port={ray_cluster.port}", f"--dashboard-port={ray_cluster.dashboard_port}"],
                      num_cpus=4)
    run_dir = tmp_path / "run"
    proc = ray_cluster.ray(
        "job", "submit", f"--address={ray_cluster.dashboard}", f"--working-dir={ROOT}", "--",
        "python", "-m", "launch.train", "cluster=ray", "run.steps=2",
        "task.prompts_per_step=8", f"run.dir={run_dir}", f"model.path={tiny_dir}/model",
        f"task.train_files=[{tiny_dir}/data/train.jsonl]", timeout=400,
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
