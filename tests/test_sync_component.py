"""The weight sync as one component (rl/wire/: base.py, one module per transport) and the `Cluster` that owns it
(launch/cluster.py): each strategy joins, pushes and verifies what every worker holds, and
reports the workers it lost; the Cluster replaces them (a training run's one caller of the fleet's repair),
joins again and syncs the current version. The learner only exports tensors, the fleet only
replaces workers and is told when they are up to date: no callbacks between them.

Fast: the `sync` loop, `verify` and the Cluster's repairs with a strategy whose push is scripted.
Slow: the collective (gloo) and object-store strategies between a real DeepSpeed learner and a real
rollout fleet (transformers engine), a worker killed and replaced in between. The IPC strategy
needs CUDA (tests/test_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from launch.cluster import Cluster
from rl.actors.faults import ActorFailure
from rl.wire.base import Pushed, WeightSync
from rl.wire.format import WeightMeta


class _Port:
    def __init__(self, n: int = 2) -> None:
        self.handles, self.where = list(range(n)), [{}] * n

    def name(self, i: int) -> str:
        return f"rollout worker {i}"


class _Fleet:
    """What the Cluster asks of the fleet: replace workers, repair the broken ones, hear that all are synced."""

    def __init__(self) -> None:
        self.replaced, self.synced_calls, self.broken = [], 0, []

    def replace(self, failed, phase) -> None:
        self.replaced.append((dict(failed), phase))

    def repair(self) -> list[int]:
        broken, self.broken = self.broken, []
        return broken

    def synced(self) -> None:
        self.synced_calls += 1


METAS = [WeightMeta("w", (2, 3), "float32")]  # 24 bytes


class _Scripted(WeightSync):
    """A strategy whose joins and pushes return what the test scripted, in turn."""

    def __init__(self, pushes, joins=None, **kw) -> None:
        super().__init__(_Port(), METAS, _Port(**kw))
        self._senders_placed = True  # no learner ranks to place a sender in
        self.pushes, self.join_results, self.joins = list(pushes), list(joins or []), 0

    def _join(self):
        self.joins += 1
        return self.join_results.pop(0) if self.join_results else {}

    def push(self, version, full=False):
        self.fulls = getattr(self, "fulls", []) + [full]
        return self.pushes.pop(0)


def _cluster(sync: _Scripted) -> Cluster:
    return Cluster(_Fleet(), None, sync)


def _ok(version: int, n: int = 2, nbytes: float = 24.0) -> Pushed:
    return Pushed(24.0, {i: {"version": version, "bytes": nbytes} for i in range(n)})


def test_a_clean_push_is_verified_and_the_fleet_told_it_is_synced() -> None:
    sync = _Scripted([_ok(3)])
    cluster = _cluster(sync)
    assert sync.bytes_per_sync == cluster.bytes_per_sync == 24.0
    assert cluster.sync(3) == 24.0 and cluster.version == 3 and sync.joins == 0 and cluster.fleet.synced_calls == 1


def _refused(version: int, worker: int = 1) -> Pushed:
    """A delta push that worker `worker`'s checksum refused (its copy of the weights went wrong)."""
    pushed = _ok(version, nbytes=8.0)
    pushed.sent = 8.0
    pushed.reports[worker]["delta_mismatch"] = 1.0
    return pushed


def test_a_delta_a_worker_refused_is_followed_by_the_whole_weights_once() -> None:
    sync = _Scripted([_refused(3), _ok(3)])
    assert sync.sync(3).sent == 24.0 and sync.fulls == [False, True] and sync.delta_fallbacks == 1
    again = _Scripted([_refused(3), _refused(3)])  # refused after a whole sync too: that worker is broken
    with pytest.raises(ActorFailure, match="rollout worker 1.*checksum even after a whole sync"):
        again.sync(3)


def test_the_sync_reports_a_failed_worker_and_the_cluster_replaces_it_joins_again_and_redoes_the_push() -> None:
    lost = Pushed(0.0, {1: {"version": 1}}, {0: "its process died"})
    sync = _Scripted([lost])
    assert sync.sync(1).failed == {0: "its process died"} and sync.joins == 0  # reported, not replaced
    sync = _Scripted([lost, _ok(1)])
    cluster = _cluster(sync)
    assert cluster.sync(1) == 24.0 and cluster.version == 1
    assert cluster.fleet.replaced == [({0: "its process died"}, "weight sync")] and sync.joins == 1


