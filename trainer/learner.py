"""One data-parallel rank of the policy learner: a DeepSpeed ZeRO engine doing PPO-style updates.

`LearnerWorker` is a plain class; `trainer.group.LearnerGroup` runs N of them as Ray actors.
The math (advantages, clipped loss, KL, aggregation) comes from `rl/`; this file only moves
tensors through DeepSpeed and reports metrics as sums so the group can reduce them exactly.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rl.data.batch import plan_micro_batches, split_to_count
from rl.config.schema import AlgorithmConfig, ModelConfig, TrainConfig, TrainerConfig
from rl.plan.devices import actor_device, collective_backend, local_device_index
from rl.plan.flops import measure_matmul_tflops, train_flops
from rl.plan.geometry import BatchGeometry
from rl.algo.losses import LossNormalizer
from rl.algo.objective import policy_objective, value_objective
from rl.data.types import TrainBatch
from rl.wire import lora, weight_sync
from trainer.engine import build_engine, ds_config, import_deepspeed, zero3_load_config
from trainer.logprobs import packing_matches, token_logprobs
from trainer import checkpoints
from trainer.residency import Residency
from trainer.weights import WeightExport


def _assigned_gpus() -> list:
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


def _add_mismatch(sums: dict[str, float], learner_lp: torch.Tensor, rollout_lp: torch.Tensor,
                  mask: torch.Tensor) -> None:
    """Learner vs rollout log-probs of the sampled tokens (weight sync, dtype, staleness)."""
    diff = (learner_lp.float() - rollout_lp.float()).abs() * mask
    sums["sync/logprob_abs_diff"] += float(diff.sum())
    key = "_max/sync/logprob_max_abs_diff"
    sums[key] = max(sums.get(key, 0.0), float(diff.max()) if diff.numel() else 0.0)


def _accumulate(engine, plan: list[torch.Tensor], backward) -> None:
    """One optimizer step over the micro-batches of `plan` (`backward(rows)` each). The
    accumulation boundary is set by hand, as the number of micro-batches may vary by step."""
    for i, rows in enumerate(plan):
        engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
        backward(rows)
    engine.step()


class LearnerWorker:
    def __init__(self, spec: LearnerSpec, rank: int, world_size: int):
        self.spec, self.rank, self.world_size = spec, rank, world_size
        # the device Ray gave this rank, not whether the machine has CUDA (rl/plan/devices.py)
        self.device_kind = actor_device(_assigned_gpus(), torch.cuda.is_available(), f"learner rank {rank}")

    def where(self) -> dict:
        """This actor's process, Ray node and device (for placement reports, fault messages and
        the weight-sync backend)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "device": self.device_kind,
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def node_address(self) -> tuple[str, int]:
        """An address on this actor's node with a free port (rank 0 hosts the data-parallel rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), weight_sync.free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the data-parallel group and build the engines (all ranks at once)."""
        spec, rank, world_size = self.spec, self.rank, self.world_size
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            LOCAL_RANK=str(local_device_index(_assigned_gpus(), dict(os.environ))),  # 0: Ray shows us only ours
            WORLD_SIZE=str(world_size),
        )
        device = self.device_kind
        if device == "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
        if spec.threads:
            torch.set_num_threads(spec.threads)
        deepspeed = import_deepspeed()
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(self.device)
        deepspeed.init_distributed(dist_backend=collective_backend(device))
        torch.manual_seed(spec.seed)
        ds_config = deepspeed_config(spec, world_size)
        dtype = getattr(torch, spec.model.dtype)
        self.lora = spec.model.lora.rank > 0
        self.engine = self._trainable(
            lambda: self._with_adapters(AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=dtype)),
            ds_config, spec.algorithm.lr)
        self.pack = spec.trainer.padding_free and self._packing_holds()
        # With LoRA the reference policy is the same engine with its adapters off: no second copy.
        self.uses_ref = spec.algorithm.kl_coef > 0
        self.ref = self._reference(dtype) if self.uses_ref and not self.lora else None
        self.critic = None
        if spec.algorithm.critic:
            from transformers import AutoModelForTokenClassification

            def value_model() -> torch.nn.Module:
                # A token-classification head with one label is a per-token value head; from a
                # reward model (sequence classification, same `score` layer) it keeps that head.
                return AutoModelForTokenClassification.from_pretrained(
                    spec.algorithm.critic_init or spec.model.path, num_labels=1, dtype=dtype)

            self.critic = self._trainable(value_model, deepspeed_config(spec, world_size), spec.algorithm.critic_lr)
        # What a weight sync sends: every parameter, or with LoRA only the adapters (by wire name).
        named = ([(lora.wire_name(n), p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
                 if self.lora else list(self.engine.module.named_parameters()))
        t = spec.trainer
        self.residency = Residency([self.engine, self.critic], self.ref, not t.ref_offload and t.zero_stage != 3,
                                   self.device)
        self.weights = WeightExport(named, rank, spec.trainer.zero_stage, self.residency.resident)
        self._sender = None  # the weight sync's learner side (`attach_sender`)
        self._scored_sums: dict[str, float] = {}
        self._model_config = self.engine.module.config.to_dict()
        self._dtype = dtype
        self.peak_tflops = spec.peak_tflops  # 0: measured at the first update (when the rollout engines are idle)

    def _packing_holds(self) -> bool:
        """Padding-free micro-batches only for a model that gives packed rows their padded values
        (`trainer.logprobs.packing_matches`); said once either way."""
        self.engine.eval()
        try:
            holds = packing_matches(self.engine, self.engine.module.get_input_embeddings().num_embeddings, self.device)
        except (TypeError, ValueError, RuntimeError) as err:  # e.g. a forward that takes no position_ids
            print(f"learner rank {self.rank}: the packing check failed ({type(err).__name__}: {err})", flush=True)
            holds = False
        self.engine.train()
        if self.world_size > 1:  # one layout on every rank: pack only where all ranks found it holds
            agreed = torch.tensor([int(holds)], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            holds = bool(agreed.item())
        if self.rank == 0:
            print("learner: padding-free micro-batches (rows packed end to end)" if holds else
                  "learner: trainer.padding_free=true but this model mixes packed rows (its attention ignores "
                  "position ids); micro-batches stay padded", flush=True)
        return holds

    def _with_adapters(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as loaded, or with `model.lora` set, wrapped by peft: LoRA matrices on the
        target modules are the only trainable parameters (so the only ones in the optimizer)."""
        if not self.lora:
            return model
        from peft import LoraConfig, get_peft_model

        cfg = self.spec.model.lora
        try:
            return get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                    target_modules=list(cfg.target_modules), bias="none"))
        except ValueError as err:  # e.g. a target module the model does not have
            raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {err}") from None

    def _trainable(self, load_model, ds_config: dict[str, Any], lr: float):
        """A DeepSpeed engine with torch AdamW and linear lr warm-up: Adam's first updates are
        sign-like steps of size lr on every weight, which can knock a small policy off its warm-up."""
        warmup = max(self.spec.algorithm.lr_warmup_steps, 1)
        return build_engine(load_model, ds_config, lr=lr, weight_decay=self.spec.algorithm.weight_decay,
                            lr_lambda=lambda updates: min(1.0, (updates + 1) / warmup),
                            gradient_checkpointing=self.spec.model.gradient_checkpointing)

    def _reference(self, dtype: torch.dtype):
        """The frozen reference policy in its own DeepSpeed engine (no optimizer); with
        `ref_offload` its weights live on the CPU (ZeRO-3 parameter offload) between uses."""
        import deepspeed
        from transformers import AutoModelForCausalLM

        spec = self.spec
        config = deepspeed_config(spec, self.world_size, with_optimizer=False)
        if spec.trainer.ref_offload:
            config["zero_optimization"] = {**config["zero_optimization"], "stage": 3,
                                           "offload_param": {"device": "cpu", "pin_memory": self.device.type == "cuda"}}
        elif spec.trainer.zero_stage != 3:
            config["zero_optimization"] = {"stage": 0}  # a frozen model: nothing to shard but weights
        keep_alive = zero3_load_config(config)
        model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=dtype).eval()
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine._rlpost_hf_ds_config = keep_alive
        engine.eval()
        return engine

    # ---- training -------------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _max_over_ranks(self, n: int) -> int:
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t)

    def _micro_batches(self, batch: TrainBatch, rows: torch.Tensor, forward_only: bool = False) -> list[torch.Tensor]:
        """`rows` cut into micro-batches as `BatchGeometry` says: a mini-batch into
        `accumulation_steps` near-equal runs of rows (`forward_only`: runs of `examples_cap`, i.e.
        `trainer.micro_batch_size`), or by the padded-token budget (`trainer.max_tokens_per_micro_batch`,
        at most `examples_cap` rows each), as many on every rank."""
        geometry = batch_geometry(self.spec, self.world_size)
        budget = geometry.max_tokens_per_micro_batch
        if budget <= 0 and forward_only:
            return list(torch.split(rows, geometry.forward_sizes(len(rows))))
        if budget <= 0:
            return list(torch.split(rows, geometry.micro_batch_sizes(len(rows))))
        lengths = batch.attention_mask[rows].sum(dim=1).tolist()
        plan = plan_micro_batches(lengths, geometry.examples_cap, budget)
        plan = split_to_count(plan, self._max_over_ranks(len(plan)))
        return [rows[torch.tensor(mb, dtype=torch.long)] for mb in plan]

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> TrainBatch:
        """What the update needs from before it: reference log-probs (KL), critic values (GAE)
        and, when `spec.recompute_old_logprobs`, the old policy's log-probs (else the training
        forward supplies them). Kept on CPU, full width; the driver estimates advantages from them."""
        self.onload()  # hybrid placement: the engine on this GPU sleeps now
        width = batch.input_ids.shape[1] - 1
        old = torch.zeros((len(batch), width))
        ref = torch.zeros((len(batch), width)) if self.uses_ref else None
        values = torch.zeros((len(batch), width)) if self.critic is not None else None
        entropy = torch.zeros((len(batch), width))
        recompute = self.spec.recompute_old_logprobs

        def put(into: torch.Tensor, rows: torch.Tensor, t: torch.Tensor) -> None:
            into[rows, : t.shape[1]] = t.float().cpu()

        self.engine.eval()
        if recompute or ref is not None or values is not None:
            for rows in self._micro_batches(batch, torch.arange(len(batch)), forward_only=True):
                mb = batch.select(rows)
                ids, am = self._to_device(mb.input_ids), self._to_device(mb.attention_mask)
                where = self._to_device(mb.loss_mask) > 0  # only the trained tokens' log-probs are used
                if recompute:
                    lp, e = token_logprobs(self.engine, ids, am, self.spec.temperature, with_entropy=True,
                                           positions=where, pack=self.pack)
                    put(old, rows, lp)
                    put(entropy, rows, e)
                if ref is not None:
                    put(ref, rows, self._ref_logprobs(ids, am, where))
                if values is not None:
                    put(values, rows, self._values(self.critic, ids, am))
        self.engine.train()
        batch.old_logprobs = old if recompute else None
        batch.ref_logprobs, batch.values = ref, values
        mask = batch.loss_mask
        self._scored_sums = {"actor/entropy_nats": float((entropy * mask).sum())} if recompute else {}
        if batch.values is not None:
            self._scored_sums["critic/values_mean"] = float((batch.values * mask).sum())
        return batch

    def _ref_logprobs(self, ids: torch.Tensor, am: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """The reference policy's log-probs: its own engine, or (LoRA) the policy with adapters off."""
        if self.ref is not None:
            return token_logprobs(self.ref, ids, am, self.spec.temperature, positions=where, pack=self.pack)[0]
        with self.engine.module.disable_adapter():
            return token_logprobs(self.engine, ids, am, self.spec.temperature, positions=where, pack=self.pack)[0]

    @staticmethod
    def _values(critic, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        """V(prefix up to t) at position t, aligned with the log-prob of token t+1: [B, T-1]."""
        return critic(input_ids=ids, attention_mask=am).logits[:, :-1, 0].float()

    def _global_normalizer(self, mask: torch.Tensor) -> LossNormalizer:
        local = LossNormalizer.of(mask)
        counts = torch.tensor([local.tokens, local.sequences], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)  # on the rank's device: NCCL reduces CUDA tensors only
        return LossNormalizer(tokens=float(counts[0]), sequences=float(counts[1]),
                              max_response_len=float(self.spec.max_response_len))

    def train_step(self, batch: TrainBatch, step: int, kl_coef: float | None = None) -> dict[str, float]:
        """PPO-style update on this rank's shard; returns metric *sums* (the group reduces them).

        `kl_coef` weighs the KL term of the loss (the driver's KL controller, which may adapt it;
        default: algorithm.kl_coef).

        Every mini-batch is split into exactly `accumulation_steps` micro-batches on
        every rank, so DeepSpeed's accumulation boundary is the mini-batch boundary. The critic
        (PPO) trains on the same mini-batches; during its warm-up steps the policy stays put.
        """
        spec = self.spec
        self.onload()
        kl_coef = spec.algorithm.kl_coef if kl_coef is None else kl_coef
        needs_score = (spec.recompute_old_logprobs and batch.old_logprobs is None) or \
            (self.uses_ref and batch.ref_logprobs is None) or (self.critic is not None and batch.values is None)
        if needs_score:  # called without the driver's score phase (tests, tools)
            batch = self.score(batch)
        mask = batch.loss_mask
        sums: dict[str, float] = defaultdict(float, self._scored_sums)
        self._scored_sums = {}
        sums["_tokens"] = float(mask.sum())
        if not self.peak_tflops:  # not at set-up: the rollout engines start then, on the same cores
            self.peak_tflops = measure_matmul_tflops(self._dtype, self.device)
        sums["_max/perf/peak_tflops"] = self.peak_tflops
        if batch.old_logprobs is not None:
            _add_mismatch(sums, batch.old_logprobs, batch.rollout_logprobs, mask)
        train_policy = step >= spec.algorithm.critic_warmup_steps or self.critic is None
        generator = torch.Generator().manual_seed((spec.seed * 1_000_003 + step * 7919 + self.rank) % 2**31)
        for epoch in range(spec.algorithm.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for mb_rows in torch.tensor_split(order, spec.algorithm.mini_batches):
                norm = self._global_normalizer(mask[mb_rows])
                plan = self._micro_batches(batch, mb_rows)
                if self.critic is not None:
                    _accumulate(self.critic, plan, lambda rows: self._critic_backward(batch.select(rows), norm, sums))
                    sums["_updates/critic"] += 1
                if not train_policy:
                    continue
                _accumulate(self.engine, plan,
                            lambda rows: self._backward(batch.select(rows), norm, kl_coef, sums, first_pass=epoch == 0))
                grad_norm = self.engine.get_global_grad_norm()
                sums["_updates"] += 1
                sums["actor/lr_per_update"] += float(self.engine.get_lr()[0])
                sums["actor/grad_norm"] += float(grad_norm) if grad_norm is not None else 0.0
        return dict(sums)

    def _backward(self, mb: TrainBatch, norm: LossNormalizer, kl_coef: float, sums: dict[str, float],
                  first_pass: bool = True) -> None:
        """One micro-batch's policy loss, backward. Without a scored old policy (one update per
        step) the forward's own detached log-probs are the old policy's. The policy-gradient term
        is reweighted by the behaviour-policy correction (`algorithm.importance_correction`);
        `first_pass` counts the per-token metrics once per step, not once per epoch."""
        spec, a = self.spec, self.spec.algorithm
        ids, am = self._to_device(mb.input_ids), self._to_device(mb.attention_mask)
        mask, adv, behaviour = (self._to_device(t) for t in (mb.loss_mask, mb.advantages, mb.rollout_logprobs))
        fused = mb.old_logprobs is None
        logp, entropy = token_logprobs(self.engine, ids, am, spec.temperature,
                                       with_entropy=a.entropy_coef > 0 or (fused and first_pass),
                                       entropy_grad=a.entropy_coef > 0, positions=mask > 0, pack=self.pack)
        old = logp.detach() if fused else self._to_device(mb.old_logprobs)
        if fused and first_pass:
            _add_mismatch(sums, old.cpu(), mb.rollout_logprobs, mb.loss_mask)
            sums["actor/entropy_nats"] += float((entropy.detach() * mask).sum())
        ref = None if mb.ref_logprobs is None else self._to_device(mb.ref_logprobs)
        out = policy_objective(logp, old, behaviour, adv, mask, a, norm, kl_coef, entropy=entropy, ref_logprobs=ref)
        if first_pass:
            for k, v in out.importance_sums.items():
                sums[k] += v
            lengths = mb.attention_mask.sum(dim=1).tolist()
            sums["_trained_tokens"] += float(sum(lengths) * a.ppo_epochs)
            sums["_flops"] += train_flops(self._model_config, lengths) * a.ppo_epochs
        if out.kl_sum is not None:
            sums["actor/kl_nats"] += out.kl_sum
        # DeepSpeed averages gradients over data-parallel ranks; the normalizer is already global,
        # so undo that average, and do not let it divide by the accumulation steps again.
        self.engine.backward(out.loss * self.world_size, scale_wrt_gas=False)
        sums["actor/loss_nats"] += float(out.loss.detach())
        sums["actor/pg_loss_nats"] += out.pg_loss_sum
        sums["actor/clip_frac"] += out.clipped_sum
        sums["_loss_tokens"] += float(mask.sum())

    def _critic_backward(self, mb: TrainBatch, norm: LossNormalizer, sums: dict[str, float]) -> None:
        ids, am = self._to_device(mb.input_ids), self._to_device(mb.attention_mask)
        mask, old, returns = (self._to_device(t) for t in (mb.loss_mask, mb.values, mb.returns))
        values = self._values(self.critic, ids, am)
        out = value_objective(values, old, returns, mask, self.spec.algorithm, norm)
        self.critic.backward(out.loss * self.world_size, scale_wrt_gas=False)
        sums["critic/value_loss"] += float(out.loss.detach())
        sums["critic/clip_frac"] += out.clipped_sum
        sums["critic/value_error"] += out.abs_error_sum
        sums["_critic_tokens"] += float(mask.sum())

    # ---- weights out ----------------------------------------------------------------------

    def parameter_counts(self) -> dict[str, float]:
        """Trainable and total parameters and the model's bytes (what a full weight sync moves)."""
        params = list(self.engine.module.parameters())
        numel = [getattr(p, "ds_numel", p.numel()) for p in params]
        return {"trainable": float(sum(n for n, p in zip(numel, params) if p.requires_grad)),
                "total": float(sum(numel)),
                "total_bytes": float(sum(n * p.element_size() for n, p in zip(numel, params)))}

    def weight_metas(self) -> list[weight_sync.WeightMeta]:
        return self.weights.metas()

    def attach_sender(self, sender) -> None:
        """Hold the learner side of the weight sync (`trainer/sync/`): it reads the weights
        through `self.weights` and nothing else of this rank."""
        if self._sender is not None:
            self._sender.close()
        sender.bind(self.weights, self.rank, self.device)
        self._sender = sender

    def sender_call(self, method: str, *args):
        """A call of the weight sync on its learner side (join, send...)."""
        return getattr(self._sender, method)(*args)

    # ---- hybrid placement: handing the GPU to the rollout engine on it (trainer/residency.py) --

    def offload(self, keep_weights: bool = False) -> None:
        self.residency.offload(keep_weights)

    def onload(self) -> None:
        self.residency.onload()

    # ---- files (trainer/checkpoints.py) ------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        with self.residency.resident():
            checkpoints.save_state(path, self.engine, self.critic)

    def load_checkpoint(self, path: str) -> None:
        self.onload()
        checkpoints.load_state(path, self.engine, self.critic)

    def save_pretrained(self, path: str, adapter_path: str | None = None) -> None:
        with self.residency.resident():
            checkpoints.save_pretrained(path, adapter_path, self.engine, self.weights, self.rank,
                                        self.spec.trainer.zero_stage, self.spec.model.lora if self.lora else None)
