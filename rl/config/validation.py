"""The checks of a run's config that a type cannot express: ranges, choices, combinations, and
keys the schema does not know. Each bad field is named with its fix, all of them in one
`ConfigError`. Checks only: nothing here changes the config (a shorthand such as
`task.env=openenv:...` is expanded before, by the code it expands to; see `validate`).
No torch/ray imports here: the CLI must reject bad input in well under a second.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

from rl.config.algorithm_names import ALGORITHM_CHOICES, advantage_needs, advantages_needing
from rl.config.schema import LOGGERS, ConfigError, TrainConfig


def logger_errors(names: Iterable[str]) -> list[str]:
    """The config error for `run.loggers` naming an unknown sink (empty when all are known)."""
    names = list(names)
    unknown = [name for name in names if name not in LOGGERS]
    if not unknown:
        return []
    return [f"run.loggers={names}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(LOGGERS)}, "
            "e.g. run.loggers=[tensorboard,jsonl,wandb]"]


_CHOICES: dict[str, tuple[Any, ...]] = {
    **ALGORITHM_CHOICES,  # the names rl.algo's registries hold (rl/config/algorithm_names.py)
    "model.dtype": ("float32", "bfloat16"),
    "rollout.backend": ("vllm", "hf"),
    "rollout.mode": ("batch", "streaming"),
    "rollout.inflight_kv": ("keep", "recompute"),
    "trainer.zero_stage": (0, 1, 2, 3),
    "trainer.weight_sync": ("collective", "object_store", "ipc"),
    "eval.answer": ("", "final_answer"),  # rl/run/evaluate.py answer_extractor
    "sandbox.backend": ("process", "docker", "unsafe_local"),
    "cluster.placement": ("pack", "spread", "strict_pack", "strict_spread"),
    "trainer.shared_prefix": ("auto", "on", "off"),
    "trainer.cpu_allocator": ("jemalloc", "glibc"),  # launch/allocator.py ALLOCATORS
    "rollout.enforce_eager": (True, False, "auto"),
    "cluster.placement_mode": ("disaggregated", "hybrid"),
}

_POSITIVE = (
    "rollout.num_workers",
    "rollout.max_new_tokens",
    "rollout.max_model_len",
    "reward.num_workers",
    "task.prompts_per_step",
    "trainer.num_workers",
    "trainer.micro_batch_size",
    "algorithm.ppo_epochs",
    "algorithm.mini_batches",
    "run.steps",
    "run.keep_checkpoints",
    "sandbox.slots_per_worker",
)

# Numeric ranges a type cannot express: key -> (lowest, lowest allowed?, highest allowed or None, a
# good value to suggest). A value outside (NaN included) is reported with the range and the example.
_RANGES: dict[str, tuple[float, bool, float | None, str]] = {
    "rollout.n": (1, True, None, "8"),
    "rollout.top_p": (0, False, 1, "1.0"),
    "rollout.gpu_memory_utilization": (0, False, 1, "0.5"),
    "rollout.kv_cache_gib": (0, False, None, "1"),
    "rollout.max_restarts": (0, True, None, "3"),
    "trainer.delta_sync_max_fraction": (0, False, 1, "0.5"),
    "rollout.max_retries": (0, True, None, "2"),
    "rollout.tensor_parallel_size": (1, True, None, "1 (or the GPUs one engine spans, e.g. 2)"),
    "rollout.pause_timeout_s": (0, False, None, "300"),
    "task.agent_workers": (1, True, None, "16"),
    "task.agent_timeout_s": (0, False, None, "300"),
    "task.agent_memory_mb": (64, True, None, "2048"),
    "task.agent_max_processes": (1, True, None, "64"),
    "task.agent_reward_bound": (0, False, None, "1e6"),
    "task.agent_max_calls": (1, True, None, "1000"),
    "task.agent_port": (0, True, 65535, "0 (a free port)"),
    "rollout.temperature": (0, False, 2, "1.0"),  # vLLM refuses a temperature above 2
    "eval.temperature": (0, True, 2, "1.0 (0 = greedy)"),
    "reward.timeout_s": (0, False, None, "60"),
    "reward.max_failed_steps": (1, True, None, "3"),
    "reward.bound": (0, False, 1e30, "1e6"),  # within fp32's range (3.4e38), with room for sums
    "trainer.max_skipped_steps": (1, True, None, "3"),
    "sandbox.num_workers": (0, True, None, "0 (jobs run in the reward worker) or 2"),
    "sandbox.num_cpus_per_worker": (0, False, None, "1.0"),
    "sandbox.max_retries": (0, True, None, "2"),
    "cluster.threads_per_worker": (0, True, None, "0 (automatic)"),
    "cluster.worker_niceness": (0, True, 19, "0 (normal priority) or 15 (Ray's default)"),
    "cluster.gpus_per_rollout_worker": (0, True, None, "0 or 1"),
    "cluster.gpus_per_learner": (0, True, None, "0 or 1"),
    "run.save_every": (0, True, None, "20 (0 = never)"),
    "algorithm.off_policy_steps": (0, True, None, "0 (on-policy) or 1"),
    "algorithm.tis_cap": (1, True, None, "2.0"),
    "algorithm.seq_mask_low": (0, True, 1, "0.5"),
    "algorithm.mis_cap": (1, True, None, "2.0"),
    "algorithm.distill_coef": (0, True, 1, "1.0 (distillation alone) or 0.5"),
    "algorithm.icepop_low": (0, True, 1, "0.5"),
    "algorithm.icepop_high": (1, True, None, "5.0"),
    "algorithm.seq_mask_high": (1, True, None, "2.0"),
    "trainer.max_tokens_per_micro_batch": (0, True, None, "0 (rows) or 8192"),
    "cluster.peak_tflops": (0, True, None, "0 (measure) or 312"),
    "cluster.price_per_device_hour": (0, True, None, "0 or 2.5"),
    "cluster.memory_gib": (0, True, None, "0 (detect) or 24"),  # preflight plan
    "cluster.gpu_memory_gib": (0, True, None, "0 (detect) or 80"),  # preflight plan
    "run.log_samples_per_step": (0, True, None, "4"),
    "run.max_restarts": (0, True, None, "0"),
    "run.call_timeout_s": (0, False, None, "300"),
    "run.call_timeout_factor": (1, True, None, "10"),
    "run.start_timeout_s": (0, False, None, "900"),
}


def range_error(key: str, value: Any) -> str | None:
    """The message for `value` of `key` outside its `_RANGES` entry, else None."""
    low, low_ok, high, example = _RANGES[key]
    inside = (value >= low if low_ok else value > low) and (high is None or value <= high)
    if inside:
        return None
    if high is not None:
        bounds = f"in {'[' if low_ok else '('}{low}, {high}]"
    else:
        bounds = f"{'>=' if low_ok else '>'} {low}"
    return f"{key}={value}: must be {bounds}, e.g. {key}={example}"


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    import dataclasses
    import typing

    from omegaconf import DictConfig, ListConfig

    hints = typing.get_type_hints(schema)
    found = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        path = f"{prefix}{key}"
        if key not in hints:
            found.append(path)
            continue
        child, kind = node._get_node(key), hints[key]
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if dataclasses.is_dataclass(kind):
            found += unknown_keys(child, kind, path + ".")
        elif item is not None and dataclasses.is_dataclass(item) and isinstance(child, ListConfig):
            for i, element in enumerate(child):
                found += unknown_keys(element, item, f"{path}[{i}].")
    return found


def check_schema(cfg: Any, schema: type = TrainConfig, app: str = "train", where: str = "rl/config/schema.py") -> None:
    """Reject keys the schema does not know, also ones forced in with Hydra's `+key=value`."""
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; check the spelling against {where} "
            f"(`python -m launch.{app} --cfg job` prints every key)"
        )


