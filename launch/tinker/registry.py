"""The Tinker service's registry: what exists and under which id. Sessions, training models and
samplers (the records; what their calls do is launch/tinker/service.py), and the weights saved under
the run directory: `<model_id>/<kind>/<name>` folders, named to clients as
`tinker://<model_id>/<kind>/<name>` (kind: `weights` = training state, `sampler_weights`), each
model's folder with its `RUN_META`. The REST listings (training runs, checkpoints) and the checkpoint
archives' download tokens are read from these folders, so a service resumed on the same run
directory serves them again. Ids of another session's model or sampler are unknown to a session."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launch.tinker.futures import SeqGate, UserError

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
        from rl.actors.faults import ActorFailure

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


class Registry:
    def __init__(self, weights_dir: str, model_name: str, log: Callable[[str], None] = print):
        """`weights_dir`: run.dir/tinker, where saved weights live; `model_name`: the served base
        model's name (what a RUN_META records)."""
        self.weights_dir, self.model_name, self.log = weights_dir, model_name, log
        os.makedirs(weights_dir, exist_ok=True)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.lock = threading.RLock()  # guards the three tables (the service holds it across a change)
        self._archives: dict[str, tuple[str, float, str]] = {}  # download token -> (folder, expires, tinker path)

    # ---- sessions ---------------------------------------------------------------------------

    def create_session(self) -> str:
        sid = f"sess-{secrets.token_hex(6)}"
        now = time.monotonic()
        with self.lock:
            self.sessions[sid] = Session(sid, now, now)
        self.log(f"session {sid} started")
        return sid

    def session(self, sid: str, touch: bool = True) -> Session:
        """A live session; `touch`: the call is its client's own (one naming its session_id), which
        keeps it alive as a heartbeat does. A call naming only a model or sampler does not: anyone
        with the key may ask about those, and a dead client's session must expire all the same."""
        with self.lock:
            session = self.sessions.get(sid)
            if session is None or session.finished:
                raise UserError(f"session_id={sid!r}: no such live session here (finished, expired or never "
                                "made); create a new ServiceClient", status=404)
            if touch:
                session.last_seen = time.monotonic()
            return session

    def heartbeat(self, sid: str) -> None:
        with self.lock:
            session = self.sessions.get(sid)
            if session is None or session.finished:
                raise UserError(f"session {sid!r} is over", status=410)  # the SDK stops heartbeating on 410
            session.last_seen = time.monotonic()

    def stale_sessions(self, timeout_s: float) -> list[str]:
        """The live sessions without a heartbeat for `timeout_s`."""
        now = time.monotonic()
        with self.lock:
            return [s.id for s in self.sessions.values() if not s.finished and now - s.last_seen > timeout_s]

    def add_sampler(self, sid: str, seq: int, adapter: str | None, model_path: str | None) -> str:
        sampler_id = f"{sid}:sample:{seq}"
        with self.lock:
            self.samplers[sampler_id] = Sampler(sampler_id, sid, adapter, model_path)
            self.sessions[sid].samplers.append(sampler_id)
        return sampler_id

    # ---- ids ----------------------------------------------------------------------------------

    def model(self, model_id: str, sid: str | None = None) -> TrainingModel:
        with self.lock:
            model = self.models.get(model_id)
        if model is None or (sid is not None and model.session != sid):
            raise UserError(f"model_id={model_id!r}: no such training model in this session", status=404)
        self.session(model.session, touch=False)
        return model

    def sampler(self, sampler_id: str) -> Sampler:
        with self.lock:
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

    def write_run(self, model: TrainingModel) -> None:
        """`RUN_META` in the model's folder: what a listing (and a resumed service) tells of it."""
        from dataclasses import asdict

        folder = self.run_folder(model.id)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, RUN_META), "w") as f:
            json.dump({"training_run_id": model.id, "base_model": self.model_name, "lora_rank": model.rank,
                       "created": time.time(), "spec": asdict(model.spec)}, f)

    def runs_on_disk(self) -> dict[str, dict[str, Any]]:
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

        with self.lock:
            live = self.models.get(model_id)
        if meta is None:
            meta = self.runs_on_disk().get(model_id)
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
        runs = self.runs_on_disk()
        with self.lock:
            for model_id in self.models:
                runs.setdefault(model_id, {})
        out = [self.training_run(model_id, meta) for model_id, meta in runs.items()]
        return sorted(out, key=lambda r: r["last_request_time"], reverse=True)

    def archive_token(self, tinker_path: str, valid_s: float = 900.0) -> tuple[str, float]:
        """A one-off download name for the folder of a checkpoint, valid `valid_s` seconds (the
        archive's URL, fetched without the API key as a signed URL is)."""
        folder, _ = self.resolve(tinker_path)
        token, expires = secrets.token_urlsafe(24), time.time() + valid_s
        with self.lock:
            now = time.time()
            self._archives = {k: v for k, v in self._archives.items() if v[1] > now}
            self._archives[token] = (folder, expires, tinker_path)
        return token, expires

    def archive(self, token: str) -> tuple[str, str]:
        """(the folder, its tinker:// path) an archive token names (404: unknown or expired)."""
        with self.lock:
            found = self._archives.get(token)
        if found is None or found[1] < time.time() or not os.path.isdir(found[0]):
            raise UserError("no such archive (its URL expired or was never made): ask for it again", status=404)
        return found[0], found[2]
