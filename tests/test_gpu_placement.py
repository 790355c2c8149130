"""GPU placement logic, tested without a GPU: Ray schedules logical GPUs (`ray.init(num_gpus=2)`)
and sets `CUDA_VISIBLE_DEVICES` per actor as it would on a GPU node, so which actor sees which
GPU, what a role given none sees, and which device and backend each picks are checked here on
the real actor classes. What needs CUDA itself is in `pytest -m gpu` (tests/test_gpu.py)."""

from __future__ import annotations

import os

import pytest

from rl.plan.devices import GPU_VISIBILITY_ENV, NoCudaError, actor_device, collective_backend, local_device_index
from tests.conftest import own_ray
from rl.wire.collective import sync_backend


def test_device_and_backend_come_from_the_gpus_an_actor_was_given():
    assert actor_device([], cuda_available=True, role="reward") == "cpu"  # a CUDA machine, no GPU given
    assert actor_device(["3"], cuda_available=True, role="learner rank 0") == "cuda"
    with pytest.raises(NoCudaError, match=r"learner rank 1 was given GPU\(s\) \['0'\].*RLPOST_EXTRA=cuda.*"
                                          r"cluster.gpus_per_learner=0"):
        actor_device(["0"], cuda_available=False, role="learner rank 1")
    assert collective_backend("cuda") == "nccl" and collective_backend("cpu") == "gloo"
    # the learner's LOCAL_RANK: its one visible GPU, or with Ray told not to set
    # CUDA_VISIBLE_DEVICES the index of the GPU it was given among all the node's
    assert local_device_index(["3"], {"CUDA_VISIBLE_DEVICES": "3"}) == 0
    noset = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert local_device_index(["3"], noset) == 3
    assert local_device_index(["3"], {**noset, "CUDA_VISIBLE_DEVICES": "2,3"}) == 1
    assert local_device_index([], noset) == 0
    # the weight-sync group: NCCL only when learner rank 0 and every rollout worker hold a GPU
    assert sync_backend(["cuda", "cuda", "cuda"]) == "nccl"
    assert sync_backend(["cuda", "cpu"]) == "gloo" and sync_backend(["cpu", "cpu"]) == "gloo"


@pytest.fixture(scope="module")
def logical_gpus():
    """A local Ray with 2 logical GPUs and our actor environment (as launch.train starts it)."""
    import ray

    saved = os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # else Ray maps its ids through it
    own_ray(num_cpus=4, num_gpus=2, runtime_env={"env_vars": GPU_VISIBILITY_ENV})
    yield ray
    ray.shutdown()
    if saved is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _spec():
    from tests.conftest import compose_config
    from trainer.learner_setup import LearnerSpec

    return LearnerSpec.from_config(compose_config([]))


@pytest.mark.slow
def test_roles_see_only_the_gpus_they_were_given(logical_gpus):
    """Two learner-like actors with a GPU each see one different GPU; a role given none (the
    learner on CPU, a reward worker, a sandbox) sees none, instead of every GPU of the node."""
    ray = logical_gpus

    @ray.remote(num_cpus=0.5)
    class Visible:  # an actor holds its GPU while it lives (two tasks may run one after the other on GPU 0)
        def seen(self) -> tuple[str | None, list]:
            return os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_gpu_ids()

    one = [Visible.options(num_gpus=1).remote() for _ in range(2)]
    none = Visible.remote()
    seen = ray.get([a.seen.remote() for a in one])
    assert sorted(v for v, _ in seen) == ["0", "1"], seen
    assert ray.get(none.seen.remote()) == ("", [])
    for actor in (*one, none):
        ray.kill(actor)

    from trainer.learner import LearnerWorker

    cpu_rank = ray.remote(LearnerWorker).options(num_cpus=0.5, num_gpus=0).remote(_spec(), 0, 1)
    where = ray.get(cpu_rank.where.remote())
    assert where["device"] == "cpu" and where["gpus"] == [] and where["cuda_visible_devices"] == ""
    ray.kill(cpu_rank)


@pytest.mark.slow
def test_a_role_given_a_gpu_without_cuda_fails_naming_the_fix(logical_gpus):
    """On this CPU build of torch, a learner rank or rollout worker that Ray gave a GPU stops at
    once with what to install or which setting to change (not a CUDA error deep in DeepSpeed)."""
    ray = logical_gpus
    from rollout.protocol import RolloutSpec
    from rollout.worker import RolloutWorker
    from tests.conftest import compose_config
    from trainer.learner import LearnerWorker

    rank = ray.remote(LearnerWorker).options(num_cpus=0.5, num_gpus=1).remote(_spec(), 1, 2)
    with pytest.raises(ray.exceptions.RayActorError, match=r"learner rank 1 was given GPU\(s\) \['[01]'\]"):
        ray.get(rank.where.remote())
    worker = ray.remote(RolloutWorker).options(num_cpus=0.5, num_gpus=1).remote(
        RolloutSpec.from_config(compose_config([])), 0)
    with pytest.raises(ray.exceptions.RayActorError, match=r"rollout worker 0 was given GPU.*RLPOST_EXTRA=cuda"):
        ray.get(worker.where.remote())


