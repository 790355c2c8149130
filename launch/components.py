"""The actors of a run and how they are wired: Ray, the sandbox pool, the rollout fleet, the
learner group, the weight sync between them (rl/wire/), the reward service, environments
and agents. `launch/train.py` composes these and owns the command line; this module knows how
each part is built from the typed config and what must start before what.
"""

from __future__ import annotations

import math
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rl.config.schema import TrainConfig, local_ray_config, plain_dict
from rl.config.validation import endpoint_address
from rl.plan.devices import GPU_VISIBILITY_ENV



def run_deadlines(cfg: TrainConfig):
    """The run's deadlines for its actor groups' calls (run.call_timeout_s, its factor, and
    run.start_timeout_s for start-up): one instance per group, as each learns its own calls."""
    from rl.actors.faults import Deadlines

    return Deadlines(cfg.run.call_timeout_s, cfg.run.call_timeout_factor, cfg.run.start_timeout_s)

def usable_cores() -> int:
    """The cores this process may run on (its affinity: a `taskset`, a container's cpuset), not
    the machine's count: threads beyond them only wait on each other."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(cfg: DictConfig, role: str = "rollout") -> int:
    """Torch/OMP threads of one rollout worker (`role="rollout"`) or learner rank (`"learner"`):
    `cluster.threads_per_worker`, or with 0 this machine's cores shared among the actors that
    compute at the same time. Generation and training alternate in a synchronous run, so each
    role's actors share all cores; they overlap with `algorithm.off_policy_steps` >= 1 or
    `rollout.mode=streaming`, so every rollout worker and learner rank gets its own share. Threads
    beyond the cores only wait on each other: on 2 cores, 2 threads per role made an overlapping
    step 2.2x (ahead) to 2.8x (streaming) slower than 1 (tiny task, 12 steps, one job)."""
    if cfg.cluster.threads_per_worker:
        return cfg.cluster.threads_per_worker
    rollout_workers, learner_ranks = cfg.rollout.num_workers, cfg.trainer.num_workers
    if cfg.algorithm.off_policy_steps > 0 or cfg.rollout.mode == "streaming":
        sharing = rollout_workers + learner_ranks
    else:
        sharing = rollout_workers if role == "rollout" else learner_ranks
    return max(1, usable_cores() // max(1, sharing))


def start_ray(cfg: DictConfig) -> bool:
    """Connect to the configured cluster or start a local Ray; True when this call started or
    connected it (the run ends it). A Ray this process already started (a notebook, a test
    session) is used as it is, and False returned: the run then removes only what it created."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.cluster.address:
        # Under `ray job submit --working-dir .` the job's runtime env already ships the code.
        ray.init(address=cfg.cluster.address, runtime_env={"env_vars": GPU_VISIBILITY_ENV}, log_to_driver=True)
        return True
    # User reward modules named as `package.module:function` must import inside the actors.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
           **GPU_VISIBILITY_ENV}  # an actor given no GPU sees none (rl/plan/devices.py)
    needed = cfg.rollout.num_workers + cfg.trainer.num_workers + cfg.reward.num_workers
    needed += math.ceil(cfg.sandbox.num_workers * cfg.sandbox.num_cpus_per_worker)
    needed += math.ceil(cfg.task.env_workers * 0.25) if cfg.task.env else 0  # EnvService's actors
    num_cpus = cfg.cluster.num_cpus or max(usable_cores(), needed)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True,
             _system_config=local_ray_config(cfg.cluster))
    return True


def start_sandbox_pool(cfg: DictConfig):
    """The sandbox actors code rewards send their jobs to (None when sandbox.num_workers=0)."""
    if cfg.sandbox.num_workers < 1:
        return None
    from sandbox.pool import SandboxPool, SandboxSettings

    pool = SandboxPool(SandboxSettings(**OmegaConf.to_container(cfg.sandbox, resolve=True)), deadlines=run_deadlines(cfg))
    print(f"Sandbox workers: {', '.join(pool.placement)}")
    return pool


def reward_specs(cfg: DictConfig | TrainConfig):
    """The reward functions of the config (Hydra's or its typed form), as plain data."""
    from reward.scorer import RewardFunctionSpec

    def plain(kwargs: Any) -> dict[str, Any]:
        return OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)

    return [RewardFunctionSpec(f.fn, f.weight, f.name, plain(f.kwargs)) for f in cfg.reward.functions]


