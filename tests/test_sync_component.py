"""The weight sync as one component (trainer/sync/): each strategy joins, pushes, verifies what
every worker holds, and rejoins after the fleet replaced a worker; the learner only exports
tensors and the fleet only calls `after_replace`.

Fast: the `sync` loop and `verify` with a strategy whose push is scripted. Slow: the collective
(gloo) and object-store strategies between a real DeepSpeed learner and a real rollout fleet
(transformers engine), a worker killed and replaced in between. The IPC strategy needs CUDA
(tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from rl.run.faults import ActorFailure
from rl.wire.weight_sync import WeightMeta
from trainer.sync.base import WeightSync


class _Fleet:
    def __init__(self, n: int = 2) -> None:
        self.workers, self.where, self.version = list(range(n)), [{}] * n, 0
        self.after_replace, self.replaced = None, []

    def name(self, i: int) -> str:
        return f"rollout worker {i}"

    def replace(self, failed, phase) -> None:
        self.replaced.append((dict(failed), phase))


class _Learner:
    metas = [WeightMeta("w", (2, 3), "float32")]  # 24 bytes


class _Scripted(WeightSync):
    """A strategy whose pushes return what the test scripted, in turn."""

    def __init__(self, pushes, **kw) -> None:
        super().__init__(_Learner(), _Fleet(**kw))
        self.pushes, self.joins = list(pushes), 0

    def _join(self) -> None:
        self.joins += 1

    def push(self, version, full=False):
        self.fulls = getattr(self, "fulls", []) + [full]
        return self.pushes.pop(0)


def _ok(version: int, n: int = 2, nbytes: float = 24.0):
    return 24.0, {i: {"version": version, "bytes": nbytes} for i in range(n)}, {}, {}


def test_a_clean_push_is_verified_and_sets_the_fleets_version() -> None:
    sync = _Scripted([_ok(3)])
    assert sync.bytes_per_sync == 24.0
    assert sync.sync(3) == 24.0 and sync.fleet.version == 3 and sync.joins == 0


def _refused(version: int, worker: int = 1):
    """A delta push that worker `worker`'s checksum refused (its copy of the weights went wrong)."""
    sent, reports, failed, broken = _ok(version, nbytes=8.0)
    reports[worker]["delta_mismatch"] = 1.0
    return 8.0, reports, failed, broken


def test_a_delta_a_worker_refused_is_followed_by_the_whole_weights_once() -> None:
    sync = _Scripted([_refused(3), _ok(3)])
    assert sync.sync(3) == 24.0 and sync.fulls == [False, True] and sync.delta_fallbacks == 1
    assert sync.fleet.version == 3
    again = _Scripted([_refused(3), _refused(3)])  # refused after a whole sync too: that worker is broken
    with pytest.raises(ActorFailure, match="rollout worker 1.*checksum even after a whole sync"):
        again.sync(3)


def test_a_failed_worker_is_replaced_the_transport_joined_again_and_the_push_redone() -> None:
    sync = _Scripted([(0.0, {1: {"version": 1}}, {0: "its process died"}, {}), _ok(1)])
    assert sync.sync(1) == 24.0
    assert sync.fleet.replaced == [({0: "its process died"}, "weight sync")] and sync.joins == 1
    assert sync.fleet.version == 1


def test_a_receive_that_raises_twice_names_the_worker() -> None:
    broken = (0.0, {}, {}, {1: "RuntimeError: bad bucket"})
    sync = _Scripted([broken, broken])
    with pytest.raises(ActorFailure, match=r"rollout worker 1 failed during weight sync: its receive failed twice "
                                           r"\(RuntimeError: bad bucket\)"):
        sync.sync(1)
    assert sync.fleet.version == 0  # not claimed


@pytest.mark.parametrize("report, message", [
    ({"version": 4}, r"rollout worker 1 .* holds policy version 4 after loading version 5"),
    ({"version": 5, "bytes": 12.0}, r"rollout worker 1 .* took 12 bytes of the 24 sent"),
    ({"version": 5, "bytes": 24.0, "ranks": 2}, r"took 24 bytes of the 48 sent"),  # each TP rank takes all
])
def test_verify_refuses_a_worker_that_does_not_hold_what_was_sent(report, message) -> None:
    sync = _Scripted([(24.0, {0: {"version": 5, "bytes": 24.0}, 1: report}, {}, {})])
    with pytest.raises(ActorFailure, match=message):
        sync.sync(5)
    assert sync.fleet.version == 0