@pytest.mark.parametrize("profile", ["ray_gpu", "local_gpu"])
def test_gpu_profiles_set_what_a_gpu_wants(profile):
    """`cluster=ray_gpu` / `cluster=local_gpu`: a GPU per role, bf16, CUDA graphs, a dedicated
    engine's memory share near vLLM's default, DeepSpeed's persistence threshold, few host threads;
    a key given on the command line still wins."""
    from tests.conftest import compose_config

    cfg = compose_config([f"cluster={profile}"])
    assert cfg.cluster.gpus_per_learner == 1 and cfg.cluster.gpus_per_rollout_worker == 1
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.enforce_eager is False
    assert cfg.rollout.gpu_memory_utilization == 0.85 and cfg.trainer.zero3_persistence_threshold == 100_000
    assert cfg.cluster.threads_per_worker == 4 and (cfg.cluster.address == "auto") == (profile == "ray_gpu")
    assert compose_config([f"cluster={profile}", "model.dtype=float32"]).model.dtype == "float32"


def _placed_gpus(ray, cfg) -> tuple[list, list, object]:
    """(CUDA_VISIBLE_DEVICES, Ray's GPU ids) of a probe actor in each rollout and learner slot of
    the run's real placement (launch.placement.make_placement), with the Ray options it gives."""
    from launch.placement import make_placement

    @ray.remote(num_cpus=1)
    class Probe:
        def gpus(self):
            return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(g) for g in ray.get_gpu_ids()]

    placement = make_placement(cfg, log=lambda _: None)
    base = {"num_gpus": cfg.cluster.gpus_per_rollout_worker}  # what RolloutFleet / LearnerGroup ask, then
    rollout = [Probe.options(**{**base, **o}).remote() for o in placement.rollout]  # the slot's options win
    learner = [Probe.options(**{**base, **o}).remote() for o in placement.learner]
    seen = ray.get([p.gpus.remote() for p in rollout]), ray.get([p.gpus.remote() for p in learner])
    for p in rollout + learner:
        ray.kill(p)
    return (*seen, placement)


@pytest.mark.slow
def test_hybrid_placement_puts_each_learner_rank_on_its_rollout_workers_gpu(logical_gpus):
    """cluster.placement_mode=hybrid: rollout worker i and learner rank i see the same one GPU
    (what CUDA IPC and the sleep/offload hand-over need), the pairs different GPUs; the
    disaggregated layout gives every actor a GPU of its own."""
    from ray.util.placement_group import remove_placement_group

    from tests.conftest import compose_config

    ray = logical_gpus
    hybrid = compose_config(["cluster.placement_mode=hybrid", "cluster.gpus_per_learner=1",
                             "cluster.gpus_per_rollout_worker=1", "rollout.num_workers=2", "trainer.num_workers=2",
                             "trainer.weight_sync=ipc", "rollout.sleep_between_steps=true"])
    rollout, learner, placement = _placed_gpus(ray, hybrid)
    assert rollout == learner, (rollout, learner)  # pair i: one GPU
    assert sorted(v for v, _ in rollout) == ["0", "1"] and all([v] == ids for v, ids in rollout)
    assert [placement.bundle("rollout", i) for i in range(2)] == [placement.bundle("learner", i) for i in range(2)]
    remove_placement_group(placement.group)

    apart = compose_config(["cluster.gpus_per_learner=1", "cluster.gpus_per_rollout_worker=1"])
    rollout, learner, placement = _placed_gpus(ray, apart)
    assert sorted([*rollout, *learner]) == [("0", ["0"]), ("1", ["1"])], (rollout, learner)
    remove_placement_group(placement.group)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.num_workers=1", "trainer.num_workers=2"], "rollout.num_workers=1 must equal trainer.num_workers=2"),
    (["cluster.gpus_per_learner=0.5", "cluster.gpus_per_rollout_worker=0.5"], "must both be 1"),
    (["trainer.weight_sync=collective"], "set trainer.weight_sync=ipc"),
    (["rollout.sleep_between_steps=false"], "needs rollout.sleep_between_steps=true"),
    (["model.lora.rank=8"], "trainer.weight_sync=object_store with model.lora"),
    (["trainer.zero_stage=0"], "set trainer.zero_stage=1, 2 or 3"),
])
def test_hybrid_settings_that_cannot_work_are_refused_naming_the_fix(overrides, message):
    from rl.config.schema import ConfigError
    from rl.config.validation import validate
    from tests.conftest import compose_config

    good = ["cluster.placement_mode=hybrid", "cluster.gpus_per_learner=1", "cluster.gpus_per_rollout_worker=1",
            "trainer.weight_sync=ipc", "rollout.sleep_between_steps=true"]
    validate(compose_config(good))
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([*good, *overrides]))
    with pytest.raises(ConfigError, match="set cluster.placement_mode=hybrid"):
        validate(compose_config(["trainer.weight_sync=ipc"]))


