"""Config validation: bad input fails fast, naming the field (no Ray, no model started)."""

import os
import subprocess
import sys
import tempfile

import pytest
from hydra import compose, initialize_config_dir

from rl.config.schema import ConfigError
from rl.config.validation import validate
from tests.conftest import imported_packages

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _compose(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base=None):
        return compose("train", overrides=list(overrides))


def test_default_config_is_valid():
    cfg = _compose()
    validate(cfg)
    assert cfg.rollout.backend == "vllm" and cfg.algorithm.name == "grpo"
    assert _compose("rollout=hf").rollout.backend == "hf"
    ray_gpu = _compose("cluster=ray_gpu").cluster  # cluster=ray_gpu places roles on GPUs; cluster=ray does not
    assert ray_gpu.address == "auto" and ray_gpu.gpus_per_rollout_worker == 1 and ray_gpu.gpus_per_learner == 1
    assert _compose("cluster=ray").cluster.gpus_per_learner == 0


def _algorithm_registries():
    """config field -> the rl.algo registry for it, found in every module of rl.algo (not a list
    kept here, which would miss a new registry)."""
    import importlib
    import pkgutil

    import rl.algo
    from rl.algo.registry import Registry

    found = {}
    for module in pkgutil.iter_modules(rl.algo.__path__, "rl.algo."):
        for value in vars(importlib.import_module(module.name)).values():
            if isinstance(value, Registry):
                assert found.setdefault(value.config_field, value) is value, f"two registries for {value.config_field}"
    return found


def test_config_choices_match_the_registries():
    """rl/config/validation.py offers choices without importing torch (fast CLI errors): for every
    algorithm part they are exactly the names its rl.algo registry holds, both ways (no choice that
    fails at step 1, no registered part the config refuses), and every such field has a registry."""
    from rl.config.algorithm_names import ALGORITHM_CHOICES
    from rl.config.validation import _CHOICES

    registries = _algorithm_registries()
    assert len(registries) >= 6 and set(registries) == set(ALGORITHM_CHOICES)
    for field, registry in registries.items():
        offered, registered = set(_CHOICES[field]), set(registry.names())
        assert offered - registered == set(), f"{field}: the config offers unregistered {sorted(offered - registered)}"
        assert registered - offered == set(), f"{field}: the config refuses registered {sorted(registered - offered)}"
        assert len(_CHOICES[field]) == len(offered), f"{field} lists a name twice"


def test_semantic_errors_name_fields_and_fixes():
    with pytest.raises(ConfigError) as err:
        validate(_compose("rollout.n=1", "trainer.zero_stage=4", "trainer.num_workers=3"))
    text = str(err.value)
    assert "rollout.n=1" in text and "trainer.zero_stage=4" in text and "trainer.num_workers=3" in text


