"""Metric sinks (`run.loggers`): wandb offline and MLflow with a local file store, driven through
RunLog with no network, then read back from the files they wrote; (slow) a real run with every
logger on, whose report.png the run draws at its end."""

from __future__ import annotations

import json
import os

import pytest

from rl.log.run_log import RunLog

CONFIG = {"algorithm": {"name": "grpo", "lr": 0.001}, "run": {"steps": 3, "loggers": ["wandb", "mlflow"]}}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _mlflow_history(run_dir: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    run_id = open(os.path.join(run_dir, "mlflow_run_id")).read().strip()
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def _wandb_records(run_dir: str) -> dict[str, list[dict]]:
    """The offline run's .wandb file read back: a LevelDB-style log (32 KiB blocks, 7-byte record
    headers: crc, length, type full/first/middle/last) of wandb's protobuf `Record`s. Returns the
    history rows, the summary updates and the run's config, each as plain dicts."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(run_dir, "wandb")) for f in files
               if f.endswith(".wandb")]
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    out: dict[str, list[dict]] = {"history": [], "summary": [], "config": []}

    def items(entries) -> dict:
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(items(record.history.item))
        elif kind == "summary":
            out["summary"].append(items(record.summary.update))
        elif kind == "run":
            out["config"].append(items(record.run.config.update))
    return out


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_wandb_offline_and_mlflow_file_store_hold_the_runs_metrics_config_and_summary(tmp_path):
    run_dir = str(tmp_path / "run")
    log = RunLog(run_dir, 3, progress=False, config_yaml="algorithm:\n  lr: 0.001\n",
                 loggers=["tensorboard", "jsonl", "wandb", "mlflow"], config=CONFIG)
    for step in range(3):
        log.metrics(step, {"reward/mean": 0.1 * (step + 1), "time/step_s": 2.0, "actor/kl_nats": float("nan")},
                    echo=False)
    log.finish({"reward_first": 0.1, "reward_last": 0.3, "final_model": "/x/final_model"})

    assert _mlflow_history(run_dir, "reward/mean") == [(0, pytest.approx(0.1)), (1, pytest.approx(0.2)),
                                                       (2, pytest.approx(0.3))]
    assert _mlflow_history(run_dir, "actor/kl_nats") == []  # non-finite values are left out
    assert _mlflow_history(run_dir, "summary/reward_last") == [(0, pytest.approx(0.3))]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    run = client.get_run(open(os.path.join(run_dir, "mlflow_run_id")).read().strip())
    assert run.data.params["algorithm.lr"] == "0.001" and run.data.params["run.loggers"] == "['wandb', 'mlflow']"
    assert run.data.tags["summary/final_model"] == "/x/final_model" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]

    wandb = _wandb_records(run_dir)
    assert [(r["_step"], r["reward/mean"]) for r in wandb["history"]] == [
        (0, pytest.approx(0.1)), (1, pytest.approx(0.2)), (2, pytest.approx(0.3))]
    assert all("actor/kl_nats" not in r for r in wandb["history"])
    assert wandb["config"][0]["algorithm"] == {"name": "grpo", "lr": 0.001}
    summary = {k: v for update in wandb["summary"] for k, v in update.items()}
    assert summary["summary/reward_last"] == pytest.approx(0.3) and summary["summary/final_model"] == "/x/final_model"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tb")))


def test_a_resumed_run_appends_to_the_same_mlflow_and_wandb_runs(tmp_path):
    run_dir = str(tmp_path / "run")
    first = RunLog(run_dir, 4, progress=False, loggers=["jsonl", "mlflow", "wandb"], config=CONFIG)
    first.metrics(0, {"reward/mean": 0.5}, echo=False)
    first.close()
    ids = [open(os.path.join(run_dir, name)).read() for name in ("mlflow_run_id", "wandb_run_id")]
    again = RunLog(run_dir, 4, progress=False, resume=True, start_step=1, loggers=["jsonl", "mlflow", "wandb"],
                   config=CONFIG)
    again.metrics(1, {"reward/mean": 0.7}, echo=False)
    again.close()
    assert [open(os.path.join(run_dir, name)).read() for name in ("mlflow_run_id", "wandb_run_id")] == ids
    assert [v for _, v in _mlflow_history(run_dir, "reward/mean")] == [pytest.approx(0.5), pytest.approx(0.7)]


def test_unknown_logger_is_a_config_error():
    from rl.config.schema import ConfigError
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=r"run.loggers=\['tensorboard', 'neptune'\]: unknown 'neptune'"):
        compose_config(["run.loggers=[tensorboard,neptune]"])
    from rl.config.compose import compose

    with pytest.raises(ConfigError, match=r"run.loggers=\['mlflow', 'neptune'\]"):  # SFT and RM runs too
        compose("train_sft", ["run.loggers=[mlflow,neptune]"])


@pytest.mark.slow
@pytest.mark.full  # a run with every logger: the full lane
def test_a_run_with_every_logger_writes_them_all_and_its_report(make_config):
    """The default task for 3 steps with run.loggers=[tensorboard,jsonl,wandb,mlflow]: each sink
    holds the run's metrics, config and summary, and the run draws report.png at its end."""
    from launch.train import train
    from rl.log.run_log import read_metrics

    cfg = make_config("run.steps=3", "task.prompts_per_step=8", "run.save_every=0", "run.save_final_model=false",
                      "run.loggers=[tensorboard,jsonl,wandb,mlflow]")
    summary = train(cfg)
    run_dir = cfg.run.dir
    rewards = [m["reward/mean"] for m in read_metrics(run_dir)]
    assert [v for _, v in _mlflow_history(run_dir, "reward/mean")] == [pytest.approx(r) for r in rewards]
    wandb = _wandb_records(run_dir)
    assert [r["reward/mean"] for r in wandb["history"]] == [pytest.approx(r) for r in rewards]
    assert wandb["config"][0]["run"]["loggers"] == ["tensorboard", "jsonl", "wandb", "mlflow"]
    final = {k: v for update in wandb["summary"] for k, v in update.items()}
    assert final["summary/last_steps_reward_mean"] == pytest.approx(summary["last_steps_reward_mean"])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tb")))
    from matplotlib.image import imread

    assert imread(os.path.join(run_dir, "report.png")).shape[:2] == (640, 1200)
    report = open(os.path.join(run_dir, "report.md")).read()
    assert "| steps done | 3 |" in report and "- `run.steps`: 60 -> 3" in report
