"""The running Tinker service: Ray, the rollout fleet, a training model's actor per client model,
the `TinkerService` and its HTTP server on a thread of its own; `stop()` ends them in order.

The fleet is kept whole by its owner, the command line's `Cluster` (launch/serve.py; the one caller
of the fleet's `repair`, on the main thread), with `FixedWeights` as its weight sync: a replaced
worker loads the base weights from `model.path` and takes adapters per request, so it is up to date
as soon as it is up. This package imports nothing of `launch` outside it (tests/test_layers.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

GRACE_S = 3.0  # open connections (long-polled retrieve_future) get this long to end when stopping


@dataclass
class Synced:
    failed: dict[int, str] = field(default_factory=dict)
    sent: float = 0.0


class FixedWeights:
    """The weight sync of a fleet whose weights never change (the service's: the base model from
    `model.path`, adapters per request): joining and syncing have nothing to do, so a `Cluster`
    repair is a replacement and `fleet.synced()`."""

    bytes_per_sync = 0.0

    def join(self) -> dict[int, str]:
        return {}

    def sync(self, version: int) -> Synced:
        return Synced()

    def close(self) -> None:
        pass


def _next_step(run_dir: str) -> int:
    """The first metrics.jsonl step a resumed service writes (after the earlier run's)."""
    import json

    last = 0
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short when the earlier service was killed
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                last = max(last, row["step"])
    return last + 1


class Served:
    """A running service: Ray, the fleet, the HTTP server on its thread; `url`, `stop()`."""

    def __init__(self, cfg: DictConfig, model_name: str, *, cores: int, rollout_env: dict[str, str],
                 trainer_env: dict[str, str]):
        """Ray (started here unless running), the fleet (one engine per `rollout.num_workers`, with
        `rollout_env`), the HTTP server; each training model an actor with `trainer_env`. `cores`: the
        CPUs Ray is given when this starts it."""
        import ray
        import torch
        import uvicorn
        from transformers import AutoTokenizer

        from launch.tinker.app import make_app
        from launch.tinker.service import TinkerService
        from rl.config.serve import ServeConfig, adapters_merged
        from rl.actors.group import ActorGroup
        from rl.actors.faults import Deadlines
        from rl.log.run_log import RunLog
        from rollout.fleet import RolloutFleet
        from rollout.protocol import RolloutSpec
        from rollout.vllm_engine import vllm_env
        from trainer.adapter_trainer import AdapterTrainer

        OmegaConf.update(cfg, "serve.model_name", model_name)
        # the run directory as launch.train keeps one: config.yaml, metrics.jsonl (a row per
        # optim_step) and the run's loggers; summary.json and report.png/md when it stops
        first_step = _next_step(cfg.run.dir) if cfg.run.resume else 1
        self.run_log = RunLog(cfg.run.dir, 0, title="TINKER", progress=False, resume=bool(cfg.run.resume),
                              start_step=first_step - 1,
                              config_yaml=OmegaConf.to_yaml(cfg, resolve=True), loggers=list(cfg.run.loggers),
                              config=OmegaConf.to_container(cfg, resolve=True),
                              sink_options={"project": cfg.run.project,
                                            "mlflow_tracking_uri": cfg.run.mlflow_tracking_uri})
        config: ServeConfig = OmegaConf.to_object(cfg)
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            from rl.config.schema import local_ray_config

            ray.init(num_cpus=cfg.cluster.num_cpus or max(cores, 2), include_dashboard=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}}, log_to_driver=True,
                     _system_config=local_ray_config(cfg.cluster))
        threads = cfg.cluster.threads_per_worker or max(1, cores // 2)
        deadlines = Deadlines(start_s=900.0)
        env = {**rollout_env, **vllm_env(cfg.rollout.kv_cache_gib, threads, cfg.rollout.enforce_eager)}
        # samplers' adapters merged into the engine's weights per batch (serve.adapter_sampling): the
        # engine then runs without vLLM's LoRA layers (rollout.max_loras=0 is how it knows)
        merged = adapters_merged(config.serve.adapter_sampling, torch.cuda.is_available())
        rollout = dataclasses.replace(config.rollout, max_loras=0) if merged else config.rollout
        spec = RolloutSpec(config.model, rollout, seed=cfg.run.seed, threads=threads)
        self.adapter_sampling = "merged" if merged else "lora"
        self.fleet = RolloutFleet(spec, num_cpus=1, env_vars=env, deadlines=deadlines)

        def start_trainer(adapter_spec: Any, name: str) -> ActorGroup:
            group = ActorGroup(ray, AdapterTrainer, 1, role=f"training model {name}", args=lambda i: (adapter_spec,),
                               options={"num_cpus": 0, "runtime_env": {"env_vars": trainer_env}}, deadlines=deadlines)
            group.started()
            return group

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.service = TinkerService(config, self.fleet, tokenizer, cfg.model.path, cfg.run.dir, start_trainer,
                                     run_log=self.run_log, first_step=first_step)
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.service), host=cfg.serve.host, port=cfg.serve.port,
                                                    log_level="warning", timeout_keep_alive=75,
                                                    timeout_graceful_shutdown=GRACE_S))
        self._thread = threading.Thread(target=self.server.run, name="tinker-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {cfg.serve.host}:{cfg.serve.port} (in use?)")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{cfg.serve.host}:{port}"
        self._stopping = threading.Event()
        threading.Thread(target=self._expire, name="tinker-sessions", daemon=True).start()

    def _expire(self) -> None:
        # a client gone (no heartbeat for serve.session_timeout_s) is noticed within a quarter of it
        while not self._stopping.wait(min(10.0, self.service.serve.session_timeout_s / 4)):
            self.service.expire()

    def stop(self) -> None:
        """Stop serving, end the calls waiting and the actors, write summary.json and the report
        (each step even when an earlier one failed: actors may be gone already, e.g. after a
        SIGTERM to the process group)."""
        import ray

        if getattr(self, "_stopping", None) is not None:
            self._stopping.set()
        self.server.should_exit = True
        self._thread.join(timeout=GRACE_S + 5)
        for step in [self.service.close, self.fleet.shutdown] + ([ray.shutdown] if self.owns_ray else []):
            try:
                step()
            except Exception as err:  # noqa: BLE001 - the run's files come next, whatever failed here
                print(f"warning: stopping the service: {type(err).__name__}: {err}", flush=True)
        self.run_log.finish({"service": self.service.stats})