@pytest.mark.parametrize("override,expected", [
    ("rollout.top_p=0", "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.top_p=1.01", "rollout.top_p=1.01: must be in (0, 1]"),
    ("rollout.top_p=nan", "rollout.top_p=nan"),
    ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization=0.0: must be in (0, 1]"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=1.5"),
    ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib=0: must be > 0"),
    ("rollout.max_restarts=-1", "rollout.max_restarts=-1: must be >= 0"),
    ("rollout.max_retries=-1", "rollout.max_retries=-1: must be >= 0"),
    ("rollout.max_model_len=8", "rollout.max_model_len=8 leaves no room for a prompt"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0: must be > 0"),
    ("reward.timeout_s=-5", "reward.timeout_s=-5.0: must be > 0"),
    ("reward.max_failed_steps=0", "reward.max_failed_steps=0: must be >= 1"),
    ("sandbox.num_workers=-1", "sandbox.num_workers=-1: must be >= 0"),
    ("sandbox.max_retries=-1", "sandbox.max_retries=-1: must be >= 0"),
    ("sandbox.num_cpus_per_worker=0", "sandbox.num_cpus_per_worker=0.0: must be > 0"),
    ("cluster.num_cpus=0", "cluster.num_cpus=0: must be > 0"),
    ("cluster.gpus_per_learner=-1", "cluster.gpus_per_learner=-1.0: must be >= 0"),
    ("cluster.worker_niceness=-5", "cluster.worker_niceness=-5: must be in [0, 19]"),
    ("cluster.worker_niceness=20", "cluster.worker_niceness=20: must be in [0, 19]"),
    ("run.save_every=-1", "run.save_every=-1: must be >= 0"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints=0: must be a positive integer"),
    ("run.max_restarts=-1", "run.max_restarts=-1: must be >= 0"),
    ("run.call_timeout_s=0", "run.call_timeout_s=0.0: must be > 0"),
    ("run.call_timeout_factor=0.9", "run.call_timeout_factor=0.9: must be >= 1"),
    ("run.start_timeout_s=-1", "run.start_timeout_s=-1.0: must be > 0"),
    ("algorithm.kl_ctrl=adaptive algorithm.kl_target=0", "algorithm.kl_ctrl=adaptive needs algorithm.kl_target > 0"),
])
def test_ranges_name_the_field_and_a_good_value(override, expected):
    with pytest.raises(ConfigError) as err:
        validate(_compose(*override.split()))
    assert expected in str(err.value)


@pytest.mark.parametrize("algorithm", sorted(os.path.basename(f)[:-5] for f in os.listdir(f"{CONFIGS}/algorithm")))
def test_rollout_n_below_one_fails_for_every_algorithm(algorithm):
    # each algorithm's own defaults are valid (on-policy distillation's with its required teacher)
    given = [f"algorithm={algorithm}", *(["algorithm.teacher_path=/teacher"] if algorithm == "opd" else [])]
    validate(_compose(*given))
    with pytest.raises(ConfigError, match=r"rollout.n=0: must be >= 1, e.g. rollout.n=8"):
        validate(_compose(*given, "rollout.n=0"))


def test_position_limit_of_model_configs():
    from launch.model_files import position_limit

    assert position_limit({"max_position_embeddings": 64}) == (64, "max_position_embeddings")
    assert position_limit({"n_positions": 1024, "max_position_embeddings": 2048}) == (1024, "n_positions")
    assert position_limit({"text_config": {"max_position_embeddings": 4096}}) == (4096, "max_position_embeddings")
    scaled = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert position_limit(scaled)[0] == 16384  # never stricter than the engines
    assert position_limit({"max_position_embeddings": 8192, "model_max_length": 131072})[0] == 131072
    assert position_limit({"hidden_size": 8}) is None


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize(
    "override,expected",
    [("algorithm.lr=oops", "algorithm.lr"), ("trainer.zero_stag=3", "trainer.zero_stag"),
     ("+nonsense=1", "nonsense"), ("rollout.n=2.5", "rollout.n"),
     ("model.path=/no/such/model", "model.path='/no/such/model'"),
     ("algorithm.advantage=nope", "algorithm.advantage='nope': choose one of grpo, rloo"),
     ("algorithm.importance_correction=pop", "algorithm.importance_correction='pop': choose one of none, token_tis, "
      "token_mis, icepop"),
     ("trainer.delta_sync=true trainer.weight_sync=object_store", "trainer.delta_sync sends changes")],
)
def test_cli_rejects_bad_input_fast_with_the_field_name(override, expected):
    _fails_fast(override.split(), expected, unloaded=("torch", "ray", "vllm", "deepspeed"))  # the schema needs no torch


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize(
    "override,expected",
    [("reward.functions=[{fn: nope_rewards.py:score}]", "reward.functions[0].fn='nope_rewards.py:score'"),
     ("task.prompt_key=question", "task.prompt_key='question'")],
)
def test_bad_reward_or_data_fails_before_ray_starts(tiny_dir, override, expected):
    _fails_fast([f"model.path={tiny_dir}/model", f"task.train_files=[{tiny_dir}/data/train.jsonl]", override],
                expected)


def test_code_task_refuses_to_start_without_isolation(tiny_dir, tmp_path):
    # No bubblewrap on PATH: the host cannot isolate untrusted programs, so nothing starts.
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin")}
    _fails_fast(["task=code_speedup", f"model.path={tiny_dir}/model"], "bubblewrap", env=env)


def _fails_fast(overrides, expected, env=None, unloaded=("ray", "vllm", "deepspeed")):
    """`launch.train` refuses before anything heavy loads: none of `unloaded` is even imported (read
    from the interpreter's own import log; a wall-clock bound varied too much between hosts)."""
    run_dir = f"run.dir={tempfile.mkdtemp()}"  # Hydra makes the run dir before our checks run
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "launch.train", *overrides, run_dir], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    output = proc.stdout + "".join(line + "\n" for line in proc.stderr.splitlines()
                                   if not line.startswith("import time:"))
    assert proc.returncode != 0
    assert expected in output
    assert "Traceback" not in output
    imported = imported_packages(proc.stderr)
    assert {"hydra", "launch", "rl"} <= imported, "no import log: the check below would pass vacuously"
    assert not imported & set(unloaded), f"refused only after importing {sorted(imported & set(unloaded))}"


def test_code_task_and_sandbox_choices_compose_and_validate():
    from tests.conftest import compose_config

    cfg = compose_config(["task=code_speedup", "sandbox=docker", "sandbox.resource=benchmark"])
    assert cfg.sandbox.backend == "docker" and cfg.sandbox.num_workers == 2
    assert cfg.reward.functions[0].kwargs.backend == "docker"  # the reward's fallback follows sandbox.backend
    assert cfg.model.path.endswith("artifacts/tiny_code/model") and cfg.rollout.max_new_tokens == 48
    with pytest.raises(ConfigError, match="sandbox.backend='chroot'"):
        compose_config(["sandbox.backend=chroot"])


