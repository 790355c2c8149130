"""`python -m launch.train [group=option ...] [key=value ...]`: one GRPO run as a Hydra app.

Bad config fails here, before Ray or any model starts: Hydra checks keys and types against
`rl.config.TrainConfig`, then `rl.config.validate` checks ranges. Heavy imports come after that.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rl.config import ConfigError, TrainConfig, validate
from sandbox.backend import SandboxUnavailable

BUILTIN_MODEL_PATH = os.path.normpath("artifacts/tiny/model")
BUILTIN_CODE_MODEL_PATH = os.path.normpath("artifacts/tiny_code/model")

ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


# Default model paths that `launch.train` builds itself on first use, with their builders.
BUILTIN_MODELS = {
    BUILTIN_MODEL_PATH: ("tiny model and arithmetic task", "launch.prepare_tiny", "prepare_tiny"),
    BUILTIN_CODE_MODEL_PATH: ("tiny code model and code speed-up task", "launch.prepare_tiny_code", "build_tiny_code"),
    os.path.normpath("artifacts/tiny_rm/model"): ("tiny reward model and preference task", "launch.prepare_tiny_rm", "build_tiny_rm"),
}


def ensure_model(cfg: DictConfig) -> None:
    """Build a built-in tiny model and its task data when its default path is used and missing
    (the policy's, and a built-in reward model named by a reward function's `path`), before Ray
    starts."""
    for f in cfg.reward.functions:
        path = f.kwargs.get("path") if f.kwargs else None
        if isinstance(path, str) and os.path.normpath(path) in BUILTIN_MODELS and not os.path.isdir(path):
            _build_builtin(os.path.normpath(path), cfg.run.seed)
    if os.path.isdir(cfg.model.path):
        return
    path = os.path.normpath(cfg.model.path)
    if path not in BUILTIN_MODELS:
        raise ConfigError(
            f"model.path={cfg.model.path!r} does not exist; give a local Hugging Face model folder "
            f"(config.json + weights + tokenizer), or leave the default {BUILTIN_MODEL_PATH!r} to use "
            "the built-in tiny model"
        )
    _build_builtin(path, cfg.run.seed)


def _build_builtin(path: str, seed: int) -> None:
    what, module, function = BUILTIN_MODELS[path]
    print(f"Building the built-in {what} in {os.path.dirname(path)}/ (first run only)")
    getattr(importlib.import_module(module), function)(os.path.dirname(path), seed=seed)


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


def reward_specs(cfg: DictConfig):
    from reward.scorer import RewardFunctionSpec

    return [RewardFunctionSpec(f.fn, f.weight, f.name, OmegaConf.to_container(f.kwargs, resolve=True))
            for f in cfg.reward.functions]


def build_components(cfg: DictConfig):
    from reward.service import RewardService
    from rollout.fleet import RolloutFleet
    from rollout.protocol import SamplingConfig
    from rollout.vllm_engine import vllm_env
    from trainer.group import LearnerGroup
    from trainer.learner import LearnerSpec

    threads = worker_threads(cfg)
    gpu = cfg.cluster.gpus_per_rollout_worker > 0
    # vLLM warns at every in-place reload that RotaryEmbedding got no weights (its cos/sin cache
    # is derived, not trained, and is kept): keep the console for the per-step summary.
    quiet = {"PYTHONWARNINGS": "ignore::FutureWarning"}
    rollout_env = {"OMP_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "ERROR", **quiet}
    if cfg.rollout.backend == "vllm":
        rollout_env.update(vllm_env(cfg.rollout.kv_cache_gib, threads))
    fleet = RolloutFleet(
        cfg.rollout.backend,
        cfg.model.path,
        cfg.rollout.num_workers,
        engine_kwargs=dict(
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            seed=cfg.run.seed,
            enforce_eager=cfg.rollout.enforce_eager,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            threads=threads,
            sleep_mode=cfg.rollout.sleep_between_steps and gpu,
        ) if cfg.rollout.backend == "vllm" else dict(dtype=cfg.model.dtype, threads=threads),
        sampling=SamplingConfig(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens),
        num_cpus=1,
        num_gpus=cfg.cluster.gpus_per_rollout_worker,
        env_vars=rollout_env,
    )
    rewards = RewardService(
        reward_specs(cfg),
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        base_dir=os.getcwd(),
    )
    a = cfg.algorithm
    spec = LearnerSpec(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        zero_stage=cfg.trainer.zero_stage,
        micro_batch_size=cfg.trainer.micro_batch_size,
        samples_per_step=cfg.task.prompts_per_step * cfg.rollout.n,
        mini_batches=a.mini_batches,
        ppo_epochs=a.ppo_epochs,
        lr=a.lr,
        lr_warmup_steps=a.lr_warmup_steps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm,
        policy_loss=a.policy_loss,
        loss_agg=a.loss_agg,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coef=a.entropy_coef,
        max_response_len=cfg.rollout.max_new_tokens,
        kl_in_reward=a.kl_in_reward,
        ref_offload=cfg.trainer.ref_offload,
        critic=a.critic,
        critic_init=a.critic_init,
        critic_lr=a.critic_lr,
        critic_warmup_steps=a.critic_warmup_steps,
        value_clip=a.value_clip,
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        offload_optimizer=cfg.trainer.offload_optimizer,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        zero3_persistence_threshold=cfg.trainer.zero3_persistence_threshold,
        threads=threads,
    )
    learner = LearnerGroup(
        spec,
        cfg.trainer.num_workers,
        num_cpus=1,
        num_gpus=cfg.cluster.gpus_per_learner,
        env_vars={"OMP_NUM_THREADS": str(threads), **quiet},
        weight_sync_method=cfg.trainer.weight_sync,
    )
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

    if cfg.sandbox.num_workers > 0 and cfg.sandbox.backend == "process" and not cfg.cluster.address:
        # The sandbox workers will run on this machine: no isolation, no untrusted code.
        from sandbox.detect import probe_host, require_isolation

        require_isolation(probe_host())

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

    from rl.estimate import AdvantageSettings
    from rl.loop import LoopSettings, run_loop
    from rl.run_log import RunLog, read_metrics

    tokenizer, data = inputs or load_inputs(cfg)
    os.makedirs(cfg.run.dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(cfg.run.dir, "config.yaml"), resolve=True)
    start_step, kl_state = 0, None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start_ray(cfg)
    fleet = rewards = learner = sandboxes = None
    try:
        sandboxes = start_sandbox_pool(cfg)
        fleet, rewards, learner = build_components(cfg)
        if resume_from is not None:
            path, state = resume_from
            learner.load_checkpoint(os.path.join(path, "learner"))
            learner.sync_weights(fleet, state.policy_version)  # engines started from model.path
            start_step, kl_state = state.next_step, state.kl_ctrl
            print(f"Resumed {cfg.run.dir} from {path}: next step {start_step + 1}")
        log = RunLog(cfg.run.dir, cfg.run.steps, progress=cfg.run.progress, start_step=start_step)
        a = cfg.algorithm
        settings = LoopSettings(
            steps=cfg.run.steps,
            prompts_per_step=cfg.task.prompts_per_step,
            n=cfg.rollout.n,
            pad_id=pad_id,
            advantage=AdvantageSettings(a.advantage, a.norm_by_std, a.gamma, a.lam, a.kl_in_reward,
                                        a.kl_estimator, a.whiten_advantages),
            kl_coef=a.kl_coef,
            kl_ctrl=a.kl_ctrl,
            kl_target=a.kl_target,
            kl_horizon=a.kl_horizon,
            max_new_tokens=cfg.rollout.max_new_tokens,
            dynamic_sampling=a.dynamic_sampling,
            max_sampling_rounds=a.max_sampling_rounds,
            overlong_buffer=a.overlong_buffer,
            overlong_penalty=a.overlong_penalty,
            mask_truncated=a.mask_truncated,
            log_samples_per_step=cfg.run.log_samples_per_step,
            logprob_warn_threshold=cfg.trainer.logprob_warn_threshold,
            sleep_between_steps=cfg.rollout.sleep_between_steps,
            save_every=cfg.run.save_every,
            keep_checkpoints=cfg.run.keep_checkpoints,
        )
        try:
            run_loop(settings, data, fleet, rewards, learner, log, start_step=start_step, kl_state=kl_state)
        finally:
            log.close()
        summary = reward_trend(read_metrics(cfg.run.dir))
        if cfg.run.save_final_model:
            final = os.path.join(cfg.run.dir, "final_model")
            learner.save_pretrained(final)
            tokenizer.save_pretrained(final)
            summary["final_model"] = final
        with open(os.path.join(cfg.run.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"Reward mean: first {summary['steps_averaged']} steps {summary['first_steps_reward_mean']:.3f} -> "
            f"last {summary['steps_averaged']} steps {summary['last_steps_reward_mean']:.3f}. "
            f"Run directory: {cfg.run.dir}"
        )
        for name, trend in summary.get("components", {}).items():
            print(f"  {name}: first steps {trend['first_steps_mean']:.3f} -> last steps {trend['last_steps_mean']:.3f}")
        return summary
    finally:
        for part in (learner, rewards, fleet):
            if part is not None:
                part.shutdown()
        if sandboxes is not None:
            sandboxes.close()
        ray.shutdown()


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
        ensure_model(cfg)
        resolve_paths(cfg)
        resume_from = check_run_dir(cfg)
        inputs = load_inputs(cfg)
    except (ConfigError, ValueError, FileNotFoundError, SandboxUnavailable) as err:  # RewardLoadError: a ValueError
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    train(cfg, inputs, resume_from)


if __name__ == "__main__":
    main()