def test_join_hands_the_fleet_its_rejoin_and_rejoin_pushes_the_current_version() -> None:
    sync = _Scripted([_ok(7)])
    sync.learner.call = lambda refs, kind: []  # no ranks to attach a sender to
    sync.learner.workers = []
    sync.join()
    assert sync.fleet.after_replace == sync.rejoin and sync.joins == 1
    sync.fleet.version = 7
    sync.fleet.after_replace()  # what the fleet does once it replaced a worker
    assert sync.joins == 2 and sync.pushes == []
    sync.close()
    assert sync.fleet.after_replace is None


# ---- real actors -----------------------------------------------------------------------------

def _rollout_weights(worker) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(worker.__ray_call__.remote(
        lambda self: {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}))


def _learner_weights(group) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(group.workers[0].__ray_call__.remote(lambda self: self.weights.state_dict()))


def _delta_syncs(sync, learner, fleet, version: int):
    """Delta syncs between a real learner and fleet: one changed value travels as its position and
    value; a worker whose copy went wrong is caught by its checksum and sent the whole weights."""
    import ray

    meta = learner.metas[0]
    one = 4 + torch.empty((), dtype=meta.torch_dtype).element_size()  # an int32 position and a value
    ray.get(learner.workers[0].__ray_call__.remote(lambda self: self.weights.named[0][1].data.view(-1)[0].add_(1.0)))
    want = _learner_weights(learner)
    assert sync.sync(version + 1) == one and sync.delta_fallbacks == 0
    ray.get(fleet.workers[0].__ray_call__.remote(lambda self: self._delta.kept[-1].view(-1)[-1].add_(1.0)))
    assert sync.sync(version + 2) == pytest.approx(sync.bytes_per_sync) and sync.delta_fallbacks == 1
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
    from trainer.sync import make_weight_sync

    cfg = OmegaConf.to_object(make_config("rollout.backend=hf", "rollout.num_workers=2", "trainer.num_workers=1",
                                          "rollout.max_restarts=3"))
    fleet = RolloutFleet(RolloutSpec.from_config(cfg, 1), num_cpus=0.5, log=lambda line: None)
    learner = LearnerGroup(LearnerSpec.from_config(cfg, 1), 1, num_cpus=0.5)
    try:
        # the learner's weights differ from model.path's: the engines start from the latter
        ray.get(learner.workers[0].__ray_call__.remote(
            lambda self: [p.data.add_(0.01) for _, p in self.weights.named]))
        want = _learner_weights(learner)
        version = 0
        for method in ("collective", "delta", "object_store"):
            sync = make_weight_sync("collective" if method == "delta" else method, learner, fleet,
                                    delta_max_fraction=0.5 if method == "delta" else None)
            version += 1
            assert sync.sync(version) == pytest.approx(sync.bytes_per_sync)  # delta: the first after a join is whole
            assert fleet.version == version and ray.get([w.version.remote() for w in fleet.workers]) == [version] * 2
            for w in fleet.workers:
                got = _rollout_weights(w)
                assert all(torch.equal(got[n], t) for n, t in want.items()), method
            if method == "delta":
                version, want = _delta_syncs(sync, learner, fleet, version)
            # a worker lost: the fleet replaces it and the sync brings the new one up to date
            old = fleet.workers[1]
            ray.kill(old, no_restart=True)
            fleet._fail(1, old, "killed by the test", "generate")
            fleet.repair()
            assert fleet.workers[1] is not old and ray.get(fleet.workers[1].version.remote()) == version
            got = _rollout_weights(fleet.workers[1])
            assert all(torch.equal(got[n], t) for n, t in want.items()), method
            sync.close()
        assert fleet.restarts == 3
    finally:
        learner.shutdown()
        fleet.shutdown()