def raise_errors(errors: list[str]) -> None:
    """One ConfigError listing every bad field with its fix (nothing when the list is empty)."""
    if errors:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(errors))


def _placement_mode_errors(cfg: Any) -> list[str]:
    """What hybrid placement (a learner rank and a rollout worker on each GPU) and the CUDA IPC
    weight sync it enables need."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    errors = []
    if t.delta_sync and t.weight_sync != "collective":
        errors.append(f"trainer.delta_sync sends changes over the collective weight sync; trainer.weight_sync="
                      f"{t.weight_sync} sends whole weights: set trainer.weight_sync=collective or trainer.delta_sync=false")
    if t.weight_sync == "ipc" and c.placement_mode != "hybrid":
        errors.append("trainer.weight_sync=ipc shares GPU memory between a learner rank and the rollout worker on "
                      "its GPU: set cluster.placement_mode=hybrid, or use trainer.weight_sync=collective")
    if c.placement_mode != "hybrid":
        return errors
    tp = r.tensor_parallel_size
    if r.num_workers * tp != t.num_workers:
        errors.append(f"cluster.placement_mode=hybrid pairs each learner rank with a rollout engine on its GPU: "
                      f"rollout.num_workers={r.num_workers} must equal trainer.num_workers={t.num_workers}"
                      + (f" / rollout.tensor_parallel_size={tp}" if tp > 1 else ""))
    if tp > 1:
        errors.append(f"rollout.tensor_parallel_size={tp} with cluster.placement_mode=hybrid is not supported yet: "
                      "use cluster.placement_mode=disaggregated for tensor-parallel rollouts")
    if c.gpus_per_learner != c.gpus_per_rollout_worker or c.gpus_per_learner not in (0, 1):
        errors.append(f"cluster.placement_mode=hybrid: a learner rank and its rollout worker share one GPU, so "
                      f"cluster.gpus_per_learner={c.gpus_per_learner:g} and cluster.gpus_per_rollout_worker="
                      f"{c.gpus_per_rollout_worker:g} must both be 1 (or both 0 on CPUs); Ray gives each half of it")
    if t.zero_stage == 0:
        errors.append("cluster.placement_mode=hybrid moves the learner's states to the host while the engine "
                      "generates, which DeepSpeed does for ZeRO stages 1-3 (offload_states): set trainer.zero_stage=1, "
                      "2 or 3")
    on_gpu = c.gpus_per_learner > 0
    if on_gpu and t.weight_sync == "collective":
        errors.append("trainer.weight_sync=collective cannot join two processes on one GPU (NCCL refuses them) in "
                      "cluster.placement_mode=hybrid: set trainer.weight_sync=ipc")
    if on_gpu and not r.sleep_between_steps:
        errors.append("cluster.placement_mode=hybrid needs rollout.sleep_between_steps=true: the engine frees the "
                      "GPU while its learner rank trains")
    if t.weight_sync == "ipc" and not on_gpu:
        errors.append("trainer.weight_sync=ipc moves weights by CUDA IPC: it needs cluster.gpus_per_learner=1 and "
                      "cluster.gpus_per_rollout_worker=1 (on CPUs use trainer.weight_sync=collective)")
    if t.weight_sync == "ipc" and cfg.model.lora.rank > 0:
        errors.append("trainer.weight_sync=ipc sends full weights, not LoRA adapters: set trainer.weight_sync="
                      "object_store with model.lora")
    if t.weight_sync == "ipc" and r.backend != "vllm":
        errors.append(f"trainer.weight_sync=ipc loads through vLLM's weight-transfer engine: rollout.backend="
                      f"{r.backend} cannot take it, use rollout.backend=vllm")
    return errors


def _shared_gpu_errors(cfg: Any) -> list[str]:
    """Disaggregated roles given a share of a GPU: Ray packs such shares from any actors onto one
    device, so a learner rank and an engine, or two learner ranks (NCCL refuses two members of one
    group on a device), or two engines (each asks vLLM for `gpu_memory_utilization` of the whole
    card) may land together."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    if c.placement_mode != "disaggregated":
        return []
    errors = []
    if 0 < c.gpus_per_learner < 1 and 0 < c.gpus_per_rollout_worker < 1 and t.weight_sync == "collective":
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g} and cluster.gpus_per_rollout_worker="
                      f"{c.gpus_per_rollout_worker:g} put a learner and a rollout worker on one GPU, where NCCL "
                      "refuses two members of the weight-sync group: set trainer.weight_sync=object_store, "
                      "or give each a whole GPU")
    if 0 < c.gpus_per_learner < 1 and t.num_workers > 1:
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g} with trainer.num_workers={t.num_workers}: "
                      "Ray may put two learner ranks on one GPU, where NCCL refuses two ranks of one group; set "
                      "cluster.gpus_per_learner=1")
    per_gpu = min(r.num_workers, math.floor(1 / c.gpus_per_rollout_worker + 1e-9)) \
        if 0 < c.gpus_per_rollout_worker < 1 else 1
    if per_gpu > 1 and t.weight_sync == "collective":
        errors.append(f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} with rollout.num_workers="
                      f"{r.num_workers}: Ray may put two rollout workers on one GPU, where NCCL refuses two members "
                      "of the weight-sync group; set cluster.gpus_per_rollout_worker=1, or "
                      "trainer.weight_sync=object_store")
    if per_gpu > 1 and per_gpu * r.gpu_memory_utilization > 0.95:  # the rest: each process's CUDA context
        errors.append(f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} with rollout.num_workers="
                      f"{r.num_workers} puts up to {per_gpu} engines on one GPU, each taking rollout."
                      f"gpu_memory_utilization={r.gpu_memory_utilization:g} of it; set rollout.gpu_memory_utilization"
                      f"={math.floor(95 / per_gpu) / 100:g} or cluster.gpus_per_rollout_worker=1")
    return errors