def engines_start_first(c) -> bool:
    """Whether the rollout engines must finish starting before the learner starts: where an
    engine may share its GPU with a learner rank (hybrid placement, or a share below one GPU that
    Ray may pack beside one), since vLLM sizes its memory from what is free while it starts and
    refuses to start when that changes under it ("Error in memory profiling")."""
    return c.placement_mode == "hybrid" or 0 < c.gpus_per_learner < 1 or 0 < c.gpus_per_rollout_worker < 1


def build_components(cfg: TrainConfig, log=print, started: dict[str, Any] | None = None):
    """The rollout fleet, reward service, learner group, the weight sync between learner and fleet
    (not joined yet: the `Cluster` joins it) and their placement that the typed config describes,
    all keeping the run's deadlines (`run.call_timeout_s`...) and reporting to `log`. The rollout
    workers and learner ranks go into one placement group (`cluster.placement`), one bundle each;
    it lives until Ray shuts down (the driver's end removes it on a cluster too). `started`
    collects each part as it starts ("fleet", "learner", "rewards"), so a failure later can end them."""
    from launch.console import actor_env, rollout_env
    from launch.placement import make_placement
    from reward.service import RewardService
    from rl.wire.transports import make_weight_sync
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env
    from trainer.group import LearnerGroup
    from trainer.learner_setup import LearnerSpec
    from trainer.vllm_ipc import ipc_runtime

    threads, c = worker_threads(cfg, "rollout"), cfg.cluster
    learner_threads = worker_threads(cfg, "learner")
    deadlines = run_deadlines(cfg)
    env = rollout_env(threads, c.gpus_per_rollout_worker > 0)
    if cfg.rollout.backend == "vllm":
        env.update(vllm_env(cfg.rollout.kv_cache_gib, threads, cfg.rollout.enforce_eager))
    placement = make_placement(cfg, log)
    started = {} if started is None else started
    fleet = started["fleet"] = RolloutFleet(
        RolloutSpec.from_config(cfg, threads), num_cpus=1, num_gpus=c.gpus_per_rollout_worker, env_vars=env,
        actor_options=placement.rollout, deadlines=deadlines, log=log,
        wait=False)  # the engines start while the learner does...
    if engines_start_first(c):  # ...except where they may share a GPU with it
        fleet.wait_started()
    if c.placement_mode == "hybrid":  # the learner needs the engines asleep (level 1 keeps their weights:
        fleet.sleep(1)                # no sync comes before the first rollout)
    learner = started["learner"] = LearnerGroup(LearnerSpec.from_config(cfg, learner_threads), cfg.trainer.num_workers, num_cpus=1,
                           num_gpus=c.gpus_per_learner, env_vars=actor_env(learner_threads, c.gpus_per_learner > 0, cfg.trainer.cpu_allocator),
                           actor_options=placement.learner, deadlines=deadlines)
    rewards = started["rewards"] = RewardService(reward_specs(cfg), num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                            bound=cfg.reward.bound, base_dir=os.getcwd(), deadlines=deadlines) if cfg.reward.functions else None
    fleet.wait_started()  # the engines took longest to start: the learner and rewards started meanwhile
    weights = make_weight_sync(cfg.trainer.weight_sync, learner.group, learner.metas, fleet.group,
                               cfg.rollout.tensor_parallel_size, deadlines,
                               cfg.trainer.delta_sync_max_fraction if cfg.trainer.delta_sync else None,
                               ipc=ipc_runtime() if cfg.trainer.weight_sync == "ipc" else None)
    if cfg.model.lora.rank > 0:
        counts, lora = learner.parameter_counts(), cfg.model.lora
        log(f"LoRA rank {lora.rank} on {','.join(lora.target_modules)}: {counts['trainable']:,.0f} trainable "
            f"parameters of {counts['total']:,.0f} ({counts['trainable'] / counts['total']:.2%}); a weight sync "
            f"sends {weights.bytes_per_sync / 2**10:,.1f} KiB instead of {counts['total_bytes'] / 2**10:,.1f} KiB")
    return fleet, rewards, learner, weights, placement


