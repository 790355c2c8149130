"""How a learner rank is set up: what it is built from (`LearnerSpec`), how its steps are cut
(`batch_geometry`, the same geometry the memory planner uses), and its DeepSpeed engines (the
policy, with LoRA adapters if asked; the frozen reference; the critic), built once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from rl.config.schema import AlgorithmConfig, ModelConfig, TrainConfig, TrainerConfig
from rl.plan.devices import collective_backend, local_device_index
from rl.plan.geometry import BatchGeometry
from trainer.build_locks import await_build_locks
from trainer.cpu_attention import EAGER_MAX_SLOTS, use_training_attention
from trainer.engine import build_engine, ds_config, import_deepspeed, zero3_load_config
from trainer.logprobs import packing_matches, prefix_sharing_matches


def assigned_gpus() -> list:
    """The GPUs Ray gave this actor (none outside Ray)."""
    import ray

    return ray.get_gpu_ids() if ray.is_initialized() else []


@dataclass
class LearnerSpec:
    """What a rank builds its engines from: the run's typed config sections as they are, plus the
    few numbers derived from other sections (plain data: it crosses a Ray boundary)."""

    model: ModelConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    samples_per_step: int  # task.prompts_per_step * rollout.n: rows of every TrainBatch (fixes accumulation)
    max_response_len: int  # rollout.max_new_tokens: the generation budget (seq_mean_token_sum_norm)
    temperature: float  # rollout.temperature: log-probs are those of the distribution sampled from
    seed: int  # run.seed
    threads: int = 0  # torch threads per rank (cluster.threads_per_worker, resolved on the driver)
    peak_tflops: float = 0.0  # cluster.peak_tflops; 0 = measure this rank's matmul peak at its first update

    @classmethod
    def from_config(cls, cfg: TrainConfig, threads: int = 0) -> LearnerSpec:
        return cls(cfg.model, cfg.algorithm, cfg.trainer, samples_per_step=cfg.task.prompts_per_step * cfg.rollout.n,
                   max_response_len=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                   seed=cfg.run.seed, threads=threads, peak_tflops=cfg.cluster.peak_tflops)

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the old policy's log-probs need a forward pass of their own before the update.
        With one update per step (one epoch, one mini-batch) the training forward's own log-probs,
        detached, are exactly the pre-update policy's, as long as nothing needs them before the
        update (a KL penalty in the reward does)."""
        a = self.algorithm
        return a.ppo_epochs > 1 or a.mini_batches > 1 or (a.kl_in_reward and a.kl_coef > 0)


def batch_geometry(spec: LearnerSpec, world_size: int) -> BatchGeometry:
    """How this run's steps are cut over `world_size` ranks (rl/plan/geometry.py; the memory
    planner reads the same geometry from the config)."""
    return BatchGeometry(spec.samples_per_step, world_size, spec.algorithm.mini_batches, spec.trainer.micro_batch_size,
                         max_tokens_per_micro_batch=spec.trainer.max_tokens_per_micro_batch)


def deepspeed_config(spec: LearnerSpec, world_size: int, with_optimizer: bool = True) -> dict[str, Any]:
    geometry = batch_geometry(spec, world_size)
    return ds_config(
        micro_batch_size=geometry.micro_batch_examples,
        gradient_accumulation_steps=geometry.accumulation_steps,
        zero_stage=spec.trainer.zero_stage,
        dtype=spec.model.dtype,
        max_grad_norm=spec.algorithm.max_grad_norm if with_optimizer else None,
        offload_optimizer=spec.trainer.offload_optimizer and with_optimizer,
        zero3_persistence_threshold=spec.trainer.zero3_persistence_threshold,
    )


@dataclass
class LearnerModels:
    engine: Any  # the policy's DeepSpeed engine
    ref: Any  # the reference policy's engine (None: no KL, or LoRA, where it is the policy with adapters off)
    critic: Any  # the value model's engine (None without algorithm.critic)
    pack: bool  # padding-free micro-batches hold for this model
    share: str  # trainer.shared_prefix as run: "off" where the model cannot (trainer/layouts.py)
    lora: bool
    dtype: torch.dtype
    teacher: Any = None  # the teacher's engine (on-policy distillation, algorithm.teacher_path)
    # the longest shared-prefix bin the planner may fill with several trees: the plain attention's
    # limit where the policy computes with it (trainer/cpu_attention.py), else no limit
    max_bin_slots: int | None = None


