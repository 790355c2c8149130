"""`python -m launch.train [group=option ...] [key=value ...]`: one GRPO run as a Hydra app.

Bad config fails here, before Ray or any model starts: Hydra checks keys and types against
`rl.config.TrainConfig`, then `rl.config.validate` checks ranges. Heavy imports come after that.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from examples import ensure_builtin
from launch.cli import INPUT_ERRORS, fail, require_model
from launch.console import quiet_driver
from rl.config import ConfigError, TrainConfig, validate


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _reward_model_paths(cfg: DictConfig) -> list[str]:
    return [f.kwargs.path for f in cfg.reward.functions if f.kwargs and isinstance(f.kwargs.get("path"), str)]


def check_host(cfg: DictConfig) -> None:
    """Sandbox workers that will run on this machine need isolation: no isolation, no untrusted code."""
    if cfg.sandbox.num_workers > 0 and cfg.sandbox.backend == "process" and not cfg.cluster.address:
        from sandbox.detect import probe_host, require_isolation

        require_isolation(probe_host())


def ensure_inputs(cfg: DictConfig) -> None:
    """Build the built-in tasks the config names and that are missing (the tiny policy and its
    data, a built-in reward model named by a reward function's `path`), before Ray starts."""
    ensure_builtin([cfg.model.path, *cfg.task.train_files, *_reward_model_paths(cfg)], cfg.run.seed)
    require_model(cfg.model.path)


def resolve_paths(cfg: DictConfig) -> None:
    """Make every path absolute (relative = relative to the launch directory), for the actors."""
    cfg.model.path = _abs(cfg.model.path)
    for f in cfg.reward.functions:
        if f.kwargs and isinstance(f.kwargs.get("path"), str):
            f.kwargs.path = _abs(f.kwargs.path)
    cfg.task.train_files = [_abs(f) for f in cfg.task.train_files]
    cfg.run.dir = _abs(cfg.run.dir)


def worker_threads(cfg: DictConfig) -> int:
    return cfg.cluster.threads_per_worker or os.cpu_count() or 1


def start_ray(cfg: DictConfig) -> None:
    import ray

    if cfg.cluster.address:
        # Under `ray job submit --working-dir .` the job's runtime env already ships the code.
        ray.init(address=cfg.cluster.address, log_to_driver=True)
        return
    # User reward modules named as `package.module:function` must import inside the actors.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    needed = cfg.rollout.num_workers + cfg.trainer.num_workers + cfg.reward.num_workers
    needed += math.ceil(cfg.sandbox.num_workers * cfg.sandbox.num_cpus_per_worker)
    num_cpus = cfg.cluster.num_cpus or max(os.cpu_count() or 1, needed)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True)


def start_sandbox_pool(cfg: DictConfig):
    """The sandbox actors code rewards send their jobs to (None when sandbox.num_workers=0)."""
    if cfg.sandbox.num_workers < 1:
        return None
    from sandbox.pool import SandboxPool, SandboxSettings

    pool = SandboxPool(SandboxSettings(**OmegaConf.to_container(cfg.sandbox, resolve=True)))
    print(f"Sandbox workers: {', '.join(pool.placement)}")
    return pool


def reward_specs(cfg: DictConfig | TrainConfig):
    """The reward functions of the config (Hydra's or its typed form), as plain data."""
    from reward.scorer import RewardFunctionSpec

    def plain(kwargs: Any) -> dict[str, Any]:
        return OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)

    return [RewardFunctionSpec(f.fn, f.weight, f.name, plain(f.kwargs)) for f in cfg.reward.functions]


def build_components(cfg: TrainConfig):
    """The rollout fleet, reward service and learner group the run's typed config describes."""
    from launch.console import actor_env, rollout_env
    from reward.service import RewardService
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env
    from trainer.group import LearnerGroup
    from trainer.learner import LearnerSpec

    threads, c = worker_threads(cfg), cfg.cluster
    env = rollout_env(threads, c.gpus_per_rollout_worker > 0)
    if cfg.rollout.backend == "vllm":
        env.update(vllm_env(cfg.rollout.kv_cache_gib, threads))
    fleet = RolloutFleet(RolloutSpec.from_config(cfg, threads), num_cpus=1, num_gpus=c.gpus_per_rollout_worker,
                         env_vars=env)
    rewards = RewardService(reward_specs(cfg), num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                            base_dir=os.getcwd())
    learner = LearnerGroup(LearnerSpec.from_config(cfg, threads), cfg.trainer.num_workers, num_cpus=1,
                           num_gpus=c.gpus_per_learner, env_vars=actor_env(threads, c.gpus_per_learner > 0),
                           weight_sync_method=cfg.trainer.weight_sync)
    learner.connect(fleet)
    return fleet, rewards, learner


