"""`launch.train task=code_speedup` end to end: vLLM samples C rewrites, the sandbox pool (Ray
actors on the real process sandbox) compiles, tests and benchmarks them, DeepSpeed trains."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from launch.train import train
from rl.log.run_log import read_metrics
from tests.conftest import compose_config

pytestmark = pytest.mark.slow


def _kill_when(run_dir: str, step_rows: int, role: str) -> tuple[threading.Thread, list[str]]:
    """kill -9 the first actor of `role` once metrics.jsonl has `step_rows` rows (mid-run)."""

    def kill() -> None:
        path = os.path.join(run_dir, "metrics.jsonl")
        while not (os.path.exists(path) and len(open(path).read().splitlines()) >= step_rows):
            time.sleep(0.05)
        actors = json.load(open(os.path.join(run_dir, "actors.json")))
        os.kill(next(a["pid"] for a in actors if a["role"] == role and a["index"] == 0), signal.SIGKILL)
        killed.append(role)

    killed: list[str] = []
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, killed


def test_grpo_with_the_sandbox_reward_on_the_code_task(tiny_code, tmp_path):
    """...with a sandbox worker killed (kill -9) after the first step: Ray starts it again, its
    jobs are sent again, and no sample of any step loses its reward."""
    out, _ = tiny_code
    cfg = compose_config([
        "task=code_speedup",
        f"model.path={out}/model",
        f"task.train_files=[{out}/data/train.jsonl]",
        f"run.dir={tmp_path}/run",
        "run.progress=false",
        "run.steps=4",
        "task.prompts_per_step=8",
        "sandbox.num_workers=2",
        "sandbox.slots_per_worker=1",
    ])
    killer, killed = _kill_when(cfg.run.dir, 1, "sandbox")
    summary = train(cfg)
    killer.join(timeout=5)
    assert killed == ["sandbox"]
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 4
    for m in metrics:
        assert m["reward/errors_count"] == 0  # no sandbox failure on any sample
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert 0.0 < m["reward/passed_tests_mean"] < 1.0  # some programs right, some wrong
        assert m["reward/measured_speedup_mean"] >= 1.0  # correct ones are at least as fast as the reference on average
    assert set(summary["components"]) == {"speedup_reward", "measured_speedup", "passed_tests"}
    # every logged sample carries its components; a correct rewrite's reward follows its speed-up
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "samples.jsonl"))]
    correct = [r for r in rows if r["components"]["passed_tests"] == 1.0]
    assert correct and all(r["components"]["measured_speedup"] > 0 and r["reward"] >= 0.2 for r in correct)
    wrong = [r for r in rows if r["components"]["passed_tests"] == 0.0]
    assert all(r["reward"] == 0.0 and r["components"]["measured_speedup"] is None for r in wrong)