def join_data_parallel(spec: LearnerSpec, rank: int, world_size: int, device_kind: str, master_addr: str,
                       master_port: int) -> torch.device:
    """Join the data-parallel group (DeepSpeed's, over NCCL or gloo); returns this rank's device."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        LOCAL_RANK=str(local_device_index(assigned_gpus(), dict(os.environ))),  # 0: Ray shows us only ours
        WORLD_SIZE=str(world_size),
    )
    if device_kind == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    if spec.threads:
        torch.set_num_threads(spec.threads)
    # before DeepSpeed builds its ops: torch would wait on a build lock in silence and without end
    await_build_locks(lambda line: print(f"learner rank {rank}: {line}", flush=True))
    deepspeed = import_deepspeed()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device_kind == "cuda" else torch.device("cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend=collective_backend(device_kind))
    return device


def build_models(spec: LearnerSpec, rank: int, world_size: int, device: torch.device) -> LearnerModels:
    """Every rank at once (DeepSpeed's set-up is collective)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    dtype = getattr(torch, spec.model.dtype)
    use_lora = spec.model.lora.rank > 0
    engine = _trainable(spec, lambda: _with_adapters(AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=dtype),
                                                     spec.model.lora),
                        deepspeed_config(spec, world_size), spec.algorithm.lr)
    plain_attention = use_training_attention(engine.module, device, dtype)
    if plain_attention and rank == 0:
        print(f"learner: bf16 on CPU: attention over training bins up to {EAGER_MAX_SLOTS} slots as plain matmuls "
              "(trainer/cpu_attention.py)", flush=True)
    pack = spec.trainer.padding_free and _packing_holds(engine, rank, world_size, device)
    share = _sharing_mode(spec, engine, rank, world_size, device)
    # With LoRA the reference policy is the same engine with its adapters off: no second copy.
    ref = _reference(spec, world_size, device, dtype) if spec.algorithm.kl_coef > 0 and not use_lora else None
    critic = None
    if spec.algorithm.critic:
        from transformers import AutoModelForTokenClassification

        def value_model() -> torch.nn.Module:
            # A token-classification head with one label is a per-token value head; from a
            # reward model (sequence classification, same `score` layer) it keeps that head.
            return AutoModelForTokenClassification.from_pretrained(
                spec.algorithm.critic_init or spec.model.path, num_labels=1, dtype=dtype)

        critic = _trainable(spec, value_model, deepspeed_config(spec, world_size), spec.algorithm.critic_lr)
        use_training_attention(critic.module, device, dtype)
    teacher = None
    if spec.algorithm.teacher_path:
        teacher = _reference(spec, world_size, device, dtype, spec.algorithm.teacher_path)
        # the teacher reads the student's micro-batch layouts: they must hold for it too
        if pack and not _layout_holds(packing_matches, teacher, rank, world_size, device):
            pack = False
            if rank == 0:
                print("learner: the teacher mixes packed rows; micro-batches stay padded", flush=True)
        if share != "off" and not _layout_holds(prefix_sharing_matches, teacher, rank, world_size, device):
            share = "off"
            if rank == 0:
                print("learner: the teacher ignores prefix trees' masks; shared-prefix micro-batches are off", flush=True)
        teacher.eval()  # (_layout_holds leaves a model in train mode)
    return LearnerModels(engine, ref, critic, pack, share, use_lora, dtype, teacher,
                         EAGER_MAX_SLOTS if plain_attention else None)