def load_agent(cfg) -> Any:
    """The `task.agent` function (None without one), checked in the driver before Ray starts: it
    loads, is callable as fn(base_url, row, **task.agent_kwargs). The episodes load it again, each
    in its own process (reward/agents/pool.py)."""
    if not cfg.task.agent:
        return None
    if cfg.task.agent_python:  # loaded where it will run: a zygote of that interpreter, then closed
        from reward.agents.pool import AgentLimits, AgentPool

        AgentPool(cfg.task.agent, os.getcwd(), 1, AgentLimits(cfg.task.agent_timeout_s),
                  plain_dict(cfg.task.agent_kwargs), python=cfg.task.agent_python).close()
        return None
    from reward.loader import load_agent_function

    return load_agent_function(cfg.task.agent, os.getcwd(), plain_dict(cfg.task.agent_kwargs), field="task.agent")


def start_agents(cfg: TrainConfig, tokenizer, fleet, repairs):
    """The agent server in front of the fleet (on `task.agent_host`), the processes that run the
    agents and the runner of `task.agent` episodes (None without task.agent); `repairs` (the
    `Cluster`) replaces rollout workers lost under an agent's call."""
    if not cfg.task.agent:
        return None
    import logging

    from reward.agents.pool import AgentLimits, AgentPool
    from reward.agents.runner import AgentRunner
    from reward.agents.server import AgentServer, RequestRejected

    def generate(request):  # a request the engine refused is that call's error (a 400), never a fault
        sample = fleet.generate_one(request)
        if sample.error is not None:
            raise RequestRejected(sample.error)
        return sample

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the agents' clients log every call at INFO
    t, r = cfg.task, cfg.rollout
    server = AgentServer(tokenizer, generate, host=t.agent_host, port=t.agent_port, max_new_tokens=r.max_new_tokens,
                         temperature=r.temperature, top_p=r.top_p, max_model_len=r.max_model_len,
                         observation_role=t.observation_role, max_calls=t.agent_max_calls)
    server.start()
    try:  # the episodes reach the server and the task's endpoints, nothing else; the run dir stays out of sight
        pool = AgentPool(t.agent, os.getcwd(), t.agent_workers,
                         AgentLimits(t.agent_timeout_s, memory_mb=t.agent_memory_mb, max_processes=t.agent_max_processes),
                         plain_dict(t.agent_kwargs), python=t.agent_python or None,
                         endpoints=[(t.agent_host, server.port, server.handoff_path),
                                    *map(endpoint_address, t.agent_endpoints)],
                         hidden=[cfg.run.dir], reward_bound=t.agent_reward_bound)
    except BaseException:
        server.stop()
        raise
    return AgentRunner(server, pool, repairs, name=t.agent, prompt_key=t.prompt_key, timeout_s=t.agent_timeout_s,
                       workers=t.agent_workers, max_len=r.max_model_len, decode=tokenizer.decode,
                       reward_bound=t.agent_reward_bound)


def make_source(fleet, repairs, episodes, agents):
    """Where samples come from (rl/run/rollouts.py): agent episodes, environment episodes, or the
    fleet's single completions; `repairs` (the `Cluster`) replaces lost rollout workers while
    they wait."""
    from rl.run.rollouts import Completions, EnvEpisodes

    if agents is not None:
        return agents
    return EnvEpisodes(episodes, fleet, repairs) if episodes is not None else Completions(fleet, repairs)


def start_env_service(cfg: TrainConfig):
    """The environment actors of `task.env` (None without one)."""
    if not cfg.task.env:
        return None
    from reward.envs import EnvService

    t = cfg.task
    return EnvService(t.env, dict(t.env_kwargs), num_workers=t.env_workers, timeout_s=t.env_timeout_s,
                      base_dir=os.getcwd(), deadlines=run_deadlines(cfg))


def make_episodes(cfg: TrainConfig, tokenizer, envs):
    """What the loop needs to run `task.env` episodes on the environment actors (None without)."""
    if envs is None:
        return None
    from rl.data.episodes import Episodes, Limits, ObservationEncoder

    t, r = cfg.task, cfg.rollout
    limits = Limits(t.max_turns, r.max_new_tokens, t.max_episode_tokens or r.max_model_len, r.max_model_len)
    encoder = ObservationEncoder(tokenizer, t.chat_template, t.observation_role, t.max_observation_tokens)
    return Episodes(envs, encoder, limits, t.prompt_key)