def _tensor_parallel_errors(cfg: Any) -> list[str]:
    """A tensor-parallel engine holds one whole GPU per TP rank (vLLM's workers, one per rank, in
    the rollout actor's bundle); one GPU or a share of one is an engine without tensor parallelism."""
    r, gpus = cfg.rollout, cfg.cluster.gpus_per_rollout_worker
    tp = r.tensor_parallel_size
    if tp < 1:  # reported by the range check
        return []
    errors = []
    if (gpus > 1 or tp > 1) and gpus not in (0, tp):
        fix = (f"set cluster.gpus_per_rollout_worker={tp} (or 0 on CPUs)" if tp > 1 else
               "set cluster.gpus_per_rollout_worker=1 and raise rollout.num_workers to use more GPUs"
               + (f", or rollout.tensor_parallel_size={gpus:g} for one engine over {gpus:g} GPUs"
                  if gpus == int(gpus) else ""))
        errors.append(f"cluster.gpus_per_rollout_worker={gpus:g} with rollout.tensor_parallel_size={tp}: a rollout "
                      f"engine holds one whole GPU per tensor-parallel rank; {fix}")
    if tp > 1 and r.backend != "vllm":
        errors.append(f"rollout.tensor_parallel_size={tp} needs rollout.backend=vllm (rollout.backend={r.backend} "
                      "generates on one device): set rollout.backend=vllm or rollout.tensor_parallel_size=1")
    return errors