def _layout_holds(check, engine, rank: int, world_size: int, device: torch.device) -> bool:
    """Whether the model gives a layout's rows their padded values (`check`: a
    `trainer.logprobs` *_matches function), agreed by every rank (one layout everywhere)."""
    engine.eval()
    try:
        holds = check(engine, engine.module.get_input_embeddings().num_embeddings, device)
    except (TypeError, ValueError, RuntimeError) as err:  # e.g. a forward that takes no position_ids
        print(f"learner rank {rank}: {check.__name__} failed ({type(err).__name__}: {err})", flush=True)
        holds = False
    engine.train()
    if world_size > 1:
        agreed = torch.tensor([int(holds)], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        holds = bool(agreed.item())
    return holds


def _packing_holds(engine, rank: int, world_size: int, device: torch.device) -> bool:
    """Padding-free micro-batches only for a model that gives packed rows their padded values
    (`trainer.logprobs.packing_matches`); said once either way."""
    holds = _layout_holds(packing_matches, engine, rank, world_size, device)
    if rank == 0:
        print("learner: padding-free micro-batches (rows packed end to end)" if holds else
              "learner: trainer.padding_free=true but this model mixes packed rows (its attention ignores "
              "position ids); micro-batches stay padded", flush=True)
    return holds


def _sharing_mode(spec: LearnerSpec, engine, rank: int, world_size: int, device: torch.device) -> str:
    """`trainer.shared_prefix` as the learner runs it: "off" for a model that does not compute
    prefix trees as separate rows (`trainer.logprobs.prefix_sharing_matches`: a 4D mask it
    ignores) and for a MoE router loss (transformers computes it from a 2D mask); said once."""
    mode = spec.trainer.shared_prefix
    if mode == "off":
        return mode
    if spec.algorithm.router_aux_loss_coef > 0:
        if rank == 0:
            print("learner: shared-prefix micro-batches are off with algorithm.router_aux_loss_coef > 0 (the "
                  "router loss needs the rows' own masks)", flush=True)
        return "off"
    holds = _layout_holds(prefix_sharing_matches, engine, rank, world_size, device)
    if rank == 0:
        print(f"learner: shared-prefix micro-batches ({mode}: each group's prompt computed once)" if holds else
              f"learner: trainer.shared_prefix={mode} but this model does not keep prefix-tree rows apart (its "
              "attention ignores a 4D mask); rows are computed separately", flush=True)
    return mode if holds else "off"


def _with_adapters(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """The model as loaded, or with `model.lora` set, wrapped by peft: LoRA matrices on the
    target modules are the only trainable parameters (so the only ones in the optimizer)."""
    if cfg.rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    try:
        return get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                target_modules=list(cfg.target_modules), bias="none"))
    except ValueError as err:  # e.g. a target module the model does not have
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {err}") from None


def _trainable(spec: LearnerSpec, load_model, ds_config: dict[str, Any], lr: float):
    """A DeepSpeed engine with torch AdamW and linear lr warm-up: Adam's first updates are
    sign-like steps of size lr on every weight, which can knock a small policy off its warm-up."""
    warmup = max(spec.algorithm.lr_warmup_steps, 1)
    return build_engine(load_model, ds_config, lr=lr, weight_decay=spec.algorithm.weight_decay,
                        lr_lambda=lambda updates: min(1.0, (updates + 1) / warmup),
                        gradient_checkpointing=spec.model.gradient_checkpointing)


def _reference(spec: LearnerSpec, world_size: int, device: torch.device, dtype: torch.dtype,
               path: str | None = None):
    """A frozen model in its own DeepSpeed engine (no optimizer): the reference policy
    (model.path), or the teacher (`path`); with `ref_offload` its weights live on the CPU
    (ZeRO-3 parameter offload) between uses."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    config = deepspeed_config(spec, world_size, with_optimizer=False)
    if spec.trainer.ref_offload:
        config["zero_optimization"] = {**config["zero_optimization"], "stage": 3,
                                       "offload_param": {"device": "cpu", "pin_memory": device.type == "cuda"}}
    elif spec.trainer.zero_stage != 3:
        config["zero_optimization"] = {"stage": 0}  # a frozen model: nothing to shard but weights
    keep_alive = zero3_load_config(config)
    model = AutoModelForCausalLM.from_pretrained(path or spec.model.path, dtype=dtype).eval()
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine._rlpost_hf_ds_config = keep_alive
    engine.eval()
    return engine
