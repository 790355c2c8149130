"""`python -m launch.serve [group=option ...] [key=value ...]`: the command line of the Tinker-compatible
training service (launch/tinker/), as a Hydra app (configs/serve.yaml, typed by rl/config/serve.py).

Clients written against Thinking Machines' `tinker` SDK (and the tinker-cookbook recipes) point
`base_url` at it: each training model is a LoRA adapter set trained by a DeepSpeed engine of its
own (trainer/adapter_trainer.py), sampling runs on the vLLM rollout fleet with the saved adapters,
and saved weights live under `run.dir`. Here: the checks before Ray (bad input fails here), the
service started (launch/tinker/server.py), its fleet's `Cluster` (launch/cluster.py: the one
repair path, on this main thread), signals, and the run's report when it stops.

SIGTERM or Ctrl-C stops it within seconds whatever its calls are waiting for: the HTTP server
closes (long polls cut after `launch.tinker.server.GRACE_S`), waiting calls end, summary.json and the report are
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
from omegaconf import DictConfig

from launch.cli import INPUT_ERRORS, fail
from rl.config import serve as _serve_schema  # noqa: F401 - registers serve_schema with Hydra

STOP_S = 30.0  # a stop that takes longer (an actor or Ray not answering) ends the process anyway


def check_serve(cfg: DictConfig) -> str:
    """Everything that can be checked before Ray starts: the config's fields, the model (a Hub id
    resolved through the Hugging Face cache, the built-in tiny model built when missing), the run
    directory. Returns the name clients ask for as base_model."""
    from launch.checks import require_length, require_writable
    from launch.hub import resolve_hub_ids
    from launch.model_files import require_model, require_vllm_architecture
    from rl.config.serve import validate_serve
    from rl.data.builtins import ensure_builtin
    from rl.log.run_log import refuse_existing_run

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

    from launch.tinker.registry import RUN_META

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


REPAIR_POLL_S = 0.5  # how often the main thread looks for fleet workers to replace


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    from launch.cluster import Cluster
    from launch.components import usable_cores
    from launch.console import actor_env, quiet_driver, rollout_env
    from launch.report import write_report_or_warn
    from launch.tinker.server import FixedWeights, Served
    from rl.actors.faults import ActorFailure

    quiet_driver()
    try:
        name = check_serve(cfg)
    except INPUT_ERRORS as err:
        fail(err)
    threads = cfg.cluster.threads_per_worker or max(1, usable_cores() // 2)
    served = Served(cfg, name, cores=usable_cores(), rollout_env=rollout_env(threads, False),
                    trainer_env=actor_env(cfg.serve.lora_threads, False))
    # the fleet's owner, made on this thread: its repairs run here only (a worker lost under a sample
    # call is replaced while that call waits, with the fleet's deadline)
    cluster = Cluster(served.fleet, None, FixedWeights(), log=lambda line: print(line, flush=True))
    stopping = threading.Event()

    def on_signal(*_: Any) -> None:  # SIGTERM: stop as on Ctrl-C
        served.server.should_exit = True
        stopping.set()
        _watchdog(STOP_S)  # (armed now: a repair running on this thread ends only with its deadline)

    signal.signal(signal.SIGTERM, on_signal)
    how = "merged into the weights per batch" if served.adapter_sampling == "merged" else "with vLLM's LoRA"
    print(f"Tinker service for {name} at {served.url} (run directory {cfg.run.dir}; adapters sampled {how}); "
          "point the SDK at it: "
          f"tinker.ServiceClient(base_url={served.url!r}) with TINKER_API_KEY=tml-...", flush=True)
    code = 0
    try:
        while served._thread.is_alive() and not stopping.wait(REPAIR_POLL_S):
            try:
                cluster.repair()
            except ActorFailure as err:  # its replacements used up: the calls that wait for it fail at their deadline
                print(f"warning: {err}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        _watchdog(STOP_S)
        try:
            served.stop()
        except BaseException:  # noqa: BLE001 - shown, then the process ends all the same
            traceback.print_exc()
            code = 1
        write_report_or_warn(cfg.run.dir)
        print(f"Tinker service stopped (run directory {cfg.run.dir})", flush=True)
        _exit(code)


if __name__ == "__main__":
    main()