def test_hybrid_gpu_profile_is_a_valid_hybrid_run():
    """`cluster=hybrid_gpu`: learner rank and engine share each GPU, IPC weight sync, sleep
    between steps, bf16 and CUDA graphs, and the settings pass validation."""
    from rl.config.validation import validate
    from tests.conftest import compose_config

    cfg = compose_config(["cluster=hybrid_gpu"])
    validate(cfg)
    assert cfg.cluster.placement_mode == "hybrid" and cfg.trainer.weight_sync == "ipc"
    assert cfg.rollout.sleep_between_steps and cfg.model.dtype == "bfloat16" and cfg.rollout.enforce_eager is False


@pytest.mark.parametrize("overrides, message, fix", [
    (["cluster.gpus_per_learner=0.5", "trainer.num_workers=2", "trainer.micro_batch_size=4",
      "trainer.weight_sync=object_store"], "may put two learner ranks on one GPU.*set cluster.gpus_per_learner=1",
     "cluster.gpus_per_learner=1"),
    (["cluster.gpus_per_rollout_worker=0.5", "rollout.num_workers=2"],
     "may put two rollout workers on one GPU.*trainer.weight_sync=object_store", "cluster.gpus_per_rollout_worker=1"),
    (["cluster.gpus_per_rollout_worker=0.5", "rollout.num_workers=2", "trainer.weight_sync=object_store"],
     r"up to 2 engines on one GPU.*set rollout.gpu_memory_utilization=0.47", "rollout.gpu_memory_utilization=0.47"),
    (["cluster.gpus_per_rollout_worker=0.25", "rollout.num_workers=3", "trainer.weight_sync=object_store",
      "rollout.gpu_memory_utilization=0.4"], r"up to 3 engines on one GPU.*gpu_memory_utilization=0.31",
     "rollout.gpu_memory_utilization=0.31"),
])
def test_disaggregated_shares_that_may_pack_one_role_twice_on_a_gpu_are_refused(overrides, message, fix):
    """Ray packs fractional GPU shares of any actors onto one device: two learner ranks there break
    NCCL, two engines there each claim `gpu_memory_utilization` of the whole card."""
    from rl.config.schema import ConfigError
    from rl.config.validation import validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))
    validate(compose_config([*overrides, fix]))  # the fix it names passes


def test_engines_start_alone_on_a_gpu_they_may_share():
    """vLLM sizes its memory from what is free while it starts: where an engine may share its GPU
    with a learner rank (hybrid, or any share below one GPU), the learner starts after it."""
    from launch.components import engines_start_first
    from tests.conftest import compose_config

    assert engines_start_first(compose_config(["cluster=hybrid_gpu"]).cluster)
    assert engines_start_first(compose_config(["cluster.gpus_per_learner=0.5", "cluster.gpus_per_rollout_worker=0.5",
                                               "trainer.weight_sync=object_store"]).cluster)
    assert engines_start_first(compose_config(["cluster.gpus_per_learner=0.5",
                                               "cluster.gpus_per_rollout_worker=1"]).cluster)
    assert not engines_start_first(compose_config(["cluster=local_gpu"]).cluster)  # a GPU each
    assert not engines_start_first(compose_config([]).cluster)  # CPUs


def test_cuda_vllm_with_rollout_workers_on_cpus_is_refused_before_ray(monkeypatch):
    """vLLM's CUDA build picks its platform from NVML, not CUDA_VISIBLE_DEVICES: rollout workers
    given no GPU on a GPU machine would fail deep in vLLM, so this stops before Ray."""
    import launch.checks
    from rl.config.schema import ConfigError
    from tests.conftest import compose_config

    monkeypatch.setattr(launch.checks, "_cuda_devices", lambda: 2)
    monkeypatch.setattr(launch.checks, "vllm_build", lambda: "cuda")
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_rollout_worker=0 .*CUDA build.*cluster=local_gpu"):
        launch.checks.require_local_gpus(compose_config([]))
    launch.checks.require_local_gpus(compose_config(["rollout=hf"]))  # transformers generate on CPUs is fine
    launch.checks.require_local_gpus(compose_config(["cluster=local_gpu"]))
    monkeypatch.setattr(launch.checks, "vllm_build", lambda: "cpu")
    launch.checks.require_local_gpus(compose_config([]))  # vLLM's CPU build on a GPU machine runs on CPUs