def test_all_cores_means_the_cores_this_process_may_use():
    """`cluster.threads_per_worker=0` gives each actor the cores the launch may run on (its
    affinity: `taskset`, a container's cpuset), not every core of the machine."""
    from launch.components import worker_threads
    from tests.conftest import compose_config

    cfg, before = compose_config([]), os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert worker_threads(cfg) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert worker_threads(cfg) == len(before)
    assert worker_threads(compose_config(["cluster.threads_per_worker=3"])) == 3


_NICENESS_PROBE = """
import os, sys, ray
from launch.components import start_ray
from tests.conftest import compose_config

start_ray(compose_config(sys.argv[1:]))

@ray.remote(num_cpus=1)
class Probe:
    def niceness(self):
        return os.nice(0)

print("NICENESS", os.nice(0), ray.get(Probe.remote().niceness.remote()))
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("overrides, actor", [([], 0), (["cluster.worker_niceness=7"], 7)])
def test_the_local_ray_runs_actors_at_the_configured_priority(tmp_path, overrides, actor):
    """Ray's own default (15) lets any normal-priority process preempt an actor's training thread;
    a local Ray a run starts gives its actors `cluster.worker_niceness` (0 by default), a real
    Ray in a fresh process (Ray may already run in this one)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NICENESS_PROBE, *overrides], capture_output=True, text=True,
                         timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("NICENESS")), None)
    assert line is not None, out.stderr[-3000:]
    driver, got = (int(v) for v in line.split()[1:])
    assert got == driver + actor


@pytest.mark.parametrize("overrides, rollout, learner", [
    ([], 8, 8),  # generation and training take turns: each role has all 8 cores
    (["rollout.num_workers=2", "trainer.num_workers=4"], 4, 2),  # ...shared among that role's actors
    (["algorithm.off_policy_steps=1"], 4, 4),  # they overlap: 1 worker + 1 rank share the 8 cores
    (["rollout.mode=streaming", "algorithm.off_policy_steps=1", "rollout.num_workers=2"], 2, 2),  # 2 + 1 -> 8 // 3
    (["algorithm.off_policy_steps=1", "rollout.num_workers=4", "trainer.num_workers=8"], 1, 1),  # never below 1
    (["algorithm.off_policy_steps=1", "cluster.threads_per_worker=3"], 3, 3),  # as set
])
def test_automatic_threads_share_the_cores_among_the_roles_computing_at_once(monkeypatch, overrides, rollout,
                                                                             learner):
    """`cluster.threads_per_worker=0`: threads beyond the cores only wait on each other, so actors
    that compute at the same time (a role's own actors; both roles when rollouts overlap
    training) split the cores between them."""
    import launch.components
    from tests.conftest import compose_config

    monkeypatch.setattr(launch.components, "usable_cores", lambda: 8)
    cfg = compose_config(overrides)
    assert (launch.components.worker_threads(cfg, "rollout"), launch.components.worker_threads(cfg, "learner")) \
        == (rollout, learner)


def test_streaming_mode_names_what_it_needs():
    """rollout.mode=streaming is refused, field by field, where it cannot run as asked (never a
    silent fallback to batches)."""
    from tests.conftest import compose_config

    cfg = compose_config(["rollout.mode=streaming", "algorithm.off_policy_steps=1"])
    assert cfg.rollout.mode == "streaming" and cfg.rollout.inflight_kv == "keep"
    with pytest.raises(ConfigError) as err:
        compose_config(["rollout.mode=streaming", "rollout.backend=hf", "rollout.inflight_kv=drop"])
    text = str(err.value)
    assert "set rollout.backend=vllm" in text and "algorithm.off_policy_steps=1" in text
    assert "rollout.inflight_kv='drop': choose one of keep, recompute" in text
    # environment episodes stream too (rl/run/rollouts.py EnvEpisodes), agents run lock-step too
    assert compose_config(["rollout.mode=streaming", "algorithm.off_policy_steps=1", "task=calculator"]).task.env
    agent = compose_config(["task=calculator_agent", "rollout.mode=batch", "algorithm.off_policy_steps=0"])
    assert agent.task.agent and agent.rollout.mode == "batch"
    with pytest.raises(ConfigError, match="task.agent serves the agents' calls .* set rollout.backend=vllm"):
        compose_config(["task=calculator_agent", "rollout.backend=hf", "rollout.mode=batch"])
    with pytest.raises(ConfigError, match="rollout.mode='stream': choose one of batch, streaming"):
        compose_config(["rollout.mode=stream"])