def _ignore_eos_errors(cfg: Any) -> list[str]:
    """`rollout.ignore_eos` is vLLM's sampling option, for single-turn completions: an episode's
    turns end at EOS (the environment or agent answers then)."""
    r, t = cfg.rollout, cfg.task
    if not r.ignore_eos:
        return []
    errors = []
    if r.backend != "vllm":
        errors.append(f"rollout.ignore_eos=true is vLLM's sampling option: set rollout.backend=vllm (not {r.backend!r}) "
                      "or rollout.ignore_eos=false")
    if t.env or t.agent:
        errors.append(f"rollout.ignore_eos=true runs every completion to rollout.max_new_tokens, but the episodes of "
                      f"task.{'env' if t.env else 'agent'} end their turns at EOS: set rollout.ignore_eos=false")
    return errors


def _streaming_errors(cfg: Any) -> list[str]:
    """What `rollout.mode=streaming` needs: vLLM's AsyncLLM, engines that keep generating while the
    learner trains (never asleep) and a staleness bound that lets them run ahead."""
    r, a = cfg.rollout, cfg.algorithm
    if r.mode != "streaming":
        return []
    errors = []
    if r.backend != "vllm":
        errors.append(f"rollout.mode=streaming runs vLLM's AsyncLLM: set rollout.backend=vllm (not {r.backend!r}) "
                      "or rollout.mode=batch")
    if a.off_policy_steps < 1:
        errors.append("rollout.mode=streaming generates while the learner trains, so samples are up to "
                      "algorithm.off_policy_steps versions old (counted at their oldest token): set "
                      "algorithm.off_policy_steps=1 (or more)")
    if r.sleep_between_steps:
        errors.append("rollout.mode=streaming keeps the engines generating while the learner trains: they cannot "
                      "sleep; set rollout.sleep_between_steps=false (and cluster.placement_mode=disaggregated)")
    if cfg.trainer.weight_sync == "ipc":
        errors.append("rollout.mode=streaming loads weights through its engines' worker RPC: set "
                      "trainer.weight_sync=collective (or object_store)")
    return errors


