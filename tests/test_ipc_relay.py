"""The CUDA IPC sync's relay (rl/wire/ipc.py), on CPU with real Ray actors: learner rank 0's
client (`RelayClient`, what vLLM's trainer-side IPC engine calls) reaches the rollout workers only
through the driver's sync component (two queues; the learner holds no rollout handle), every call
in order with its payload; a worker that hangs mid-transfer is killed and reported, and the
learner's call fails instead of waiting. The IPC engine itself needs CUDA (tests/test_gpu.py)."""

from __future__ import annotations

import sys
import time

import pytest

from rl.actors.group import ActorGroup
from rl.actors.faults import Deadlines
from rl.wire.base import SendOrder
from rl.wire.ipc import IpcLink, IpcRuntime, IpcSync, RelayClient

pytestmark = pytest.mark.slow  # over a second: real actors


class FakeTrainerSide:
    """What vLLM's `IPCTrainerWeightTransferEngine` does with its client, in a learner rank: the
    wire format at build (`sync_join`), then start, one update per chunk, finish (`sync_send`): the
    learner actor's methods the sync calls (`rl.wire.base.SenderHost`)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.client = rank, None

    def where(self) -> dict:
        return {"pid": 0, "rank": self.rank}

    def sync_join(self, link: IpcLink) -> None:
        self.client = RelayClient(*link.queues, link.timeout_s) if link.queues is not None else None
        if self.client is not None:
            self.client.init_weight_transfer_engine({"packed": True})

    def sync_send(self, order: SendOrder) -> float:
        if self.client is None:  # not the sender
            return 0.0
        self.client.version = order.version
        self.client.start_weight_update()
        for chunk in range(2):
            self.client.update_weights({"names": [f"chunk{chunk}"], "ipc_handles": {"gpu": ("handle", chunk)}})
        self.client.finish_weight_update()
        return 48.0

    def holds(self, name: str) -> bool:
        return hasattr(self, name)


class FakeEngine:
    """A rollout worker's `weight_transfer` and `version`; `hang_at` makes it stop answering."""

    def __init__(self, hang_at: str | None = None) -> None:
        self.calls, self.held, self.hang_at = [], 0, hang_at

    def where(self) -> dict:
        return {"pid": 0}

    def weight_transfer(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        if method == self.hang_at:
            time.sleep(3600)
        self.calls.append((method, payload, version))
        if method == "finish_weight_update":
            self.held = version

    def version(self) -> int:
        return self.held

    def log(self) -> list:
        return self.calls


def _sync(hang_at: str | None = None):
    import ray
    from ray import cloudpickle
    from ray.util.queue import Queue

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' classes live in this test file

    deadlines = Deadlines(floor_s=3.0, factor=10.0, start_s=120.0)
    learner = ActorGroup(ray, FakeTrainerSide, 2, role="learner rank", args=lambda r: (r,), options={"num_cpus": 0},
                         deadlines=deadlines)
    rollout = ActorGroup(ray, FakeEngine, 2, role="rollout worker", options={"num_cpus": 0}, deadlines=deadlines,
                         args=lambda i: (hang_at if i == 1 else None,))
    learner.started()
    rollout.started()
    deadlines.start_s = 8.0  # started: a first call of a kind (a join, a sync) now waits 8 s at most
    sync = IpcSync(learner, [], rollout, 1, deadlines, runtime=IpcRuntime(ray, Queue))  # no vLLM engine: the fakes
    sync._senders_placed = True
    return ray, learner, rollout, sync


def test_every_call_of_the_trainer_engine_reaches_every_worker_through_the_driver(ray_local):
    ray, learner, rollout, sync = _sync()
    try:
        assert sync.join() == {}
        pushed = sync.push(7)
        assert pushed.sent == 48.0 and pushed.failed == {} and pushed.reports == {0: {"version": 7}, 1: {"version": 7}}
        for handle in rollout.handles:
            calls = ray.get(handle.log.remote())
            assert [c[0] for c in calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                            "update_weights", "finish_weight_update"]
            assert calls[0][1] == {"init_info": {"packed": True}}
            assert [c[1]["update_info"]["ipc_handles"]["gpu"] for c in calls[2:4]] == [("handle", 0), ("handle", 1)]
            assert calls[-1][2] == 7
        # rank 0's client holds two queues and nothing of the rollout side
        client_state = ray.get(learner.handles[0].__ray_call__.remote(lambda self: vars(self.client)))
        assert set(client_state) == {"outbox", "inbox", "timeout_s", "version"}
    finally:
        sync.close()
        learner.shutdown()
        rollout.shutdown()


def test_a_worker_that_hangs_mid_transfer_is_killed_and_reported_and_the_learner_does_not_wait(ray_local):
    """(Before the relay, learner rank 0 held the workers and waited on them itself.)"""
    ray, learner, rollout, sync = _sync(hang_at="update_weights")
    try:
        assert sync.join() == {}
        started = time.monotonic()
        pushed = sync.push(3)
        assert time.monotonic() - started < 30  # the deadline of a first sync (8 s), not the hour it sleeps
        assert list(pushed.failed) == [1] and "no answer in" in pushed.failed[1]
        # the learner's send ended on the answer naming the worker (nothing counted as sent), so the
        # round was cut before `finish`: the healthy worker still holds version 0 until the
        # Cluster has replaced the lost one and synced again
        assert pushed.sent == 0.0 and pushed.reports == {0: {"version": 0}}
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(rollout.handles[1].version.remote(), timeout=30)  # killed
    finally:
        sync.close()
        learner.shutdown()
        rollout.shutdown()
