"""DeepSpeed plumbing shared by the RL learner and the supervised trainers (SFT, reward model).

- `ds_config`: the DeepSpeed config dict for a ZeRO stage, precision and batch geometry;
- `init_single_process`: a world-size-1 process group (gloo on CPU) for trainers that run as one
  plain process rather than as Ray actors;
- `build_engine`: model + torch AdamW + lr schedule wrapped by `deepspeed.initialize`, with the
  ZeRO-3 detail that the model must be *loaded* while the DeepSpeed config is registered;
- `full_state_dict`: whole weights on CPU (gathered under ZeRO-3), for `save_pretrained`;
- `save_pretrained_atomic`: a transformers model folder that is either complete or absent.

DeepSpeed is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

import torch

from trainer.build_locks import await_build_locks
from trainer.zero_grads import keep_fp32_gradients


def import_deepspeed():
    """`import deepspeed` without the optional MLflow import of DeepSpeed's autotuner (never used
    here): MLflow and the pandas it pulls in cost every learner process 1.4 s of start-up on 2
    cores. MLflow stays importable afterwards (the run's MLflow logger is in the driver)."""
    blocked = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if blocked:  # the placeholder only: nothing could import the real MLflow meanwhile
            del sys.modules["mlflow"]
    return deepspeed


def ds_config(
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    zero_stage: int,
    dtype: str,
    max_grad_norm: float | None = None,
    offload_optimizer: bool = False,
    zero3_persistence_threshold: int = 0,
) -> dict[str, Any]:
    """DeepSpeed config for one engine. `max_grad_norm=None` (e.g. a frozen reference model)
    leaves gradient clipping out; optimizer offload only applies to an engine that trains."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        # DeepSpeed's default (1e5) keeps small tensors whole on every rank: tiny models would
        # never be partitioned at all.
        zero["stage3_param_persistence_threshold"] = zero3_persistence_threshold
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    clipping = {"gradient_clipping": max_grad_norm} if max_grad_norm is not None else {}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        **clipping,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's own Adam compiles (minutes) on CPU
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")


@contextlib.contextmanager
def restored_dist_env() -> Iterator[None]:
    """Undo `init_single_process`'s environment variables on exit (the process group stays), so
    processes started later from this one (e.g. Ray workers) do not inherit RANK, LOCAL_RANK...;
    also forget transformers' global ZeRO-3 config, so later `from_pretrained` calls load whole."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    try:
        yield
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # a ZeRO-3 engine's config must not leak into later model loads
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def init_single_process() -> None:
    """Join (or create) a world-size-1 torch.distributed group for a one-process DeepSpeed engine.

    Reuses an existing group (a second trainer in the same process). Refuses to run under a
    multi-process launcher: these trainers do not shard their data over ranks. Sets the env
    variables DeepSpeed reads (RANK, LOCAL_RANK, ...); wrap in `restored_dist_env()` to undo that.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"torch.distributed already has world size {dist.get_world_size()}; the supervised "
                "trainers run as a single process (launch them with python, not a multi-rank launcher)"
            )
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # deepspeed.initialize reads them
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise RuntimeError(
            f"WORLD_SIZE={world}: the supervised trainers run as a single process (one DeepSpeed "
            "rank); unset WORLD_SIZE and launch with python"
        )
    from rl.wire.collective import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    await_build_locks()  # before DeepSpeed builds its ops (torch would wait on a lock in silence)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo", auto_mpi_discovery=False, verbose=False
    )


def zero3_load_config(config: dict[str, Any]):
    """What transformers' `from_pretrained` must see while it loads the model of an engine with
    this DeepSpeed config: under ZeRO-3 an `HfDeepSpeedConfig` (weights are partitioned as they
    load instead of materialised whole; keep it alive with the engine), otherwise none.
    transformers keeps a process-global (weak) reference to the last one: an earlier ZeRO-3
    engine's is cleared first, or this model would load partitioned."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return HfDeepSpeedConfig(config) if config["zero_optimization"]["stage"] == 3 else None


def build_engine(
    load_model: Callable[[], torch.nn.Module],
    config: dict[str, Any],
    *,
    lr: float,
    weight_decay: float,
    lr_lambda: Callable[[int], float],
    gradient_checkpointing: bool = False,
):
    """`deepspeed.initialize` on the model `load_model()` returns, with torch AdamW and a LambdaLR,
    in the process group the caller has joined (`init_single_process`, or a learner's ranks).

    `load_model` runs under `zero3_load_config(config)`. Returns the engine (`.module`: the model).
    """
    deepspeed = import_deepspeed()

    keep_alive = zero3_load_config(config)
    model = load_model()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # fused: one multi-threaded pass over ZeRO's flat fp32 partition. The default CPU AdamW runs op
    # by op, each allocating a partition-sized temporary: 1.2 s of a 12.9 s bf16 SmolLM2 step on 2
    # cores, against 0.04-0.1 s fused (same update within 3e-8).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    engine._rlpost_hf_ds_config = keep_alive  # must outlive loading; kept with the engine
    keep_fp32_gradients(engine.optimizer)  # CPU ZeRO-1/2: one fp32 gradient buffer, not one per step
    return engine


def full_state_dict(module: torch.nn.Module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Every parameter whole, on CPU; under ZeRO-3 each is gathered in turn (one at a time, so a
    large model never needs a second full copy on one device)."""
    if zero_stage != 3:
        return {name: t.detach().cpu() for name, t in module.state_dict().items()}
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            out[name] = p.data.detach().cpu().clone()
    return out


def save_pretrained_atomic(model: Any, tokenizer: Any, path: str | os.PathLike,
                           state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`save_pretrained` of `model` (with `state_dict`, e.g. gathered from ZeRO-3 shards) and
    `tokenizer`, written to a temporary folder and renamed, so `path` is either complete or absent."""
    import shutil

    path = os.fspath(path)
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