def test_a_worker_lost_while_joining_is_replaced_and_the_join_redone() -> None:
    sync = _Scripted([], joins=[{1: "no answer in 5 s"}, {}])
    cluster = _cluster(sync)
    cluster.join()
    assert cluster.fleet.replaced == [({1: "no answer in 5 s"}, "weight-sync join")] and sync.joins == 2


def test_a_receive_that_raises_twice_names_the_worker() -> None:
    raised = Pushed(0.0, {}, {}, raised={1: "RuntimeError: bad bucket"})
    sync = _Scripted([raised, raised])
    cluster = _cluster(sync)
    with pytest.raises(ActorFailure, match=r"rollout worker 1 failed during weight sync: its receive failed twice "
                                           r"\(RuntimeError: bad bucket\)"):
        cluster.sync(1)
    assert cluster.version == 0 and cluster.fleet.synced_calls == 0  # not claimed


@pytest.mark.parametrize("report, message", [
    ({"version": 4}, r"rollout worker 1 .* holds policy version 4 after loading version 5"),
    ({"version": 5, "bytes": 12.0}, r"rollout worker 1 .* took 12 bytes of the 24 sent"),
    ({"version": 5, "bytes": 24.0, "ranks": 2}, r"took 24 bytes of the 48 sent"),  # each TP rank takes all
])
def test_verify_refuses_a_worker_that_does_not_hold_what_was_sent(report, message) -> None:
    cluster = _cluster(_Scripted([Pushed(24.0, {0: {"version": 5, "bytes": 24.0}, 1: report})]))
    with pytest.raises(ActorFailure, match=message):
        cluster.sync(5)
    assert cluster.version == 0 and cluster.fleet.synced_calls == 0


def test_a_repair_joins_the_replaced_workers_and_brings_them_to_the_current_version() -> None:
    sync = _Scripted([_ok(4), _ok(4)])
    cluster = _cluster(sync)
    cluster.sync(4)
    cluster.repair()  # nothing broken: nothing joined or pushed
    assert sync.joins == 0 and len(sync.pushes) == 1
    cluster.fleet.broken = [1]
    elsewhere = threading.Thread(target=cluster.repair)  # a thread that is not the driver's: no repair
    elsewhere.start()
    elsewhere.join()
    assert cluster.fleet.broken == [1] and sync.joins == 0
    cluster.repair()
    assert cluster.fleet.broken == [] and sync.joins == 1 and sync.pushes == [] and cluster.fleet.synced_calls == 2
    assert cluster.version == 4


def test_no_component_calls_another_back() -> None:
    """The fleet holds no hook and no version setter; the sync reaches workers only through its ports."""
    import inspect

    from rollout.fleet import RolloutFleet
    from rl.wire import base, collective, ipc, object_store

    assert not hasattr(RolloutFleet, "after_replace") and not hasattr(RolloutFleet, "version")
    for module in (base, collective, ipc, object_store):
        source = inspect.getsource(module)
        for reach in ("fleet.", ".replace(", "after_replace", ".spec."):
            assert reach not in source, (module.__name__, reach)


# ---- real actors -----------------------------------------------------------------------------

def _rollout_weights(worker) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(worker.__ray_call__.remote(
        lambda self: {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}))


def _learner_weights(group) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(group.workers[0].__ray_call__.remote(lambda self: self.export.state_dict()))