def _task_rows_errors(t: Any) -> list[str]:
    """The task's own row settings (reasoning-gym's dataset names and configs are checked by
    launch.checks, which imports it); a system prompt needs the chat template it goes through."""
    errors = []
    if t.system_prompt and not t.chat_template:
        errors.append("task.system_prompt is set but task.chat_template=false: a system prompt is a chat message; "
                      "set task.chat_template=true, or put the instruction in the prompts")
    if t.datasets:
        if t.size < 1:
            errors.append(f"task.size={t.size}: task.datasets needs at least 1 training row, e.g. task.size=1000")
        if t.eval_size < 0:
            errors.append(f"task.eval_size={t.eval_size}: must be >= 0 (0 = no held-out rows)")
    return errors


def endpoint_address(text: str) -> tuple[str, int]:
    """("host", port) of a task.agent_endpoints entry ("host:port" or a URL); ValueError naming the
    fix when it has no host or no port (a URL's default port is taken: 80, 443)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text if "//" in text else f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    port = port or {"http": 80, "https": 443}.get(parts.scheme)
    if port is None or not host:
        raise ValueError(f"{text!r} has no host or no port: write host:port or http://host:port")
    return host, port


def validate(cfg: Any) -> None:
    """Raise ConfigError listing every bad field of a merged TrainConfig, with the fix. Reads the
    config only: a shorthand it may hold (`task.env=openenv:...`) is expanded before, by its
    caller (`launch.checks.check_inputs`, `rl.config.compose.compose(..., expand=...)`)."""
    check_schema(cfg)
    errors: list[str] = []
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            errors.append(f"{key}={_get(cfg, key)!r}: choose one of {', '.join(map(str, choices))}")
    for i, text in enumerate(cfg.task.agent_endpoints):
        try:
            endpoint_address(str(text))
        except ValueError as err:
            errors.append(f"task.agent_endpoints[{i}]={text!r}: {err}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            errors.append(f"{key}={_get(cfg, key)}: must be a positive integer")
    errors += filter(None, (range_error(key, _get(cfg, key)) for key in _RANGES))
    if cfg.cluster.num_cpus is not None and cfg.cluster.num_cpus <= 0:
        errors.append(f"cluster.num_cpus={cfg.cluster.num_cpus}: must be > 0, or null to count the actors")
    if 0 < cfg.rollout.max_model_len <= cfg.rollout.max_new_tokens:
        errors.append(
            f"rollout.max_model_len={cfg.rollout.max_model_len} leaves no room for a prompt before "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise rollout.max_model_len or lower "
            "rollout.max_new_tokens"
        )
    if 1 <= cfg.rollout.n < 2 and advantage_needs(cfg.algorithm.advantage, "group_ids"):
        errors.append(
            f"rollout.n={cfg.rollout.n}: group-relative advantages ({cfg.algorithm.advantage}) need at least 2 "
            "samples per prompt; set rollout.n=8 (or another value >= 2)"
        )
    c = cfg.cluster
    if c.gpus_per_learner > 1:
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g}: at most 1; a learner rank computes on one "
                      "GPU: raise trainer.num_workers to use more")
    errors += _tensor_parallel_errors(cfg)
    errors += _streaming_errors(cfg)
    errors += _ignore_eos_errors(cfg)
    errors += _agent_errors(cfg)
    errors += _task_rows_errors(cfg.task)
    errors += _placement_mode_errors(cfg)
    errors += _shared_gpu_errors(cfg)
    if cfg.algorithm.lr <= 0:
        errors.append(f"algorithm.lr={cfg.algorithm.lr}: must be > 0, e.g. algorithm.lr=1e-5")
    if cfg.algorithm.kl_coef < 0:
        errors.append(f"algorithm.kl_coef={cfg.algorithm.kl_coef}: must be >= 0 (0 disables the reference model)")
    if cfg.algorithm.router_aux_loss_coef < 0:
        errors.append(f"algorithm.router_aux_loss_coef={cfg.algorithm.router_aux_loss_coef}: must be >= 0 (0 = no "
                      "load-balancing loss), e.g. 0.001")
    batch = cfg.task.prompts_per_step * cfg.rollout.n
    per_update = cfg.algorithm.mini_batches * cfg.trainer.num_workers
    if cfg.algorithm.mini_batches > 0 and cfg.trainer.num_workers > 0 and batch % per_update:
        errors.append(
            f"task.prompts_per_step*rollout.n={batch} samples per step do not split evenly into "
            f"algorithm.mini_batches={cfg.algorithm.mini_batches} x trainer.num_workers="
            f"{cfg.trainer.num_workers}; change one of them so the product divides {batch}"
        )
    a = cfg.algorithm
    if advantage_needs(a.advantage, "values") and not a.critic:
        errors.append(f"algorithm.advantage={a.advantage} needs a value model: set algorithm.critic=true "
                      "(or use algorithm=ppo)")
    if a.critic and not advantage_needs(a.advantage, "values"):
        users = advantages_needing("values")
        errors.append(f"algorithm.critic=true is only used by advantage={' or '.join(users)}, not "
                      f"{a.advantage!r}; set algorithm.critic=false or algorithm.advantage={users[0]}")
    if a.dynamic_sampling and not advantage_needs(a.advantage, "group_ids"):
        errors.append("algorithm.dynamic_sampling needs group-relative advantages "
                      f"({' or '.join(advantages_needing('group_ids'))})")
    if a.kl_in_reward and a.kl_coef <= 0:
        errors.append("algorithm.kl_in_reward=true needs algorithm.kl_coef > 0")
    if a.policy_loss == "ppo_dual_clip" and a.clip_ratio_c <= 1:
        errors.append(f"algorithm.clip_ratio_c={a.clip_ratio_c}: dual clip needs a value > 1, e.g. 3.0")
    if not 0 <= a.overlong_buffer < cfg.rollout.max_new_tokens:
        errors.append(f"algorithm.overlong_buffer={a.overlong_buffer}: must be in [0, rollout.max_new_tokens="
                      f"{cfg.rollout.max_new_tokens})")
    if a.kl_ctrl == "adaptive" and not (a.kl_target > 0 and a.kl_horizon > 0):
        errors.append(f"algorithm.kl_ctrl=adaptive needs algorithm.kl_target > 0 and algorithm.kl_horizon > 0 "
                      f"(got {a.kl_target}, {a.kl_horizon}), e.g. kl_target=0.01 kl_horizon=10000")
    if a.off_policy_steps > 0 and cfg.rollout.sleep_between_steps:
        errors.append(f"algorithm.off_policy_steps={a.off_policy_steps} generates while the learner trains, "
                      "so the rollout engines cannot sleep then: set rollout.sleep_between_steps=false "
                      "or algorithm.off_policy_steps=0")
    if a.max_sampling_rounds < 1:
        errors.append(f"algorithm.max_sampling_rounds={a.max_sampling_rounds}: must be at least 1")
    if not cfg.reward.functions and not cfg.task.env and not cfg.task.agent:
        errors.append("reward.functions is empty: name at least one, e.g. reward=arith or "
                      "'reward.functions=[{fn: my_rewards.py:score}]' (or an environment that rewards: task.env, "
                      "or an agent that returns its reward: task.agent)")
    errors += _episode_errors(cfg)
    errors += _lora_errors(cfg)
    errors += logger_errors(cfg.run.loggers)
    for i, fn in enumerate(cfg.reward.functions):
        if ":" not in fn.fn:
            errors.append(
                f"reward.functions[{i}].fn={fn.fn!r}: expected 'package.module:function' or "
                "'path/to/file.py:function'"
            )
    raise_errors(errors)


def _agent_errors(cfg: Any) -> list[str]:
    """What `task.agent` needs: one kind of episode, and engines that take calls as they come."""
    t, r = cfg.task, cfg.rollout
    if not t.agent:
        return [f"task.agent_python={t.agent_python!r} runs task.agent, which is not set: set task.agent, or "
                "task.agent_python=''"] if t.agent_python else []
    errors = []
    if ":" not in t.agent:
        errors.append(f"task.agent={t.agent!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    if t.env:
        errors.append(f"task.env={t.env!r} and task.agent={t.agent!r}: an episode comes from one of them; set the "
                      "other to null")
    if r.backend != "vllm":
        errors.append(f"task.agent serves the agents' calls as they come, which vLLM's AsyncLLM batches: set "
                      f"rollout.backend=vllm (not {r.backend!r})")
    if r.sleep_between_steps:
        errors.append("task.agent keeps the engines serving calls (they never sleep): set "
                      "rollout.sleep_between_steps=false")
    if not t.agent_host.strip():
        errors.append("task.agent_host is empty: use 127.0.0.1 (this machine only) or an address of this machine")
    if t.agent_python and not (os.path.isfile(t.agent_python) and os.access(t.agent_python, os.X_OK)):
        errors.append(f"task.agent_python={t.agent_python!r} is not an executable file: name a Python interpreter, "
                      "e.g. /path/to/venv/bin/python (python -m venv /path/to/venv makes one)")
    return errors


def _lora_errors(cfg: Any) -> list[str]:
    lora = cfg.model.lora
    if lora.rank == 0:
        return []
    errors = []
    if lora.rank < 0:
        errors.append(f"model.lora.rank={lora.rank}: must be >= 0 (0 = full fine-tuning), e.g. model.lora.rank=8")
    if lora.alpha <= 0:
        errors.append(f"model.lora.alpha={lora.alpha}: must be > 0, e.g. model.lora.alpha=16")
    if not 0 <= lora.dropout < 1:
        errors.append(f"model.lora.dropout={lora.dropout}: must be in [0, 1), e.g. model.lora.dropout=0.0")
    if not lora.target_modules:
        errors.append("model.lora.target_modules is empty: name the linear layers to adapt, e.g. "
                      "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    return errors


def _episode_errors(cfg: Any) -> list[str]:
    """Checks of the multi-turn (`task.env`) and evaluation keys."""
    t, e, errors = cfg.task, cfg.eval, []
    if t.env is not None:
        target, _, attr = t.env.rpartition(":")
        if not target or ":" in target or not all(part.isidentifier() for part in attr.split(".")):
            shorthand = " (a shorthand such as openenv:... is expanded before validation)" if ":" in target else ""
            errors.append(f"task.env={t.env!r}: expected 'package.module:Class' or 'path/to/file.py:Class'"
                          + shorthand)
    for key, value in (("task.max_turns", t.max_turns), ("task.env_workers", t.env_workers),
                       ("task.max_observation_tokens", t.max_observation_tokens), ("eval.max_rows", e.max_rows)):
        if value < 1:
            errors.append(f"{key}={value}: must be a positive integer")
    if not t.env_timeout_s > 0:
        errors.append(f"task.env_timeout_s={t.env_timeout_s}: must be > 0 seconds, e.g. 60")
    if t.max_episode_tokens < 0:
        errors.append(f"task.max_episode_tokens={t.max_episode_tokens}: must be >= 0 (0 = up to rollout.max_model_len)")
    if t.observation_role not in ("tool", "user"):
        errors.append(f"task.observation_role={t.observation_role!r}: choose tool or user")
    if t.env and cfg.algorithm.overlong_buffer > 0:
        errors.append("algorithm.overlong_buffer penalises single completions near rollout.max_new_tokens; an "
                      "episode's length is limited by task.max_episode_tokens instead: set algorithm.overlong_buffer=0")
    if e.every_steps < 0:
        errors.append(f"eval.every_steps={e.every_steps}: must be >= 0 (0 = no evaluation)")
    if e.every_steps > 0 and not e.files and not (cfg.task.datasets and cfg.task.eval_size > 0):
        errors.append(f"eval.every_steps={e.every_steps} needs held-out rows: set eval.files=[path/to/test.jsonl] "
                      "(or eval.every_steps=0)")
    if e.n < 0:
        errors.append(f"eval.n={e.n}: must be >= 0 (0 = greedy answers only, no sampled ones)")
    a = cfg.algorithm
    if a.distill_coef > 0 and not a.teacher_path:
        errors.append(f"algorithm.distill_coef={a.distill_coef} distils from a teacher: set algorithm.teacher_path="
                      "<model folder or Hub id> (a model with the student's tokenizer)")
    if a.teacher_path and a.distill_coef <= 0:
        errors.append(f"algorithm.teacher_path={a.teacher_path!r} loads a teacher that algorithm.distill_coef=0 "
                      "never uses: set algorithm.distill_coef (1.0: distillation alone) or drop the teacher")
    if t.curriculum_epochs < 0:
        errors.append(f"task.curriculum_epochs={t.curriculum_epochs}: must be >= 0 (0 = no curriculum)")
    if t.curriculum_epochs > 0 and cfg.rollout.mode == "streaming":
        errors.append("task.curriculum_epochs sets prompts aside by their scored groups, which rollout.mode=streaming "
                      "draws ahead of: use rollout.mode=batch (algorithm.off_policy_steps works with it) or "
                      "task.curriculum_epochs=0")
    for k in e.k:
        if not 1 <= k <= max(e.n, 0):
            errors.append(f"eval.k={list(e.k)}: pass@{k} and maj@{k} need {k} sampled completions per row, and "
                          f"eval.n={e.n} samples {e.n}: set eval.n >= {k} or leave {k} out of eval.k")
    return errors
