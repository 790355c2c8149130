"""`TinkerService`: what the Tinker protocol's calls do, without HTTP (launch/tinker/app.py serves
it), on our own parts. What exists and under which id is the registry's (launch/tinker/registry.py),
what a request may ask is checked by launch/tinker/checks.py before anything runs; here the calls
run.

- A **training model** is an `AdapterTrainer` actor (trainer/adapter_trainer.py): LoRA adapters
  over the served base model in a one-process DeepSpeed engine, one actor per model, so clients
  training at once never share weights. Its calls run in `seq_id` order (futures.SeqGate).
- A **sampler** is a saved adapter folder (or none: the base model); sampling runs on the rollout
  fleet (rollout/fleet.py), each request naming its adapter, with the per-token log-probs the
  engine reports. Sample calls that arrive together are one fleet call (launch/tinker/batching.py).
  The service never repairs the fleet: its owner (launch/serve.py's `Cluster`, on the main thread)
  does, and a fleet call that lost its worker waits for that with the fleet's deadline.
- Sessions end when their client stops heartbeating (`serve.session_timeout_s`): their models stop
  and their queued calls are dropped. At `serve.max_models` live actors, a new model (or an evicted
  one's next call) evicts the idle model unused longest: its state is saved and restored at its next
  call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import secrets
import threading
import time
from typing import Any, Callable

from launch.tinker.batching import SampleBatcher
from launch.tinker.checks import RequestChecks
from launch.tinker.futures import Futures, SeqGate, UserError
from launch.tinker.proto import encode_forward_backward, encode_sample
from launch.tinker.registry import Registry, TrainingModel
from rl.data.types import GenerationRequest


class TinkerService:
    def __init__(self, cfg: Any, fleet: Any, tokenizer: Any, base_path: str, run_dir: str,
                 start_trainer: Callable[[Any, str], Any], log: Callable[[str], None] = print, run_log: Any = None,
                 first_step: int = 1):
        """`fleet`: the RolloutFleet of the base model (adapters per request); `start_trainer(spec, name)`
        starts one AdapterTrainer actor group (launch/tinker/server.py starts them on Ray); `run_log` (a
        rl.log.run_log.RunLog) gets a metrics row at every optim_step of any model (numbered from
        `first_step`: a resumed run.dir's rows come first). Weights saved under `run_dir` before
        (a resumed service) are served as they were: their tinker:// paths, runs and checkpoints."""
        self.run_log, self._steps = run_log, itertools.count(first_step)
        self.cfg, self.serve = cfg, cfg.serve
        self.fleet, self.tokenizer, self.base_path, self.log = fleet, tokenizer, base_path, log
        self.model_name = self.serve.model_name or cfg.model.path
        self.max_len = cfg.rollout.max_model_len
        self.registry = Registry(os.path.join(run_dir, "tinker"), self.model_name, log)
        self.checks = RequestChecks(self.serve, len(tokenizer), self.max_len, cfg.rollout.max_new_tokens,
                                    self.model_name, base_path)
        self._lock = self.registry.lock
        self.futures = Futures(self.serve.op_timeout_s)
        self._start_trainer = start_trainer
        self._seeds = itertools.count(1)
        self._batcher = SampleBatcher(self._on_fleet)  # sample calls that arrive together: one batch
        self.stats: dict[str, float] = {"forward_backward_tokens": 0, "forward_backward_s": 0.0,
                                        "sample_tokens": 0, "sample_s": 0.0}
        self._calls = open(os.path.join(run_dir, "calls.jsonl"), "a", buffering=1)  # one line per finished call
        self._log_lock = threading.Lock()  # calls.jsonl and the run log: written from the calls' threads

    def _record(self, call: str, owner: str, seconds: float, **figures: Any) -> None:
        """A finished call in `run.dir/calls.jsonl`: what, whose, how long, its figures."""
        with self._log_lock:
            if self._calls.closed:  # a call that ends while the service stops
                return
            self._calls.write(json.dumps({"time": round(time.time(), 3), "call": call, "of": owner,
                                          "seconds": round(seconds, 4), **figures}) + "\n")

    # ---- sessions (the registry holds them; ending one stops its models) -----------------------

    def finish(self, sid: str) -> None:
        """End a session: its training models' actors are stopped (their saved weights stay)."""
        with self._lock:
            session = self.registry.sessions.get(sid)
            if session is None or session.finished:
                return
            session.finished = True
            models = [self.registry.models.pop(m) for m in session.models if m in self.registry.models]
            for sampler in session.samplers:
                self.registry.samplers.pop(sampler, None)
        for model in models:  # its calls still waiting for their turn end now, not computed
            model.gate.close(UserError(f"session {sid} ended: the calls of {model.id} still queued were dropped",
                                       status=410))
        for model in models:
            if model.group is not None:
                model.group.shutdown()
            if model.evicted_to is not None:  # the state an eviction saved serves nobody now
                import shutil

                shutil.rmtree(os.path.dirname(model.evicted_to), ignore_errors=True)
        self.log(f"session {sid} ended ({len(models)} training model(s) stopped)")

    def expire(self) -> list[str]:
        """End the sessions whose client stopped heartbeating (`serve.session_timeout_s`)."""
        stale = self.registry.stale_sessions(self.serve.session_timeout_s)
        for sid in stale:
            self.log(f"session {sid}: no heartbeat for {self.serve.session_timeout_s:.0f} s (serve.session_timeout_s)")
            self.finish(sid)
        return stale

    # ---- training models ----------------------------------------------------------------------

    def create_model(self, sid: str, model_seq_id: int, base_model: str, lora: dict[str, Any]) -> str:
        """Submit the start of a LoRA training model `<session>:train:<model_seq_id>` (a future)."""
        from trainer.adapter_trainer import AdapterSpec

        self.registry.session(sid)
        self.checks.base_model(base_model)
        rank, flags, seed = self.checks.lora(lora)
        spec = AdapterSpec(base_path=self.base_path, base_model=self.model_name, rank=rank, **flags,
                           seed=seed, dtype=self.cfg.model.dtype,
                           threads=self.serve.lora_threads)
        return self._start_model(sid, model_seq_id, spec, restore=None)

    def load_model(self, sid: str, model_seq_id: int, path: str, optimizer: bool) -> str:
        """Create-from-state: a new training model from a saved state (its LoRA settings too)."""
        from trainer.adapter_trainer import saved_spec

        self.registry.session(sid)
        folder, _ = self.registry.resolve(path, "weights")
        # (the base as this service serves it: a resumed run.dir may have found it at another path)
        spec = dataclasses.replace(saved_spec(folder), base_path=self.base_path, base_model=self.model_name,
                                   threads=self.serve.lora_threads, dtype=self.cfg.model.dtype)
        return self._start_model(sid, model_seq_id, spec, restore=(folder, optimizer))

    def _start_model(self, sid: str, model_seq_id: int, spec: Any, restore: tuple[str, bool] | None) -> str:
        model_id = f"{sid}:train:{model_seq_id}"
        with self._lock:
            if model_id in self.registry.models:
                raise UserError(f"model_seq_id={model_seq_id} is already a model of this session", status=409)
            victim = self._make_room(None)
            placeholder = TrainingModel(model_id, sid, spec.rank, spec, None, SeqGate(self.serve.seq_wait_s),
                                        index=len(self.registry.models))
            self.registry.models[model_id] = placeholder
            self.registry.sessions[sid].models.append(model_id)

        def start() -> dict[str, Any]:
            try:
                if victim is not None:
                    self._evict(victim)
                placeholder.group = self._start_trainer(spec, model_id)
                if restore is not None:
                    placeholder.call("load_state", *restore, kind="load_state", timeout_s=self.serve.op_timeout_s)
                with self._lock:
                    if model_id not in self.registry.models:  # its session ended while it started
                        raise UserError(f"session {sid} ended while {model_id} started", status=410)
                    placeholder.state, placeholder.last_used = "live", time.monotonic()
                self.registry.write_run(placeholder)
            except BaseException:
                with self._lock:
                    self.registry.models.pop(model_id, None)
                if placeholder.group is not None:
                    placeholder.group.shutdown()
                raise
            self.log(f"training model {model_id}: LoRA rank {spec.rank}")
            if restore is not None:
                return {"type": "load_weights", "model_id": model_id, "path": None}
            return {"type": "create_model", "model_id": model_id}

        return self.futures.submit(sid, start)

    # ---- a full service: the idle model longest unused is evicted (its state saved) -------------

    def _make_room(self, keep: TrainingModel | None) -> TrainingModel | None:
        """(Holding `_lock`, a model about to take a slot.) None when fewer than `serve.max_models`
        actors are alive or starting; else the idle model unused the longest (not `keep`), marked
        "evicting" (`_evict` saves and stops it); none idle: refused (429)."""
        alive = [m for m in self.registry.models.values() if m.state in ("starting", "live")]
        if len(alive) < self.serve.max_models:
            return None
        idle = [m for m in alive if m.state == "live" and m.busy == 0 and m is not keep]
        if not idle:
            raise UserError(f"{len(alive)} training models are alive and busy (serve.max_models={self.serve.max_models}): "
                            "retry when a call ends, close a ServiceClient or start the service with a higher "
                            "serve.max_models", status=429)
        victim = min(idle, key=lambda m: m.last_used)
        victim.state = "evicting"
        return victim

    def _evict(self, model: TrainingModel) -> None:
        """Save the state (adapters and optimizer) of a model `_make_room` chose and stop its actor;
        its next call starts it again from that state (`_revive`)."""
        folder = os.path.join(self.registry.weights_dir, model.id.replace(":", "_"), "evicted", "state")
        with model.slot:
            try:
                os.makedirs(os.path.dirname(folder), exist_ok=True)
                model.call("save_state", folder, kind="save", timeout_s=self.serve.op_timeout_s)
            except BaseException:
                model.state = "live"
                raise
            group, model.group, model.evicted_to, model.state = model.group, None, folder, "evicted"
        group.shutdown()
        self.log(f"training model {model.id}: evicted to make room (serve.max_models={self.serve.max_models}); "
                 f"its state is saved under {folder} and its next call restores it")

    def _revive(self, model: TrainingModel) -> None:
        """(Holding `model.slot`.) An evicted model's actor started again from its saved state."""
        with self._lock:
            victim = self._make_room(model)
            model.state = "starting"
        try:
            if victim is not None:
                self._evict(victim)
            model.group = self._start_trainer(model.spec, model.id)
            model.call("load_state", model.evicted_to, True, kind="load_state", timeout_s=self.serve.op_timeout_s)
        except BaseException:
            group, model.group, model.state = model.group, None, "evicted"
            if group is not None:
                group.shutdown()
            raise
        model.state = "live"
        self.log(f"training model {model.id}: restored from {model.evicted_to}")

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.registry.model(model_id)
        return {"type": "get_info", "model_id": model_id,
                "model_data": {"arch": "lora", "model_name": self.model_name, "tokenizer_id": self.model_name},
                "is_lora": True, "lora_rank": model.rank, "model_name": self.model_name}

    def release(self, model_id: Any, seq_id: Any) -> None:
        """A training call refused before it was queued, or one this service does not serve at all
        (any route, known or not, whose body names a model and a seq_id): its number is used up, so
        the model's later calls do not wait for it (`serve.seq_wait_s`) and fail."""
        with self._lock:
            model = self.registry.models.get(model_id) if isinstance(model_id, str) else None
        if model is not None:
            model.gate.skip(seq_id)

    def _ordered(self, model: TrainingModel, seq_id: int, run: Callable[[], Any]) -> str:
        """Submit `run` as the model's call number `seq_id`: it runs after every lower number."""
        model.gate.claim(seq_id)  # (a model still starting: its calls wait in their turn)
        with self._lock:
            model.busy += 1

        def ordered() -> Any:
            try:
                model.gate.turn(seq_id)
                try:
                    started_by = time.monotonic() + self.serve.op_timeout_s
                    while model.group is None and model.state == "starting":  # the create future's thread
                        if model.id not in self.registry.models:
                            raise UserError(f"model_id={model.id!r}: its start failed")
                        if time.monotonic() > started_by:
                            raise TimeoutError(f"model_id={model.id!r}: not started within serve.op_timeout_s="
                                               f"{self.serve.op_timeout_s:g} s")
                        time.sleep(0.05)
                    with model.slot:  # (an eviction of this model ends first)
                        if self.registry.models.get(model.id) is not model:  # its session ended: dropped, not computed
                            raise UserError(f"model_id={model.id!r}: its session ended; the call was dropped",
                                            status=410)
                        if model.state == "evicted":
                            self._revive(model)
                        return run()
                finally:
                    model.gate.done(seq_id)
            finally:
                with self._lock:
                    model.busy -= 1
                    model.last_used, model.last_wall = time.monotonic(), time.time()

        try:
            return self.futures.submit(model.session, ordered)
        except BaseException:  # never queued (the service is stopping): the number is not held
            model.gate.done(seq_id)
            with self._lock:
                model.busy -= 1
            raise

    def forward_backward(self, message: Any) -> str:
        """Submit a forward_backward (or, `forward_only`, a forward) from its protobuf message."""
        model = self.registry.model(message.model_id)
        with self._refusing(model, int(message.seq_id)):
            return self._forward_backward(model, message)

    @contextlib.contextmanager
    def _refusing(self, model: TrainingModel, seq_id: int):
        """A training call refused at submission still uses up its seq_id (the SDK numbers the next
        call after it), so the model's later calls do not wait for it."""
        try:
            yield
        except UserError:
            model.gate.skip(seq_id)
            raise

    def _forward_backward(self, model: TrainingModel, message: Any) -> str:
        loss, data, total = self.checks.training_data(message)

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            out = model.call("forward_backward", data, loss.name, dict(loss.config), bool(message.forward_only),
                             kind="forward_backward", timeout_s=self.serve.op_timeout_s)
            took, loss_sum = time.perf_counter() - started, out["metrics"]["loss:sum"]
            self.stats["forward_backward_tokens"] += total
            self.stats["forward_backward_s"] += took
            if not message.forward_only:
                model.loss_sum += loss_sum
                model.tokens += total
            self._record("forward" if message.forward_only else "forward_backward", model.id, took,
                         loss_fn=loss.name, data=len(data), tokens=total, **{"loss:sum": loss_sum})
            return encode_forward_backward(out["outputs"], out["metrics"])

        return self._ordered(model, int(message.seq_id), run)

    def optim_step(self, model_id: str, seq_id: int, adam: dict[str, Any]) -> str:
        model = self.registry.model(model_id)
        with self._refusing(model, seq_id):
            return self._optim_step(model, seq_id, adam)

    def _optim_step(self, model: TrainingModel, seq_id: int, adam: dict[str, Any]) -> str:
        params = self.checks.adam(adam)

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            metrics = model.call("optim_step", kind="optim_step", timeout_s=self.serve.op_timeout_s, **params)
            self._record("optim_step", model.id, time.perf_counter() - started, **{**params, **metrics})
            self._step_row(model, metrics)
            return {"type": "optim_step", "metrics": {f"optim/{k}:mean": v for k, v in metrics.items()}}

        return self._ordered(model, seq_id, run)

    def _step_row(self, model: TrainingModel, metrics: dict[str, float]) -> None:
        """metrics.jsonl (and the run's loggers): one row per optim_step, of whichever model."""
        now = time.monotonic()
        model.steps += 1
        row = {"tinker/model": float(model.index), "tinker/model_step": float(model.steps),
               "tinker/loss_sum": model.loss_sum, "tinker/trained_tokens": float(model.tokens),
               "actor/grad_norm": metrics["grad_norm"], "actor/lr": metrics["learning_rate"],
               "time/step_s": now - model.last_step}
        model.loss_sum, model.tokens, model.last_step = 0.0, 0, now
        if self.run_log is not None:
            with self._log_lock:
                self.run_log.metrics(next(self._steps), row, advance=False, echo=False)

    def save_weights(self, model_id: str, seq_id: int, name: str | None, for_sampler: bool,
                     sampler_seq_id: int | None = None) -> str:
        """save_state (`for_sampler` False: adapters and optimizer) or save_weights_for_sampler (the
        adapters as a peft folder; without a name, an unnamed copy with a new sampler on it)."""
        model = self.registry.model(model_id)
        kind = "sampler_weights" if for_sampler else "weights"
        with self._refusing(model, seq_id):
            if name is None and not for_sampler:
                raise UserError("save_weights needs a path (the checkpoint's name)")
            if name is None:
                name = f"ephemeral-{seq_id}"
            folder, path = self.registry.weights_path(model_id, kind, name)

        def run() -> dict[str, Any]:
            # the same name saved again: the trainer swaps the newer weights in whole (a sampler on
            # this path samples them from then on: rollout/vllm_engine.AdapterRequests)
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            model.call("save_adapter" if for_sampler else "save_state", folder, kind="save", timeout_s=self.serve.op_timeout_s)
            if for_sampler and sampler_seq_id is not None:
                sampler_id = self.registry.add_sampler(model.session, sampler_seq_id, folder, path)
                return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sampler_id}
            return {"type": "save_weights_for_sampler" if for_sampler else "save_weights", "path": path}

        return self._ordered(model, seq_id, run)

    # ---- sampling -----------------------------------------------------------------------------

    def create_sampler(self, sid: str, seq: int, base_model: str | None, model_path: str | None) -> str:
        self.registry.session(sid)
        if model_path:
            folder, _ = self.registry.resolve(model_path, "sampler_weights")
            return self.registry.add_sampler(sid, seq, folder, model_path)
        if not base_model:
            raise UserError("create_sampling_session needs base_model or model_path")
        self.checks.base_model(base_model)
        return self.registry.add_sampler(sid, seq, None, None)

    def sample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """Submit a sample call (JSON SampleRequest); returns its request id and sequence ids."""
        sampler = self.registry.sampler(body.get("sampling_session_id") or "")
        requests = self.checks.sample(body, sampler.adapter, next(self._seeds) * 7919 + int(time.time()))
        n = len(requests)
        sequence_ids = [f"{sampler.id}:seq:{secrets.token_hex(4)}" for _ in range(n)]

        def run() -> dict[str, Any]:
            if self.registry.samplers.get(sampler.id) is not sampler:  # its session ended while it waited: dropped
                raise UserError(f"sampling_session_id={sampler.id!r}: its session ended; the call was dropped",
                                status=410)
            started = time.perf_counter()
            samples = self._batcher(requests, self.serve.op_timeout_s)
            errors = [s.error for s in samples if s.error]
            if errors:
                raise UserError(errors[0])
            took, sampled = time.perf_counter() - started, sum(len(s.completion_ids) for s in samples)
            self.stats["sample_tokens"] += sampled
            self.stats["sample_s"] += took
            self._record("sample", sampler.id, took, samples=n, sampled_tokens=sampled)
            return encode_sample([(s.completion_ids, s.logprobs, s.finish_reason) for s in samples],
                                 samples[0].prompt_logprobs if requests[0].prompt_logprobs else None)

        return self.futures.submit(sampler.session, run), sequence_ids

    def _on_fleet(self, requests: list[GenerationRequest]) -> list[Any]:
        # (a worker lost under a call is replaced by the fleet's owner, never here: the call waits for
        # that with the fleet's deadline)
        return self.fleet.generate(requests)

    def close(self) -> None:
        """Stop: pending calls are cancelled and every call waiting for its turn ends at once (a
        stopping service leaves no thread waiting out `serve.seq_wait_s`), then the models' actors."""
        self._batcher.close()
        self.futures.close()
        with self._lock:
            models, self.registry.models = list(self.registry.models.values()), {}
        for model in models:
            model.gate.close()
        with self._log_lock:
            self._calls.close()
        for model in models:
            if model.group is not None:
                model.group.shutdown()