def _delta_syncs(sync, learner, fleet, version: int):
    """Delta syncs between a real learner and fleet: one changed value travels as its position and
    value; a worker whose copy went wrong is caught by its checksum and sent the whole weights."""
    import ray

    meta = learner.metas[0]
    one = 4 + torch.empty((), dtype=meta.torch_dtype).element_size()  # an int32 position and a value
    ray.get(learner.workers[0].__ray_call__.remote(lambda self: self.export.named[0][1].data.view(-1)[0].add_(1.0)))
    want = _learner_weights(learner)
    assert sync.sync(version + 1) == one and sync.weight_sync.delta_fallbacks == 0
    ray.get(fleet.workers[0].__ray_call__.remote(lambda self: self._receiver.delta.kept[-1].view(-1)[-1].add_(1.0)))
    assert sync.sync(version + 2) == pytest.approx(sync.bytes_per_sync) and sync.weight_sync.delta_fallbacks == 1
    for w in fleet.workers:
        got = _rollout_weights(w)
        assert all(torch.equal(got[n], t) for n, t in want.items())
    return version + 2, want


@pytest.mark.slow
@pytest.mark.full  # 55 s; the default lane syncs both ways end to end (test_e2e: ZeRO-3 collective, HF object store)
def test_collective_and_object_store_sync_a_real_learner_into_a_real_fleet_across_a_replacement(
        ray_local, make_config) -> None:
    import ray
    from omegaconf import OmegaConf

    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from trainer.group import LearnerGroup
    from trainer.learner_setup import LearnerSpec
    from rl.wire.transports import make_weight_sync

    cfg = OmegaConf.to_object(make_config("rollout.backend=hf", "rollout.num_workers=2", "trainer.num_workers=1",
                                          "rollout.max_restarts=3"))
    fleet = RolloutFleet(RolloutSpec.from_config(cfg, 1), num_cpus=0.5, log=lambda line: None)
    learner = LearnerGroup(LearnerSpec.from_config(cfg, 1), 1, num_cpus=0.5)
    try:
        # the learner's weights differ from model.path's: the engines start from the latter
        ray.get(learner.workers[0].__ray_call__.remote(
            lambda self: [p.data.add_(0.01) for _, p in self.export.named]))
        want = _learner_weights(learner)
        version = 0
        for method in ("collective", "delta", "object_store"):
            sync = Cluster(fleet, learner, make_weight_sync(
                "collective" if method == "delta" else method, learner.group, learner.metas, fleet.group,
                delta_max_fraction=0.5 if method == "delta" else None))
            sync.join()
            version += 1
            assert sync.sync(version) == pytest.approx(sync.bytes_per_sync)  # delta: the first after a join is whole
            assert ray.get([w.version.remote() for w in fleet.workers]) == [version] * 2
            for w in fleet.workers:
                got = _rollout_weights(w)
                assert all(torch.equal(got[n], t) for n, t in want.items()), method
            if method == "delta":
                version, want = _delta_syncs(sync, learner, fleet, version)
            # a worker lost: the Cluster's repair replaces it and the sync brings the new one up to date
            old = fleet.workers[1]
            ray.kill(old, no_restart=True)
            fleet._fail(1, old, "killed by the test", "generate")
            sync.repair()
            assert fleet.workers[1] is not old and ray.get(fleet.workers[1].version.remote()) == version
            got = _rollout_weights(fleet.workers[1])
            assert all(torch.equal(got[n], t) for n, t in want.items()), method
        assert fleet.restarts == 3
    finally:
        learner.shutdown()
        fleet.shutdown()


def test_a_start_that_fails_part_way_ends_what_had_started(monkeypatch) -> None:
    """`Cluster.start`: the sandbox pool and the groups that started before a failure (here the
    learner's set-up raising after the fleet and learner started) are shut down before the error
    propagates; nothing is left for Ray to reap."""
    import launch.components

    ended = []

    class Part:
        def __init__(self, name):
            self.name = name

        def shutdown(self):
            ended.append(self.name)

        def close(self):
            ended.append(self.name)

    def build(config, log, started):
        started["fleet"], started["learner"] = Part("fleet"), Part("learner")
        raise RuntimeError("learner rank 0 failed during set-up")

    monkeypatch.setattr(launch.components, "start_sandbox_pool", lambda cfg: Part("sandboxes"))
    monkeypatch.setattr(launch.components, "build_components", build)
    with pytest.raises(RuntimeError, match="set-up"):
        Cluster.start(None, None, log=lambda line: None)
    assert sorted(ended) == ["fleet", "learner", "sandboxes"]
