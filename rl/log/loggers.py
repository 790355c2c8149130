"""Metric sinks beside `<run>/metrics.jsonl` (always written: the run reads it back to resume,
summarise and draw its report): TensorBoard, Weights & Biases and MLflow (`run.loggers`).

Every sink gets the resolved config at the start, every step's finite metrics, and the final
summary. None needs a network: wandb runs offline unless WANDB_MODE says otherwise (its files land
in `<run>/wandb/`, `wandb sync` uploads them later), MLflow writes a local file store in
`<run>/mlruns` unless `run.mlflow_tracking_uri` names a server. A resumed run appends to the same
wandb run and MLflow run (their ids are kept in the run directory). The libraries are imported
only when their sink is chosen.
"""

from __future__ import annotations

import json
import secrets
import os
import time
from typing import Any, Iterable, Protocol

from rl.config.schema import LOGGERS


class MetricSink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values (as the config shows them)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _kept_id(run_dir: str, name: str, make) -> str:
    """The id stored in `<run>/<name>` (a resumed run), else a new one stored there."""
    path = os.path.join(run_dir, name)
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    value = make()
    with open(path, "w") as f:
        f.write(value)
    return value


class TensorBoardSink:
    def __init__(self, run_dir: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tb"))
        if config:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flatten(config).items()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", "    " + json.dumps(summary, indent=2, default=str).replace("\n", "\n    "))

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: str, config: dict[str, Any], project: str, name: str) -> None:
        import wandb

        run_id = _kept_id(run_dir, "wandb_run_id", lambda: secrets.token_hex(4))
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir, config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in flatten(summary).items()
                                 if isinstance(v, (int, float, str, bool))})

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, run_dir: str, config: dict[str, Any], tracking_uri: str, experiment: str, name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked for it by name
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        fresh = not os.path.exists(os.path.join(run_dir, "mlflow_run_id"))
        self.run_id = _kept_id(run_dir, "mlflow_run_id",
                               lambda: self.client.create_run(experiment_id, run_name=name).info.run_id)
        if fresh:  # params are write-once in MLflow: a resumed run keeps those it started with
            params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])
            config_yaml = os.path.join(run_dir, "config.yaml")
            if os.path.exists(config_yaml):
                self.client.log_artifact(self.run_id, config_yaml)
        self.client.update_run(self.run_id, status="RUNNING")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_summary(self, summary: dict[str, Any]) -> None:
        flat = flatten(summary)
        self.log(0, {f"summary/{k}": float(v) for k, v in flat.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for key, value in flat.items():
            if isinstance(value, str):
                self.client.set_tag(self.run_id, f"summary/{key}", value[:5000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_sinks(names: Iterable[str], run_dir: str, config: dict[str, Any], *, project: str = "rlpost",
               mlflow_tracking_uri: str = "", name: str = "") -> list[MetricSink]:
    """The sinks `names` choose (jsonl is RunLog's own file and needs none here); `project` is
    the wandb project and the MLflow experiment, `name` the run's (default: the run dir's name)."""
    name = name or os.path.basename(os.path.abspath(run_dir))
    sinks: list[MetricSink] = []
    for logger in dict.fromkeys(names):
        if logger == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, config))
        elif logger == "wandb":
            sinks.append(WandbSink(run_dir, config, project, name))
        elif logger == "mlflow":
            sinks.append(MlflowSink(run_dir, config, mlflow_tracking_uri, project, name))
        elif logger != "jsonl":
            raise ValueError(f"run.loggers: unknown logger {logger!r}; choose from {', '.join(LOGGERS)}")
    return sinks
