"""`TinkerService`: what the Tinker protocol's calls do, without HTTP (launch/tinker/app.py
serves it): sessions, training models, samplers and their saved weights, on our own parts.

- A **training model** is an `AdapterTrainer` actor (trainer/adapter_trainer.py): LoRA adapters
  over the served base model in a one-process DeepSpeed engine, one actor per model, so clients
  training at once never share weights. Its calls run in `seq_id` order (futures.SeqGate).
- A **sampler** is a saved adapter folder (or none: the base model); sampling runs on the vLLM
  rollout fleet (rollout/fleet.py), each request naming its adapter (vLLM's LoRA), with the
  per-token log-probs the engine reports.
- Saved weights live under the run directory as `<model_id>/<kind>/<name>` and are named to clients
  as `tinker://<model_id>/<kind>/<name>` (kind: `weights` = training state, `sampler_weights`);
  each model's folder has its `RUN_META`. The REST listings (training runs, checkpoints) read these
  folders, so a service resumed on the same run directory serves them again.
- Sessions end when their client stops heartbeating (`serve.session_timeout_s`): their models stop
  and their queued calls are dropped. At `serve.max_models` live actors, a new model (or an evicted
  one's next call) evicts the idle model unused longest: its state is saved and restored at its next
  call.

Everything a client sends is checked here, before any actor sees it: ids (another session's model
or sampler is unknown to this one), token ids against the vocabulary, shapes, sizes, numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from launch.tinker.batching import SampleBatcher
from launch.tinker.futures import Futures, SeqGate, UserError
from launch.tinker.proto import (WireError, encode_forward_backward, encode_sample, loss_config_of, tensor_from_proto,
                                 tokens_of)
from rl.algo.datum_losses import NOT_SERVED, DatumLoss, DatumLossError
from rl.data.types import GenerationRequest

TINKER_PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([A-Za-z0-9_.\-]+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
RUN_META = "run.json"  # in a model's folder under run.dir/tinker: its id, base model and LoRA settings


@dataclass
class Session:
    id: str
    created: float
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    finished: bool = False


@dataclass
class TrainingModel:
    id: str
    session: str
    rank: int
    spec: Any  # trainer.adapter_trainer.AdapterSpec
    group: Any  # the ActorGroup of its one AdapterTrainer
    gate: SeqGate
    index: int = 0  # the service's count of models when this one was made (metrics.jsonl's tinker/model)
    loss_sum: float = 0.0  # forward_backward losses since the last optim_step
    tokens: int = 0
    steps: int = 0
    last_step: float = field(default_factory=time.monotonic)
    # its actor: "starting", "live", "evicting" (its state being saved to free a slot), "evicted"
    # (stopped, its state under `evicted_to`: the model's next call starts it again from there)
    state: str = "starting"
    busy: int = 0  # calls submitted and not finished (an idle model has none)
    last_used: float = field(default_factory=time.monotonic)
    evicted_to: str | None = None
    last_wall: float = field(default_factory=time.time)  # when its last call ended (a TrainingRun's last_request_time)
    slot: threading.Lock = field(default_factory=threading.Lock)  # held by a call running on the actor, or an eviction

    def call(self, method: str, *args: Any, kind: str, timeout_s: float, **kwargs: Any) -> Any:
        """`method` on the model's actor within `timeout_s`; an error the actor raised for what
        the client sent (ValueError) is the client's, any other failure the server's."""
        from rl.run.faults import ActorFailure

        handle = self.group.handles[0]
        try:
            return self.group.each([getattr(handle, method).remote(*args, **kwargs)], kind, timeout_s)[0]
        except ActorFailure:
            raise
        except Exception as err:  # noqa: BLE001 - a Ray task error carries the actor's own exception
            cause = getattr(err, "cause", err)
            if isinstance(cause, ValueError):
                raise UserError(str(cause).splitlines()[0]) from None
            raise


@dataclass
class Sampler:
    id: str
    session: str
    adapter: str | None  # a peft folder, or None: the base model
    model_path: str | None  # the tinker:// path it was made from


class TinkerService:
    def __init__(self, cfg: Any, fleet: Any, tokenizer: Any, base_path: str, run_dir: str,
                 start_trainer: Callable[[Any, str], Any], log: Callable[[str], None] = print, run_log: Any = None,
                 first_step: int = 1):
        """`fleet`: the RolloutFleet of the base model (vLLM with LoRA); `start_trainer(spec, name)`
        starts one AdapterTrainer actor group (launch/serve.py starts them on Ray); `run_log` (a
        rl.run.run_log.RunLog) gets a metrics row at every optim_step of any model (numbered from
        `first_step`: a resumed run.dir's rows come first). Weights saved under `run_dir` before
        (a resumed service) are served as they were: their tinker:// paths, runs and checkpoints."""
        self.run_log, self._steps = run_log, itertools.count(first_step)
        self.cfg, self.s = cfg, cfg.serve
        self.fleet, self.tokenizer, self.base_path, self.log = fleet, tokenizer, base_path, log
        self.model_name = self.s.model_name or cfg.model.path
        self.vocab = len(tokenizer)
        self.max_len = cfg.rollout.max_model_len
        self.weights_dir = os.path.join(run_dir, "tinker")
        os.makedirs(self.weights_dir, exist_ok=True)
        self.futures = Futures(self.s.op_timeout_s)
        self._start_trainer = start_trainer
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._lock = threading.RLock()
        self._seeds = itertools.count(1)
        self._batcher = SampleBatcher(self._on_fleet)  # sample calls that arrive together: one batch
        self.stats: dict[str, float] = {"forward_backward_tokens": 0, "forward_backward_s": 0.0,
                                        "sample_tokens": 0, "sample_s": 0.0}
        self._calls = open(os.path.join(run_dir, "calls.jsonl"), "a", buffering=1)  # one line per finished call
        self._log_lock = threading.Lock()  # calls.jsonl and the run log: written from the calls' threads
        self._archives: dict[str, tuple[str, float, str]] = {}  # download token -> (folder, expires, tinker path)

    def _record(self, call: str, owner: str, seconds: float, **figures: Any) -> None:
        """A finished call in `run.dir/calls.jsonl`: what, whose, how long, its figures."""
        with self._log_lock:
            if self._calls.closed:  # a call that ends while the service stops
                return
            self._calls.write(json.dumps({"time": round(time.time(), 3), "call": call, "of": owner,
                                          "seconds": round(seconds, 4), **figures}) + "\n")

    # ---- sessions ---------------------------------------------------------------------------

    def create_session(self) -> str:
        sid = f"sess-{secrets.token_hex(6)}"
        now = time.monotonic()
        with self._lock:
            self.sessions[sid] = Session(sid, now, now)
        self.log(f"session {sid} started")
        return sid

    def session(self, sid: str, touch: bool = True) -> Session:
        """A live session; `touch`: the call is its client's own (one naming its session_id), which
        keeps it alive as a heartbeat does. A call naming only a model or sampler does not: anyone
        with the key may ask about those, and a dead client's session must expire all the same."""
        with self._lock:
            session = self.sessions.get(sid)
            if session is None or session.finished:
                raise UserError(f"session_id={sid!r}: no such live session here (finished, expired or never "
                                "made); create a new ServiceClient", status=404)
            if touch:
                session.last_seen = time.monotonic()
            return session

    def heartbeat(self, sid: str) -> None:
        with self._lock:
            session = self.sessions.get(sid)
            if session is None or session.finished:
                raise UserError(f"session {sid!r} is over", status=410)  # the SDK stops heartbeating on 410
            session.last_seen = time.monotonic()

    def finish(self, sid: str) -> None:
        """End a session: its training models' actors are stopped (their saved weights stay)."""
        with self._lock:
            session = self.sessions.get(sid)
            if session is None or session.finished:
                return
            session.finished = True
            models = [self.models.pop(m) for m in session.models if m in self.models]
            for sampler in session.samplers:
                self.samplers.pop(sampler, None)
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
        now = time.monotonic()
        with self._lock:
            stale = [s.id for s in self.sessions.values()
                     if not s.finished and now - s.last_seen > self.s.session_timeout_s]
        for sid in stale:
            self.log(f"session {sid}: no heartbeat for {self.s.session_timeout_s:.0f} s (serve.session_timeout_s)")
            self.finish(sid)
        return stale

    # ---- ids ----------------------------------------------------------------------------------

    def model(self, model_id: str, sid: str | None = None) -> TrainingModel:
        with self._lock:
            model = self.models.get(model_id)
        if model is None or (sid is not None and model.session != sid):
            raise UserError(f"model_id={model_id!r}: no such training model in this session", status=404)
        self.session(model.session, touch=False)
        return model

    def sampler(self, sampler_id: str) -> Sampler:
        with self._lock:
            sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise UserError(f"sampling_session_id={sampler_id!r}: no such sampler (made in a live session)",
                            status=404)
        self.session(sampler.session, touch=False)
        return sampler

    def weights_path(self, model_id: str, kind: str, name: str) -> tuple[str, str]:
        """(the folder, the tinker:// path) of saved weights `name` of a model."""
        if not _NAME.match(name):
            raise UserError(f"path={name!r}: a checkpoint name is 1-128 letters, digits, '.', '_' or '-'")
        folder = os.path.join(self.weights_dir, model_id.replace(":", "_"), kind, name)
        return folder, f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, tinker_path: str, kind: str | None = None) -> tuple[str, str]:
        """(the folder, the owning model id) of a tinker:// path saved here."""
        m = TINKER_PATH.match(tinker_path or "")
        if not m or (kind and m.group(2) != kind):
            want = f"tinker://<model_id>/{kind or 'weights|sampler_weights'}/<name>"
            raise UserError(f"path={tinker_path!r}: not a path this service wrote ({want})", status=400)
        folder = self.weights_path(m.group(1), m.group(2), m.group(3))[0]
        if not os.path.isdir(folder):
            raise UserError(f"path={tinker_path!r}: no such saved weights here", status=404)
        return folder, m.group(1)

    # ---- training runs and checkpoints on disk (the REST calls; a resumed run.dir's too) --------

    def run_folder(self, model_id: str) -> str:
        return os.path.join(self.weights_dir, model_id.replace(":", "_"))

    def _write_run(self, model: TrainingModel) -> None:
        """`RUN_META` in the model's folder: what a listing (and a resumed service) tells of it."""
        from dataclasses import asdict

        folder = self.run_folder(model.id)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, RUN_META), "w") as f:
            json.dump({"training_run_id": model.id, "base_model": self.model_name, "lora_rank": model.rank,
                       "created": time.time(), "spec": asdict(model.spec)}, f)

    def _runs_on_disk(self) -> dict[str, dict[str, Any]]:
        """model id -> its `RUN_META` (or {} for a folder written before it was kept)."""
        out: dict[str, dict[str, Any]] = {}
        for entry in sorted(os.listdir(self.weights_dir)) if os.path.isdir(self.weights_dir) else []:
            folder = os.path.join(self.weights_dir, entry)
            if not os.path.isdir(folder):
                continue
            meta: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, RUN_META)) as f:
                    meta = json.load(f)
            model_id = meta.get("training_run_id") or entry.replace("_train_", ":train:")
            out[model_id] = meta
        return out

    def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """The saved weights of a model (the SDK's Checkpoint), oldest first."""
        import datetime

        out = []
        for kind, type_ in (("weights", "training"), ("sampler_weights", "sampler")):
            folder = os.path.join(self.run_folder(model_id), kind)
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                path = os.path.join(folder, name)
                if "~" in name or not _NAME.match(name) or not os.path.isdir(path):  # a save being swapped in
                    continue
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
                when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.UTC)
                out.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": type_, "time": when.isoformat(),
                            "tinker_path": f"tinker://{model_id}/{kind}/{name}", "size_bytes": size})
        return sorted(out, key=lambda c: c["time"])

    def training_run(self, model_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The SDK's TrainingRun of a model, live or saved under run.dir (404: neither)."""
        import datetime

        with self._lock:
            live = self.models.get(model_id)
        if meta is None:
            meta = self._runs_on_disk().get(model_id)
        if live is None and meta is None:
            raise UserError(f"training_run_id={model_id!r}: no such training run here (live or saved under "
                            "run.dir)", status=404)
        meta = meta or {}
        checkpoints = self.checkpoints(model_id)
        rank = live.rank if live is not None else meta.get("lora_rank")
        if rank is None:  # a folder written before RUN_META: its checkpoints tell
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                first = next(c for c in checkpoints if c["checkpoint_type"] == "sampler")
                with open(os.path.join(self.resolve(first["tinker_path"])[0], "adapter_config.json")) as f:
                    rank = json.load(f)["r"]
        times = [c["time"] for c in checkpoints]
        if live is not None:
            times.append(datetime.datetime.fromtimestamp(live.last_wall, datetime.UTC).isoformat())
        if meta.get("created"):
            times.append(datetime.datetime.fromtimestamp(meta["created"], datetime.UTC).isoformat())
        last = {t: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == t), None)
                for t in ("training", "sampler")}
        return {"training_run_id": model_id, "base_model": meta.get("base_model", self.model_name),
                "model_owner": "local", "is_lora": True, "corrupted": False, "lora_rank": rank,
                "last_request_time": max(times) if times else datetime.datetime.now(datetime.UTC).isoformat(),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": None}

    def training_runs(self) -> list[dict[str, Any]]:
        """Every training run, live or saved under run.dir, the latest request first."""
        runs = self._runs_on_disk()
        with self._lock:
            for model_id in self.models:
                runs.setdefault(model_id, {})
        out = [self.training_run(model_id, meta) for model_id, meta in runs.items()]
        return sorted(out, key=lambda r: r["last_request_time"], reverse=True)

    def archive_token(self, tinker_path: str, valid_s: float = 900.0) -> tuple[str, float]:
        """A one-off download name for the folder of a checkpoint, valid `valid_s` seconds (the
        archive's URL, fetched without the API key as a signed URL is)."""
        folder, _ = self.resolve(tinker_path)
        token, expires = secrets.token_urlsafe(24), time.time() + valid_s
        with self._lock:
            now = time.time()
            self._archives = {k: v for k, v in self._archives.items() if v[1] > now}
            self._archives[token] = (folder, expires, tinker_path)
        return token, expires

    def archive(self, token: str) -> tuple[str, str]:
        """(the folder, its tinker:// path) an archive token names (404: unknown or expired)."""
        with self._lock:
            found = self._archives.get(token)
        if found is None or found[1] < time.time() or not os.path.isdir(found[0]):
            raise UserError("no such archive (its URL expired or was never made): ask for it again", status=404)
        return found[0], found[2]

    # ---- training models ----------------------------------------------------------------------

    def _check_base(self, base_model: str | None) -> None:
        same_folder = bool(base_model) and os.path.isdir(base_model) and os.path.samefile(base_model, self.base_path)
        if base_model and base_model != self.model_name and not same_folder:
            raise UserError(f"base_model={base_model!r}: this service serves {self.model_name!r} only (start "
                            "launch.serve with model.path=<that model> to serve another)")

    def create_model(self, sid: str, model_seq_id: int, base_model: str, lora: dict[str, Any]) -> str:
        """Submit the start of a LoRA training model `<session>:train:<model_seq_id>` (a future)."""
        from trainer.adapter_trainer import AdapterSpec

        self.session(sid)
        self._check_base(base_model)
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= self.s.max_lora_rank:
            raise UserError(f"lora_config.rank={rank!r}: must be an integer in [1, {self.s.max_lora_rank}] "
                            "(serve.max_lora_rank)")
        flags = {k: bool(lora.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed")}
        if not any(flags.values()):
            raise UserError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        seed = lora.get("seed")
        spec = AdapterSpec(base_path=self.base_path, base_model=self.model_name, rank=rank, **flags,
                           seed=int(seed) if seed is not None else 0, dtype=self.cfg.model.dtype,
                           threads=self.s.lora_threads)
        return self._start_model(sid, model_seq_id, spec, restore=None)

    def load_model(self, sid: str, model_seq_id: int, path: str, optimizer: bool) -> str:
        """Create-from-state: a new training model from a saved state (its LoRA settings too)."""
        from trainer.adapter_trainer import saved_spec

        self.session(sid)
        folder, _ = self.resolve(path, "weights")
        # (the base as this service serves it: a resumed run.dir may have found it at another path)
        spec = dataclasses.replace(saved_spec(folder), base_path=self.base_path, base_model=self.model_name,
                                   threads=self.s.lora_threads, dtype=self.cfg.model.dtype)
        return self._start_model(sid, model_seq_id, spec, restore=(folder, optimizer))

    def _start_model(self, sid: str, model_seq_id: int, spec: Any, restore: tuple[str, bool] | None) -> str:
        model_id = f"{sid}:train:{model_seq_id}"
        with self._lock:
            if model_id in self.models:
                raise UserError(f"model_seq_id={model_seq_id} is already a model of this session", status=409)
            victim = self._make_room(None)
            placeholder = TrainingModel(model_id, sid, spec.rank, spec, None, SeqGate(self.s.seq_wait_s),
                                        index=len(self.models))
            self.models[model_id] = placeholder
            self.sessions[sid].models.append(model_id)

        def start() -> dict[str, Any]:
            try:
                if victim is not None:
                    self._evict(victim)
                placeholder.group = self._start_trainer(spec, model_id)
                if restore is not None:
                    placeholder.call("load_state", *restore, kind="load_state", timeout_s=self.s.op_timeout_s)
                with self._lock:
                    if model_id not in self.models:  # its session ended while it started
                        raise UserError(f"session {sid} ended while {model_id} started", status=410)
                    placeholder.state, placeholder.last_used = "live", time.monotonic()
                self._write_run(placeholder)
            except BaseException:
                with self._lock:
                    self.models.pop(model_id, None)
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
        alive = [m for m in self.models.values() if m.state in ("starting", "live")]
        if len(alive) < self.s.max_models:
            return None
        idle = [m for m in alive if m.state == "live" and m.busy == 0 and m is not keep]
        if not idle:
            raise UserError(f"{len(alive)} training models are alive and busy (serve.max_models={self.s.max_models}): "
                            "retry when a call ends, close a ServiceClient or start the service with a higher "
                            "serve.max_models", status=429)
        victim = min(idle, key=lambda m: m.last_used)
        victim.state = "evicting"
        return victim

    def _evict(self, model: TrainingModel) -> None:
        """Save the state (adapters and optimizer) of a model `_make_room` chose and stop its actor;
        its next call starts it again from that state (`_revive`)."""
        folder = os.path.join(self.weights_dir, model.id.replace(":", "_"), "evicted", "state")
        with model.slot:
            try:
                os.makedirs(os.path.dirname(folder), exist_ok=True)
                model.call("save_state", folder, kind="save", timeout_s=self.s.op_timeout_s)
            except BaseException:
                model.state = "live"
                raise
            group, model.group, model.evicted_to, model.state = model.group, None, folder, "evicted"
        group.shutdown()
        self.log(f"training model {model.id}: evicted to make room (serve.max_models={self.s.max_models}); "
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
            model.call("load_state", model.evicted_to, True, kind="load_state", timeout_s=self.s.op_timeout_s)
        except BaseException:
            group, model.group, model.state = model.group, None, "evicted"
            if group is not None:
                group.shutdown()
            raise
        model.state = "live"
        self.log(f"training model {model.id}: restored from {model.evicted_to}")

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.model(model_id)
        return {"type": "get_info", "model_id": model_id,
                "model_data": {"arch": "lora", "model_name": self.model_name, "tokenizer_id": self.model_name},
                "is_lora": True, "lora_rank": model.rank, "model_name": self.model_name}

    def release(self, model_id: Any, seq_id: Any) -> None:
        """A training call refused before it was queued, or one this service does not serve at all
        (any route, known or not, whose body names a model and a seq_id): its number is used up, so
        the model's later calls do not wait for it (`serve.seq_wait_s`) and fail."""
        with self._lock:
            model = self.models.get(model_id) if isinstance(model_id, str) else None
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
                    while model.group is None and model.state == "starting":  # the create future's thread
                        if model.id not in self.models:
                            raise UserError(f"model_id={model.id!r}: its start failed")
                        time.sleep(0.05)
                    with model.slot:  # (an eviction of this model ends first)
                        if self.models.get(model.id) is not model:  # its session ended: dropped, not computed
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
        model = self.model(message.model_id)
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
        from trainer.adapter_trainer import Datum

        try:
            loss = DatumLoss.of(message.loss_fn, loss_config_of(message))
            data, total = [], 0
            for i, d in enumerate(message.data):
                tokens = tokens_of(d.model_input, f"data[{i}].model_input")
                inputs = {name: tensor_from_proto(t, name) for name, t in d.loss_fn_inputs.items()}
                data.append(Datum(tokens, inputs))
                total += len(tokens)
                self._check_tokens(tokens, f"data[{i}].model_input")
                if "target_tokens" in inputs:
                    self._check_tokens(inputs["target_tokens"].flatten().tolist(), f"data[{i}].target_tokens")
                for name, t in inputs.items():
                    if t.dtype.is_floating_point and not torch.isfinite(t).all():
                        raise UserError(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or infinity")
        except (WireError, DatumLossError) as err:
            raise UserError(str(err)) from None
        if not data:
            raise UserError("forward_backward with no data: send at least one Datum")
        if total > self.s.max_tokens_per_request:
            raise UserError(f"{total} tokens in one forward_backward: over serve.max_tokens_per_request="
                            f"{self.s.max_tokens_per_request}; send fewer data per call", status=413)
        for i, d in enumerate(data):
            if len(d.tokens) + 1 > self.max_len:
                raise UserError(f"data[{i}] is {len(d.tokens)} input tokens + its last target = {len(d.tokens) + 1} "
                                f"tokens, over the served context of {self.max_len} tokens (rollout.max_model_len)")

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            out = model.call("forward_backward", data, loss.name, dict(loss.config), bool(message.forward_only),
                             kind="forward_backward", timeout_s=self.s.op_timeout_s)
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
        model = self.model(model_id)
        with self._refusing(model, seq_id):
            return self._optim_step(model, seq_id, adam)

    def _optim_step(self, model: TrainingModel, seq_id: int, adam: dict[str, Any]) -> str:
        params = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                  "grad_clip_norm": 0.0, **adam}
        unknown = sorted(set(params) - {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"})
        if unknown:
            raise UserError(f"adam_params: unknown keys {unknown}")
        try:
            params = {k: float(v) for k, v in params.items()}
        except (TypeError, ValueError):
            raise UserError(f"adam_params: every value must be a number, got {adam}") from None
        if not (params["learning_rate"] >= 0 and 0 <= params["beta1"] < 1 and 0 <= params["beta2"] < 1
                and params["eps"] > 0 and params["weight_decay"] >= 0 and params["grad_clip_norm"] >= 0):
            raise UserError(f"adam_params {params}: need learning_rate >= 0, beta1 and beta2 in [0, 1), eps > 0, "
                            "weight_decay >= 0, grad_clip_norm >= 0")
        def run() -> dict[str, Any]:
            started = time.perf_counter()
            metrics = model.call("optim_step", kind="optim_step", timeout_s=self.s.op_timeout_s, **params)
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
        model = self.model(model_id)
        kind = "sampler_weights" if for_sampler else "weights"
        with self._refusing(model, seq_id):
            if name is None and not for_sampler:
                raise UserError("save_weights needs a path (the checkpoint's name)")
            if name is None:
                name = f"ephemeral-{seq_id}"
            folder, path = self.weights_path(model_id, kind, name)

        def run() -> dict[str, Any]:
            # the same name saved again: the trainer swaps the newer weights in whole (a sampler on
            # this path samples them from then on: rollout/vllm_engine.AdapterRequests)
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            model.call("save_adapter" if for_sampler else "save_state", folder, kind="save", timeout_s=self.s.op_timeout_s)
            if for_sampler and sampler_seq_id is not None:
                sampler_id = self._add_sampler(model.session, sampler_seq_id, folder, path)
                return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sampler_id}
            return {"type": "save_weights_for_sampler" if for_sampler else "save_weights", "path": path}

        return self._ordered(model, seq_id, run)

    # ---- sampling -----------------------------------------------------------------------------

    def _add_sampler(self, sid: str, seq: int, adapter: str | None, model_path: str | None) -> str:
        sampler_id = f"{sid}:sample:{seq}"
        with self._lock:
            self.samplers[sampler_id] = Sampler(sampler_id, sid, adapter, model_path)
            self.sessions[sid].samplers.append(sampler_id)
        return sampler_id

    def create_sampler(self, sid: str, seq: int, base_model: str | None, model_path: str | None) -> str:
        self.session(sid)
        if model_path:
            folder, _ = self.resolve(model_path, "sampler_weights")
            return self._add_sampler(sid, seq, folder, model_path)
        if not base_model:
            raise UserError("create_sampling_session needs base_model or model_path")
        self._check_base(base_model)
        return self._add_sampler(sid, seq, None, None)

    def _check_tokens(self, tokens: list[int], where: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:
            raise UserError(f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})")

    def sample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """Submit a sample call (JSON SampleRequest); returns its request id and sequence ids."""
        sampler = self.sampler(body.get("sampling_session_id") or "")
        prompt = body.get("prompt") or {}
        tokens: list[int] = []
        for i, chunk in enumerate(prompt.get("chunks") or []):
            if chunk.get("type", "encoded_text") != "encoded_text" or not isinstance(chunk.get("tokens"), list):
                raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks (token lists) are served")
            tokens += chunk["tokens"]
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise UserError("prompt: give at least one integer token id")
        self._check_tokens(tokens, "prompt")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or not 1 <= n <= self.s.max_samples:
            raise UserError(f"num_samples={n!r}: must be an integer in [1, {self.s.max_samples}] (serve.max_samples)")
        if body.get("record_stability_info"):
            raise UserError("record_stability_info is not served: " + NOT_SERVED["stable_reinforce"])
        params = body.get("sampling_params") or {}
        max_tokens = params.get("max_tokens")
        room = self.max_len - len(tokens)
        if room < 1:
            raise UserError(f"the prompt is {len(tokens)} tokens, which leaves no room to sample in the served context "
                            f"of {self.max_len} tokens (rollout.max_model_len): send a prompt of at most "
                            f"{self.max_len - 1} tokens")
        if max_tokens is None:
            max_tokens = min(self.cfg.rollout.max_new_tokens, room)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UserError(f"sampling_params.max_tokens={max_tokens!r}: must be a positive integer")
        if max_tokens > room:
            raise UserError(f"sampling_params.max_tokens={max_tokens} after the prompt's {len(tokens)} tokens is over "
                            f"the served context of {self.max_len} tokens (rollout.max_model_len): at most {room} "
                            "tokens can be sampled after this prompt")
        if (n * (len(tokens) + max_tokens)) > self.s.max_tokens_per_request:
            raise UserError(f"num_samples x (prompt + max_tokens) is over serve.max_tokens_per_request="
                            f"{self.s.max_tokens_per_request}", status=413)
        temperature, top_p = float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        if not 0 <= temperature <= 10 or not 0 < top_p <= 1 or top_k == 0 or top_k < -1:
            raise UserError(f"sampling_params: temperature={temperature} must be in [0, 10], top_p={top_p} in (0, 1], "
                            f"top_k={top_k} -1 or >= 1")
        if any(body.get(k) for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                                     "target_prompt_logprobs", "prompt_logprobs_last_n")):
            raise UserError("top-k, target and alternative-token log-probs are not served: ask for prompt_logprobs "
                            "only")
        stop = params.get("stop")
        strings = tokens_stop = None
        if isinstance(stop, str):
            strings = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
            strings = stop
        elif isinstance(stop, list) and all(isinstance(s, int) for s in stop) and stop:
            self._check_tokens(stop, "sampling_params.stop")
            tokens_stop = stop
        elif stop is not None and stop != []:
            raise UserError(f"sampling_params.stop={stop!r}: a string, a list of strings or a list of token ids")
        seed = params.get("seed")
        base_seed = int(seed) if seed is not None else next(self._seeds) * 7919 + int(time.time())
        requests = [GenerationRequest(prompt_ids=list(tokens), prompt_text="", group_id=0, sample_index=i,
                                      seed=(base_seed + i) % 2**31, max_tokens=max_tokens, temperature=temperature,
                                      adapter=sampler.adapter, top_p=top_p, top_k=top_k if top_k > 0 else None,
                                      stop=strings, stop_token_ids=tokens_stop, ignore_eos=stop == [],
                                      prompt_logprobs=bool(body.get("prompt_logprobs")) and i == 0)
                    for i in range(n)]  # (one prompt: its log-probs come with the first sample)
        sequence_ids = [f"{sampler.id}:seq:{secrets.token_hex(4)}" for _ in range(n)]

        def run() -> dict[str, Any]:
            if self.samplers.get(sampler.id) is not sampler:  # its session ended while it waited: dropped
                raise UserError(f"sampling_session_id={sampler.id!r}: its session ended; the call was dropped",
                                status=410)
            started = time.perf_counter()
            samples = self._batcher(requests, self.s.op_timeout_s)
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
        if self.fleet.repair():  # a worker lost under an earlier call is replaced first; it loads the base
            self.fleet.synced()  # weights from model.path and adapters per request, so it is up to date
        return self.fleet.generate(requests)

    def close(self) -> None:
        """Stop: pending calls are cancelled and every call waiting for its turn ends at once (a
        stopping service leaves no thread waiting out `serve.seq_wait_s`), then the models' actors."""
        self._batcher.close()
        self.futures.close()
        with self._lock:
            models, self.models = list(self.models.values()), {}
        for model in models:
            model.gate.close()
        with self._log_lock:
            self._calls.close()
        for model in models:
            if model.group is not None:
                model.group.shutdown()
