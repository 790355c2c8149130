"""The CUDA IPC transport (`trainer.weight_sync=ipc`, with `cluster.placement_mode=hybrid`), all
three sides.

A learner rank and a rollout engine share each GPU, so the new weights need not cross a network
or even leave the device: through vLLM's own `ipc` weight-transfer engine every learner rank
copies its weights, chunk by chunk, into one staging buffer on its GPU and exports a CUDA IPC
handle of it keyed by the GPU's UUID; vLLM all-gathers the handles over the learner's default
process group, rank 0 hands the merged handles to the driver (`RelayClient`), which passes them to
every rollout worker (`IpcSync._relay`), and each engine opens the handle of its own GPU and loads
the chunk (`IpcReceiver`). The learner never holds a rollout worker: only two queues to the
driver. Packed mode (one reused buffer of `buffer_bytes`) keeps the extra memory on the shared
GPU bounded and lets a ZeRO-3 gather be freed after each chunk. CUDA only: vLLM's trainer engine
reads the device's UUID when built (tests/test_gpu.py runs it; on CPU hybrid placement syncs with
`collective`, over gloo).

- the learner's side: `IpcSender` (vLLM's trainer-side engine, built by the `engine` of the
  `IpcRuntime` it is given: trainer/vllm_ipc.py) and `RelayClient`, the client it talks through;
- the rollout side: `IpcReceiver`, each call of vLLM's weight-transfer API on the engine
  (rollout/vllm_engine.py holds one);
- the driver's side: `IpcSync`, which relays.

No Ray or vLLM is imported here (tests/test_layers.py): they come in an `IpcRuntime`.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Callable

from rl.wire.base import Exported, Pushed, SendOrder, WeightSync
from rl.wire.format import WeightMeta

# The staging buffer each learner rank copies a chunk of weights into. vLLM's default is 1 GiB; on
# a GPU shared with an engine a quarter does (a tensor larger than this gets a buffer of its own
# size: a chunk holds at least one tensor).
IPC_BUFFER_BYTES = 256 * 2**20

# vLLM's weight-transfer calls, in the order of a round (the first once, when the engine is built)
IPC_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def buffer_bytes(metas: list[WeightMeta]) -> int:
    return max([IPC_BUFFER_BYTES, *(m.nbytes for m in metas)])


@dataclass(frozen=True)
class IpcRuntime:
    """What this transport takes from outside `rl` (trainer/vllm_ipc.py makes it): `ray` (the
    module: `wait`, `get`), `queue` (`ray.util.queue.Queue`: the relay's two mailboxes) and
    `engine`, which builds vLLM's trainer-side IPC engine in a learner rank as
    `engine(rank, buffer_bytes, client, export)` (None: a test's learner builds none)."""

    ray: Any
    queue: Callable[..., Any]
    engine: Callable[[int, int, Any, Exported], Any] | None = None


@dataclass(frozen=True)
class IpcLink:
    """What every learner rank's sender joins with: the relay's (outbox, inbox) queues (rank 0,
    the sender; None elsewhere) and how long each of its waits may take."""

    queues: tuple[Any, Any] | None
    timeout_s: float


# ---- the learner's side --------------------------------------------------------------------------

class RelayClient:
    """vLLM's trainer-side client protocol (`VLLMWeightSyncClient`), relayed by the driver: each
    call goes out on `outbox` (a Ray queue the sync made) and returns once the driver's sync has
    delivered it to every rollout worker and answered on `inbox` (None, or the error that a
    worker's load raised, raised here). Every wait is bounded by `timeout_s`. Only learner rank 0,
    the sender, has one; `version` is the policy version being sent."""

    def __init__(self, outbox: Any, inbox: Any, timeout_s: float):
        self.outbox, self.inbox, self.timeout_s, self.version = outbox, inbox, timeout_s, 0

    def _call(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        self.outbox.put((method, payload, version), timeout=self.timeout_s)
        error = self.inbox.get(timeout=self.timeout_s)
        if error is not None:
            raise RuntimeError(f"weight transfer {method}: {error}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", None, self.version)


class IpcSender:
    """The learner side, in every learner rank: vLLM's trainer-side IPC engine, built at `join` by
    `engine` (`IpcRuntime.engine`); rank 0, the sender, talks to the engines through the driver's
    relay and tells them the wire format when built. A `WeightSender[IpcLink, float]`."""

    def __init__(self, engine: Callable[[int, int, Any, Exported], Any]) -> None:
        self.build, self.engine = engine, None

    def bind(self, export: Exported, rank: int, device: Any) -> None:
        self.export, self.rank = export, rank

    def join(self, link: IpcLink) -> None:
        """Build the trainer-side engine (the one before is shut down first)."""
        self.close()
        client = RelayClient(*link.queues, link.timeout_s) if link.queues is not None else None
        self.engine = self.build(self.rank, buffer_bytes(self.export.metas()), client, self.export)

    def send(self, order: SendOrder) -> float:
        """Share the weights with the engine on this GPU as policy `order.version`; the bytes one
        engine loaded."""
        self.engine.client.version = order.version
        self.engine.send_weights()
        return self.export.nbytes()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


# ---- the rollout side ----------------------------------------------------------------------------

class IpcReceiver:
    """A rollout engine's end: vLLM's own weight-transfer engine does the loading; this passes it
    each call the learner's client sent (`IPC_CALLS`) and keeps whether a round is open. A round
    cut short (a peer failed mid-sync) is finished before the next starts (vLLM refuses a new one
    until then; that round resends every weight); a round vLLM ended itself (a chunk failed to
    load) is not finished twice."""

    def __init__(self) -> None:
        self.open = False  # a round started and not finished

    def call(self, llm: Any, method: str, payload: dict | None = None) -> bool:
        """One call on `llm` (vLLM's `LLM`); True when it finished a round (the weights loaded)."""
        if method not in IPC_CALLS:
            raise ValueError(f"weight transfer {method!r}: not one of {', '.join(IPC_CALLS)}")
        if method == "start_weight_update" and self.open:
            llm.finish_weight_update()
        call = getattr(llm, method)
        try:
            call(payload) if payload is not None else call()
        except BaseException:
            if method == "update_weights":  # vLLM ends the round itself when a chunk fails to load
                self.open = False
            raise
        if method in ("start_weight_update", "finish_weight_update"):
            self.open = method == "start_weight_update"
        return method == "finish_weight_update"


# ---- the driver's side ---------------------------------------------------------------------------

class IpcSync(WeightSync):
    """`runtime`: Ray and the engine builder (`IpcRuntime`)."""

    def __init__(self, learner, metas, rollout, ranks_per_engine=1, deadlines=None, *, runtime: IpcRuntime):
        super().__init__(learner, metas, rollout, ranks_per_engine, deadlines)
        self.runtime = runtime
        self._queues: tuple[Any, Any] | None = None

    def make_sender(self) -> IpcSender:
        return IpcSender(self.runtime.engine)

    def _relay(self, refs: list, kind: str) -> tuple[list, dict[int, str]]:
        """Wait for the learner calls `refs`, delivering meanwhile every message rank 0's client
        sends to every rollout worker (its `weight_transfer`, with the deadline of `kind`) and
        answering it. A worker that dies or hangs is killed and named in the answer (the
        learner's call then raises); returns the calls' results (None where one raised) and the
        workers that failed."""
        ray = self.runtime.ray
        outbox, inbox = self._queues
        deadline, failed = self.deadlines.of(kind), {}
        end = time.monotonic() + deadline  # past it, a learner rank that never answers is named below
        while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs) and time.monotonic() < end:
            try:
                method, payload, version = outbox.get(timeout=0.1)
            except queue.Empty:  # (Ray's queue raises its subclass)
                continue
            out = self.rollout.gather({i: w.weight_transfer.remote(method, payload, version)
                                       for i, w in enumerate(self.rollout.handles) if i not in failed}, kind, deadline)
            for i in out.failed:
                self.rollout.kill(i)
            failed.update(out.failed)
            errors = {**out.failed, **out.raised}
            inbox.put(None if not errors else "; ".join(f"{self.rollout.name(i)}: {why}" for i, why in errors.items()),
                      timeout=deadline)
        return self.on_learner(refs, kind, tolerate_errors=True), failed

    def _join(self) -> dict[int, str]:
        """Every rank builds vLLM's trainer-side IPC engine; rank 0 gets the relay's queues (the
        engine tells every worker the wire format through it)."""
        if self._queues is None:
            make = self.runtime.queue
            self._queues = (make(actor_options={"num_cpus": 0}), make(actor_options={"num_cpus": 0}))
        timeout = self.deadlines.of("weight sync")
        refs = [w.sync_join.remote(IpcLink(self._queues if r == 0 else None, timeout))
                for r, w in enumerate(self.learner.handles)]
        done, failed = self._relay(refs, "weight-sync join")
        if None in done and not failed:
            self.runtime.ray.get(refs[done.index(None)])  # not a rollout worker's fault: raise the learner's error
        return failed

    def push(self, version: int, full: bool = False) -> Pushed:
        sends = [w.sync_send.remote(SendOrder(version)) for w in self.learner.handles]
        sent, failed = self._relay(sends, "weight sync")
        # what each worker holds now (and whether it is still there)
        out = self.rollout.gather({i: w.version.remote() for i, w in enumerate(self.rollout.handles)
                                   if i not in failed}, "weight sync", propagate_raised=True)
        failed.update(out.failed)
        if sent[0] is None and not failed:
            self.runtime.ray.get(sends[0])  # not a rollout worker's fault: raise the learner's error
        return Pushed(sent[0] or 0.0, {i: {"version": v} for i, v in out.results.items()}, failed)

    def close(self) -> None:
        for mailbox in self._queues or ():
            mailbox.shutdown(force=True)
        self._queues = None