def test_task_env_openenv_becomes_the_openenv_agent_episode():
    """task.env=openenv:<EnvClient class or URL> (reward/agents/openenv_task.py expand_openenv, a step
    of its own before validation): the OpenEnv episode agent, with the client, the server,
    task.env_kwargs and task.max_turns as its kwargs; a URL alone plays through openenv-core's
    generic client."""
    from rl.config.compose import compose
    from reward.agents.openenv_task import OPENENV_AGENT, OPENENV_GENERIC_CLIENT, expand_openenv

    cfg = compose("train", ["task=openenv_sum", "task.agent_python="], expand=expand_openenv)  # no venv needed
    assert cfg.task.agent == OPENENV_AGENT and cfg.task.env is None and dict(cfg.task.env_kwargs) == {}
    assert dict(cfg.task.agent_kwargs) == {"client": "examples.openenv_sum.client:SumEnv", "max_turns": 2,
                                           "server_url": "http://127.0.0.1:8001", "action_field": "message"}
    expand_openenv(cfg)  # expanded once: expanding again changes nothing
    validate(cfg)
    assert cfg.task.agent == OPENENV_AGENT and cfg.task.agent_kwargs.client.endswith(":SumEnv")
    cfg = compose("train", ["task=openenv_sum", "task.agent_python=", "task.env=openenv:http://10.0.0.2:9000",
                            "task.max_turns=3"], expand=expand_openenv)
    assert cfg.task.agent_kwargs.client == OPENENV_GENERIC_CLIENT
    assert cfg.task.agent_kwargs.server_url == "http://10.0.0.2:9000" and cfg.task.agent_kwargs.max_turns == 3
    cfg = compose("train", ["task=calculator"], expand=expand_openenv)  # any other task.env is left as it is
    assert cfg.task.env == "examples.calculator:Calculator" or ":" in cfg.task.env
    assert not cfg.task.agent


@pytest.mark.parametrize("overrides", [[], ["task=openenv_sum", "task.agent_python="], ["task=calculator_agent"],
                                       ["algorithm=ppo"], ["rollout.n=1", "trainer.zero_stage=4"]])
def test_validation_reads_the_config_and_never_changes_it(overrides):
    """validate only checks: a valid config and a refused one come out as they went in, and an
    unexpanded shorthand (task.env=openenv:...) is refused naming the step that expands it, never
    expanded behind the caller's back (rl/config names no code of the layers above it)."""
    from omegaconf import OmegaConf

    cfg = _compose(*overrides)
    before = OmegaConf.to_yaml(cfg)
    if "task=openenv_sum" in overrides:
        with pytest.raises(ConfigError, match=r"task.env='openenv:examples.openenv_sum.client:SumEnv': expected .*"
                                              r"a shorthand such as openenv:... is expanded before validation"):
            validate(cfg)
    else:
        try:
            validate(cfg)
        except ConfigError:
            assert "rollout.n=1" in overrides  # the one refused here
    assert OmegaConf.to_yaml(cfg) == before


@pytest.mark.parametrize("overrides, says", [
    (["task.agent=my_agents.py:play"], "set task.agent=null"),
    (["~task.env_kwargs.server_url"], "task.env_kwargs.server_url=http://HOST:PORT"),
    (["task.env=openenv:sum_env"], "expected openenv:package.module:EnvClientClass or openenv:http://HOST:PORT"),
])
def test_task_env_openenv_refuses_what_it_cannot_play(overrides, says):
    from rl.config.compose import compose
    from reward.agents.openenv_task import expand_openenv

    with pytest.raises(ConfigError) as err:
        compose("train", ["task=openenv_sum", "task.agent_python=", *overrides], expand=expand_openenv)
    assert says in str(err.value) and "task.env='openenv:" in str(err.value), str(err.value)


def test_agent_kwargs_reach_the_agent_as_plain_values():
    """Nested task.agent_kwargs become dicts and lists all the way down (what launch.components
    passes to the agent pool): an agent in another
    interpreter (task.agent_python, no omegaconf there) must unpickle them."""
    import pickle

    from rl.config.compose import compose
    from rl.config.schema import plain_dict

    cfg = compose("train", ["task=verifiers_sum", "task.agent_python=", "+task.agent_kwargs.sampling={max_tokens: 8}",
                            "+task.agent_kwargs.tags=[a, b]"])
    kwargs = plain_dict(cfg.task.agent_kwargs)
    assert kwargs == {"environment": "verifiers_sum", "taskset_args": {"n": 2000}, "sampling": {"max_tokens": 8},
                      "tags": ["a", "b"]}
    assert b"omegaconf" not in pickle.dumps(kwargs)