def reward_trend(history: list[dict[str, float]], k: int = 5) -> dict[str, Any]:
    """Mean reward (and each reward function's mean) over the first and the last k steps."""
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    k = min(k, len(rewards) // 2) or 1
    out: dict[str, Any] = {"first_steps_reward_mean": statistics.fmean(rewards[:k]),
                           "last_steps_reward_mean": statistics.fmean(rewards[-k:]), "steps_averaged": k}
    names = sorted({key for m in history for key in m if key.startswith("reward/") and key.endswith("_mean")})
    for key in names:
        values = [m[key] for m in history if key in m]
        if len(values) >= 2:
            name = key.removeprefix("reward/").removesuffix("_mean")
            out.setdefault("components", {})[name] = {
                "first_steps_mean": statistics.fmean(values[:k]), "last_steps_mean": statistics.fmean(values[-k:])}
    return out


def load_inputs(cfg: DictConfig):
    """Everything read from the user's files, checked before Ray starts: the reward functions
    (imported here once, so a bad name fails in seconds), the tokenizer and the prompts."""
    from transformers import AutoTokenizer

    from reward.scorer import RewardScorer
    from rl.data import PromptDataset

    RewardScorer(reward_specs(cfg), base_dir=os.getcwd())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    data = PromptDataset(cfg.task.train_files, cfg.task.prompt_key, tokenizer, cfg.run.seed,
                         cfg.rollout.max_model_len - cfg.rollout.max_new_tokens)
    data.requests(0, 1, 1)  # tokenizes one prompt: length and column problems surface now
    return tokenizer, data


# Keys that may change when a run is resumed (extend it with more steps, watch it differently).
RESUMABLE_CHANGES = ("run.steps", "run.resume", "run.progress", "run.save_every", "run.keep_checkpoints")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def check_run_dir(cfg: DictConfig):
    """Refuse to write over a finished or running run; on resume, find its checkpoint and check
    the config is the one it was started with. Returns (checkpoint path, LoopState) or None."""
    from rl import checkpoint

    saved_path = os.path.join(cfg.run.dir, "config.yaml")
    if not cfg.run.resume:
        if os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl")):
            raise ConfigError(
                f"run.dir={cfg.run.dir} already holds a run; continue it with run.resume=true, "
                "or choose another run.dir"
            )
        return None
    found = checkpoint.latest(cfg.run.dir)
    if found is None or not os.path.exists(saved_path):
        raise ConfigError(f"run.resume=true but run.dir={cfg.run.dir} holds no checkpoint to resume from")
    saved = _flat(OmegaConf.to_container(OmegaConf.load(saved_path)))
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise ConfigError(
            "run.resume=true with a config that differs from the saved run in: "
            + ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in changed)
            + f"; pass the original overrides again (see {saved_path}). Only {', '.join(RESUMABLE_CHANGES)} may change"
        )
    if found[1].next_step >= cfg.run.steps:
        raise ConfigError(f"run.steps={cfg.run.steps}: the run already finished step {found[1].next_step}; "
                          "raise run.steps to train further")
    return found


def train(cfg: DictConfig, inputs=None, resume_from=None) -> dict[str, float]:
    """Run one experiment from a validated, path-resolved config; returns the run summary."""
    import ray

    from rl.loop import run_loop
    from rl.run_log import RunLog, read_metrics
    from trainer.sft import pad_id_of

    tokenizer, data = inputs or load_inputs(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)  # typed, plain data: what the actors are built from
    start_step, kl_state = (resume_from[1].next_step, resume_from[1].kl_ctrl) if resume_from else (0, None)
    log = RunLog(cfg.run.dir, cfg.run.steps, title=cfg.algorithm.name.upper(), progress=cfg.run.progress,
                 start_step=start_step, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                 resume=resume_from is not None)
    start_ray(cfg)
    fleet = rewards = learner = sandboxes = None
    try:
        sandboxes = start_sandbox_pool(cfg)
        fleet, rewards, learner = build_components(config)
        if resume_from is not None:
            path, state = resume_from
            learner.load_checkpoint(os.path.join(path, "learner"))
            learner.sync_weights(fleet, state.policy_version)  # engines started from model.path
            log.write(f"Resumed {cfg.run.dir} from {path}: next step {start_step + 1}")
        run_loop(config, pad_id_of(tokenizer), data, fleet, rewards, learner, log, start_step=start_step,
                 kl_state=kl_state)
        summary = reward_trend(read_metrics(cfg.run.dir))
        if cfg.run.save_final_model:
            final = os.path.join(cfg.run.dir, "final_model")
            learner.save_pretrained(final)
            tokenizer.save_pretrained(final)
            summary["final_model"] = final
        summary = log.finish(summary)
        print(
            f"Reward mean: first {summary['steps_averaged']} steps {summary['first_steps_reward_mean']:.3f} -> "
            f"last {summary['steps_averaged']} steps {summary['last_steps_reward_mean']:.3f}. "
            f"Run directory: {cfg.run.dir}"
        )
        for name, trend in summary.get("components", {}).items():
            print(f"  {name}: first steps {trend['first_steps_mean']:.3f} -> last steps {trend['last_steps_mean']:.3f}")
        return summary
    finally:
        log.close()
        for part in (learner, rewards, fleet):
            if part is not None:
                part.shutdown()
        if sandboxes is not None:
            sandboxes.close()
        ray.shutdown()


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    quiet_driver()
    try:
        validate(cfg)
        check_host(cfg)
        ensure_inputs(cfg)
        resolve_paths(cfg)
        resume_from = check_run_dir(cfg)
        inputs = load_inputs(cfg)
    except INPUT_ERRORS as err:  # RewardLoadError and DataError are ValueErrors
        fail(err)
    train(cfg, inputs, resume_from)


if __name__ == "__main__":
    main()
