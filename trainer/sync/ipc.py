"""Weight sync by CUDA IPC (`trainer.weight_sync=ipc`, with `cluster.placement_mode=hybrid`).

A learner rank and a rollout engine share each GPU, so the new weights need not cross a network
or even leave the device: through vLLM's own `ipc` weight-transfer engine every learner rank
copies its weights, chunk by chunk, into one staging buffer on its GPU and exports a CUDA IPC
handle of it keyed by the GPU's UUID; vLLM all-gathers the handles over the learner's default
process group, rank 0 hands the merged handles to the sync component in the driver
(`RelayClient`), which passes them to every rollout worker (`IpcSync._relay`), and each engine
opens the handle of its own GPU and loads the chunk. The learner never holds a rollout worker:
only two queues to the driver. Packed mode (one reused buffer of
`buffer_bytes`) keeps the extra memory on the shared GPU bounded and lets a ZeRO-3 gather be
freed after each chunk. CUDA only: vLLM's trainer engine reads the device's UUID when built
(tests/test_gpu.py runs it; on CPU hybrid placement syncs with `collective`, over gloo).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import ray
import torch

from rl.wire.weight_sync import IPC_BUFFER_BYTES, WeightMeta
from trainer.sync.base import Pushed, WeightSync


def buffer_bytes(metas: list[WeightMeta]) -> int:
    return max([IPC_BUFFER_BYTES, *(m.nbytes for m in metas)])


def learner_weights(export):
    """The learner's weights as vLLM's `WeightSource`: the names, dtypes and shapes it will send,
    and a fresh pass over (name, whole tensor) per sync (ZeRO-3 gathers a bucket at a time, on
    every rank in step)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    metas = export.metas()

    class LearnerWeights(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, m.torch_dtype, tuple(m.shape)) for m in metas]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in export.buckets():
                yield from bucket

    return LearnerWeights()


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
    """The learner side, in every learner rank: vLLM's trainer-side IPC engine (rank 0, the
    sender, talks to the engines through the driver's relay and tells them the wire format when
    built)."""

    def __init__(self) -> None:
        self.engine = None

    def bind(self, export, rank: int, device) -> None:
        self.export, self.rank = export, rank

    def connect(self, relay: tuple[Any, Any] | None, timeout_s: float) -> None:
        """Build the trainer-side engine; `relay` (rank 0 only): the (outbox, inbox) queues."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        self.close()
        info = IPCTrainerInitInfo(rank=self.rank, packed=True, packed_buffer_size_bytes=buffer_bytes(self.export.metas()))
        client = RelayClient(*relay, timeout_s) if relay is not None else None
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=learner_weights(self.export))

    def send(self, version: int) -> float:
        """Share the weights with the engine on this GPU as policy `version`; the bytes one engine loaded."""
        self.engine.client.version = version
        self.engine.send_weights()
        return self.export.nbytes()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class IpcSync(WeightSync):
    sender = IpcSender

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._queues: tuple[Any, Any] | None = None

    def _relay(self, refs: list, kind: str) -> tuple[list, dict[int, str]]:
        """Wait for the learner calls `refs`, delivering meanwhile every message rank 0's client
        sends to every rollout worker (its `weight_transfer`, with the deadline of `kind`) and
        answering it. A worker that dies or hangs is killed and named in the answer (the
        learner's call then raises); returns the calls' results (None where one raised) and the
        workers that failed."""
        from ray.util.queue import Empty

        outbox, inbox = self._queues
        deadline, failed = self.deadlines.of(kind), {}
        end = time.monotonic() + deadline  # past it, a learner rank that never answers is named below
        while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs) and time.monotonic() < end:
            try:
                method, payload, version = outbox.get(timeout=0.1)
            except Empty:
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
        from ray.util.queue import Queue

        if self._queues is None:
            self._queues = (Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0}))
        timeout = self.deadlines.of("weight sync")
        refs = [w.sender_call.remote("connect", self._queues if r == 0 else None, timeout)
                for r, w in enumerate(self.learner.handles)]
        done, failed = self._relay(refs, "weight-sync join")
        if None in done and not failed:
            ray.get(refs[done.index(None)])  # not a rollout worker's fault: raise the learner's error
        return failed

    def push(self, version: int, full: bool = False) -> Pushed:
        sends = [w.sender_call.remote("send", version) for w in self.learner.handles]
        sent, failed = self._relay(sends, "weight sync")
        # what each worker holds now (and whether it is still there)
        out = self.rollout.gather({i: w.version.remote() for i, w in enumerate(self.rollout.handles)
                                   if i not in failed}, "weight sync", propagate_raised=True)
        failed.update(out.failed)
        if sent[0] is None and not failed:
            ray.get(sends[0])  # not a rollout worker's fault: raise the learner's error
        return Pushed(sent[0] or 0.0, {i: {"version": v} for i, v in out.results.items()}, failed)

    def close(self) -> None:
        for queue in self._queues or ():
            queue.shutdown(force=True)
        self._queues = None
