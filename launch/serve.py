"""`python -m launch.serve [group=option ...] [key=value ...]`: a Tinker-compatible training service
on our own parts, as a Hydra app (configs/serve.yaml, typed by rl/config/serve.py).

Clients written against Thinking Machines' `tinker` SDK (and the tinker-cookbook recipes) point
`base_url` at it: each training model is a LoRA adapter set trained by a DeepSpeed engine of its
own (trainer/adapter_trainer.py), sampling runs on the vLLM rollout fleet with the saved adapters
(vLLM's LoRA), and saved weights live under `run.dir`. Bad input fails here before Ray starts.
The protocol is launch/tinker/app.py, what each call does launch/tinker/service.py.

SIGTERM or Ctrl-C stops it within seconds whatever its calls are waiting for: the HTTP server
closes (long polls cut after `GRACE_S`), waiting calls end, summary.json and the report are
written, the actors stop, and the process exits (a call still running in a thread is not waited
for; after `STOP_S` it exits whatever is left).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from launch.cli import INPUT_ERRORS, fail
from rl.config import serve as _serve_schema  # noqa: F401 - registers serve_schema with Hydra

GRACE_S = 3.0  # open connections (long-polled retrieve_future) get this long to end when stopping
STOP_S = 30.0  # a stop that takes longer (an actor or Ray not answering) ends the process anyway


def check_serve(cfg: DictConfig) -> str:
    """Everything that can be checked before Ray starts: the config's fields, the model (a Hub id
    resolved through the Hugging Face cache, the built-in tiny model built when missing), the run
    directory. Returns the name clients ask for as base_model."""
    from examples import ensure_builtin
    from launch.checks import require_length, require_writable
    from launch.hub import resolve_hub_ids
    from launch.model_files import require_model, require_vllm_architecture
    from rl.config.serve import validate_serve
    from rl.run.run_log import refuse_existing_run

    from launch.hub import looks_like_hub_id

    validate_serve(cfg)
    # a Hub id is its own name; a local folder is named by its absolute path (clients load its tokenizer)
    path = cfg.model.path
    name = cfg.serve.model_name or (path if looks_like_hub_id(path) and not os.path.exists(path) else os.path.abspath(path))
    resolve_hub_ids(cfg)
    ensure_builtin([cfg.model.path], cfg.run.seed)
    model_config = require_model(cfg.model.path)
    require_length(cfg.model.path, model_config, cfg.rollout.max_model_len)
    require_vllm_architecture(cfg.model.path, model_config)
    require_writable(cfg.run.dir)
    if cfg.run.resume:
        require_served_run(cfg.run.dir, name)
    else:
        refuse_existing_run(cfg.run.dir)  # a service's metrics and saved weights are never written over
    return name


def require_served_run(run_dir: str, name: str) -> None:
    """`run.resume=true`: `run_dir` holds a service's run (its `tinker/` weights) of the same base
    model, whose saved `tinker://` paths, runs and checkpoints the restarted service serves again."""
    import json

    from launch.tinker.service import RUN_META

    weights = os.path.join(run_dir, "tinker")
    if not os.path.isdir(weights):
        raise FileNotFoundError(f"run.resume=true: {run_dir} holds no Tinker service run (no tinker/ folder); "
                                "give the run.dir of an earlier launch.serve, or drop run.resume to start a new one")
    for entry in sorted(os.listdir(weights)):
        try:
            with open(os.path.join(weights, entry, RUN_META)) as f:
                served = json.load(f).get("base_model")
        except (OSError, ValueError):
            continue
        if served and served != name:
            raise ValueError(f"run.resume=true: {run_dir} holds weights trained on {served!r}, not {name!r}: "
                             f"start it with model.path={served} (or serve.model_name={served})")


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

    def __init__(self, cfg: DictConfig, model_name: str):
        import ray
        import uvicorn
        from transformers import AutoTokenizer

        from launch.components import usable_cores
        from launch.console import actor_env, rollout_env
        from launch.tinker.app import make_app
        from launch.tinker.service import TinkerService
        from rl.config.serve import ServeConfig
        from rl.run.actor_group import ActorGroup
        from rl.run.faults import Deadlines
        from rl.run.run_log import RunLog
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
            ray.init(num_cpus=cfg.cluster.num_cpus or max(usable_cores(), 2), include_dashboard=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}}, log_to_driver=True)
        threads = cfg.cluster.threads_per_worker or max(1, usable_cores() // 2)
        deadlines = Deadlines(start_s=900.0)
        env = {**rollout_env(threads, False), **vllm_env(cfg.rollout.kv_cache_gib, threads, cfg.rollout.enforce_eager)}
        spec = RolloutSpec(config.model, config.rollout, seed=cfg.run.seed, threads=threads)
        self.fleet = RolloutFleet(spec, num_cpus=1, env_vars=env, deadlines=deadlines)
        trainer_env = actor_env(cfg.serve.lora_threads, False)

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
        while not self._stopping.wait(min(10.0, self.service.s.session_timeout_s / 4)):
            self.service.expire()

    def stop(self) -> None:
        """Stop serving, end the calls waiting and the actors, write summary.json and the report
        (each step even when an earlier one failed: actors may be gone already, e.g. after a
        SIGTERM to the process group)."""
        import ray

        from launch.report import write_report_or_warn

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
        write_report_or_warn(self.run_log.run_dir)


def _exit(code: int) -> None:
    """End the process now: its files are written; threads still inside a call (a Ray call, a
    model's turn) are not waited for, as the interpreter's exit would wait for its thread pool's."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watchdog(seconds: float) -> None:
    def expire() -> None:
        time.sleep(seconds)
        print(f"warning: the service did not stop within {seconds:.0f} s; exiting anyway", flush=True)
        _exit(1)

    threading.Thread(target=expire, name="tinker-stop-watchdog", daemon=True).start()


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    from launch.console import quiet_driver

    quiet_driver()
    try:
        name = check_serve(cfg)
    except INPUT_ERRORS as err:
        fail(err)
    served = Served(cfg, name)
    stopping = threading.Event()

    def on_signal(*_: Any) -> None:  # SIGTERM: stop as on Ctrl-C
        served.server.should_exit = True
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    print(f"Tinker service for {name} at {served.url} (run directory {cfg.run.dir}); point the SDK at it: "
          f"tinker.ServiceClient(base_url={served.url!r}) with TINKER_API_KEY=tml-...", flush=True)
    code = 0
    try:
        while served._thread.is_alive() and not stopping.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        _watchdog(STOP_S)
        try:
            served.stop()
        except BaseException:  # noqa: BLE001 - shown, then the process ends all the same
            traceback.print_exc()
            code = 1
        print(f"Tinker service stopped (run directory {cfg.run.dir})", flush=True)
        _exit(code)


if __name__ == "__main__":
    main()
