"""One data-parallel rank of the policy learner: scores batches and makes PPO-style updates.

`LearnerWorker` is a plain class; `trainer.group.LearnerGroup` runs N of them as Ray actors. Its
one job is a rank's scoring and training: the engines are built by `trainer/learner_setup.py`,
the loss is `rl/algo/objective.py`, what a weight sync sends is `trainer/weights.py`, hybrid
placement's offloading `trainer/residency.py`, files `trainer/checkpoints.py`. It reports metrics
as sums so the group can reduce them exactly.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from rl.data.batch import group_order, plan_micro_batches, split_to_count
from rl.plan.devices import actor_device
from rl.plan.flops import (head_forward_flops, kernel_train_flops, layers_forward_flops, matmul_peak_tflops,
                           train_flops, train_passes)
from rl.plan.step_time import LEARNER_EFFICIENCY
from rl.algo.losses import LossNormalizer
from rl.algo.objective import policy_objective, value_objective
from rl.data.types import Outcomes, TrainBatch
from rl.wire import lora
from rl.wire.base import SendOrder, WeightSender
from rl.wire.collective import free_port
from rl.wire.format import WeightMeta
from trainer.advantages import estimate_on_ranks
from trainer.learner_setup import LearnerSpec, assigned_gpus, batch_geometry, build_models, join_data_parallel
from trainer.heap import HeapCap, jemalloc_purge
from trainer.layouts import Layout, PlanAhead, plan_layout
from trainer.logprobs import token_logprobs
from trainer import checkpoints
from trainer.residency import Residency
from trainer.weights import WeightExport, checkpoint_layout


def _add_mismatch(sums: dict[str, float], learner_lp: torch.Tensor, rollout_lp: torch.Tensor,
                  mask: torch.Tensor) -> None:
    """Learner vs rollout log-probs of the sampled tokens (weight sync, dtype, staleness)."""
    diff = (learner_lp.float() - rollout_lp.float()).abs() * mask
    sums["sync/logprob_abs_diff"] += float(diff.sum())
    key = "_max/sync/logprob_max_abs_diff"
    sums[key] = max(sums.get(key, 0.0), float(diff.max()) if diff.numel() else 0.0)


def _skipped(engine) -> bool:
    """Whether `engine`'s last optimizer step was skipped. DeepSpeed skips a step whose gradients
    overflowed (fp16's loss scale), saying so only in its log; a non-finite norm is the same
    failure (issue 47: the loop stops on it; the critic's too, issue 58)."""
    grad_norm = engine.get_global_grad_norm()
    return not engine.was_step_applied() or (grad_norm is not None and not math.isfinite(float(grad_norm)))


def _config_of(model, fallback: dict) -> dict:
    """The HF config (as a dict) of an engine or module, `fallback` where it has none."""
    config = getattr(getattr(model, "module", model), "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else fallback


@dataclass
class MicroBatch:
    """One micro-batch on this rank: its `rows` of the shard, their tensors on the device and
    how they enter the model (`layout`, planned ahead: `PlanAhead`)."""

    rows: torch.Tensor
    data: TrainBatch
    ids: torch.Tensor
    am: torch.Tensor
    layout: Layout


def _accumulate(engine, planned: PlanAhead, backward) -> None:
    """One optimizer step over the `planned` micro-batches (`backward(micro)` each). The
    accumulation boundary is set by hand, as the number of micro-batches may vary by step."""
    for i, micro in enumerate(planned):
        engine.set_gradient_accumulation_boundary(i == len(planned.items) - 1)
        backward(micro)
    engine.step()


def _count_planning(sums: dict[str, float], planned: PlanAhead) -> None:
    """Add a pass's layout planning, and the part of it the step waited for, to the step's sums."""
    sums["_max/time/plan_s"] += planned.planned_s
    sums["_max/time/plan_wait_s"] += planned.waited_s


class LearnerWorker:
    def __init__(self, spec: LearnerSpec, rank: int, world_size: int):
        self.spec, self.rank, self.world_size = spec, rank, world_size
        # the device Ray gave this rank, not whether the machine has CUDA (rl/plan/devices.py)
        self.device_kind = actor_device(assigned_gpus(), torch.cuda.is_available(), f"learner rank {rank}")

    def where(self) -> dict:
        """This actor's process, Ray node, device and malloc (for placement reports, fault messages
        and the weight-sync backend)."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "device": self.device_kind,
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "malloc": "jemalloc" if jemalloc_purge() is not None else "glibc"}

    def node_address(self) -> tuple[str, int]:
        """An address on this actor's node with a free port (rank 0 hosts the data-parallel rendezvous,
        and the collective weight sync's group: rl/wire/collective.py)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the data-parallel group and build the engines (all ranks at once: trainer/learner_setup.py)."""
        spec, rank = self.spec, self.rank
        self.device = join_data_parallel(spec, rank, self.world_size, self.device_kind, master_addr, master_port)
        m = build_models(spec, rank, self.world_size, self.device)
        self.engine, self.ref, self.critic, self.pack, self.lora = m.engine, m.ref, m.critic, m.pack, m.lora
        self.teacher = m.teacher  # on-policy distillation (algorithm.teacher_path): scores the sampled tokens
        self.share = m.share  # trainer.shared_prefix as run (trainer/layouts.py)
        self.max_bin_slots = m.max_bin_slots  # the plain attention's limit on a CPU bf16 learner
        self.uses_ref = spec.algorithm.kl_coef > 0  # (with LoRA the reference is the engine, adapters off)
        # What a weight sync sends: every parameter, or with LoRA only the adapters (by wire name).
        named = ([(lora.wire_name(n), p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
                 if self.lora else list(self.engine.module.named_parameters()))
        t = spec.trainer
        self.residency = Residency([self.engine, self.critic], [self.ref, self.teacher],
                                   not t.ref_offload and t.zero_stage != 3, self.device)
        self.export = WeightExport(named, rank, t.zero_stage, self.residency.resident,
                                    convert=None if self.lora else checkpoint_layout(self.engine.module))
        self._sender = None  # the weight sync's learner side (`attach_sender`)
        self._scored_sums: dict[str, float] = {}
        self._model_config = self.engine.module.config.to_dict()
        self._dtype = m.dtype
        self.peak_tflops = spec.peak_tflops  # 0: measured at the first score or update (the rollout engines idle)
        self._critic_config = _config_of(self.critic, self._model_config) if self.critic is not None else {}
        self._teacher_config = _config_of(self.teacher, self._model_config) if self.teacher is not None else {}
        self._checkpointing = bool(spec.model.gradient_checkpointing)
        self.heap = HeapCap(active=None if self.device.type == "cpu" else False)  # trainer/heap.py

    def _peak(self) -> float:
        """This rank's matmul peak in TFLOP/s: `cluster.peak_tflops`, else measured once in the run's
        dtype on its device, square and at the model's MLP shape (`rl.plan.flops.matmul_peak_tflops`).
        Not at set-up: the rollout engines start then, on the same cores."""
        if not self.peak_tflops:
            self.peak_tflops = matmul_peak_tflops(self._dtype, self.device, self._model_config)
        return self.peak_tflops

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
        groups = batch.group_ids[rows].tolist() if self.share != "off" else None
        plan = plan_micro_batches(lengths, geometry.examples_cap, budget, groups)
        plan = split_to_count(plan, self._max_over_ranks(len(plan)))
        return [rows[torch.tensor(mb, dtype=torch.long)] for mb in plan]

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> TrainBatch:
        """What the update needs from before it: reference log-probs (KL), the teacher's log-probs
        (on-policy distillation), critic values (GAE) and, when `spec.recompute_old_logprobs`, the
        old policy's log-probs (else the training forward supplies them). Kept on CPU, full width;
        the step's advantages are estimated from them (`update`)."""
        self.onload()  # hybrid placement: the engine on this GPU sleeps now
        width = batch.input_ids.shape[1] - 1
        old = torch.zeros((len(batch), width))
        ref = torch.zeros((len(batch), width)) if self.uses_ref else None
        values = torch.zeros((len(batch), width)) if self.critic is not None else None
        teacher = torch.zeros((len(batch), width)) if self.teacher is not None else None
        entropy = torch.zeros((len(batch), width))
        recompute = self.spec.recompute_old_logprobs

        def put(into: torch.Tensor, rows: torch.Tensor, t: torch.Tensor) -> None:
            into[rows, : t.shape[1]] = t.float().cpu()

        self.engine.eval()
        kernel = 0.0  # FLOPs the scoring forwards compute (hardware utilisation, rl/plan/flops.py)
        plan_s = plan_wait = 0.0  # seconds planning layouts, and waiting for those the compute did not hide
        if recompute or ref is not None or values is not None or teacher is not None:
            self._peak()
            forwards = int(recompute) + int(ref is not None) + int(values is not None) + int(teacher is not None)
            planned = self._plan_ahead(batch, self._micro_batches(batch, self._order(batch), forward_only=True),
                                       passes=forwards)
            for micro in planned:
                rows, mb, ids, am, layout = micro.rows, micro.data, micro.ids, micro.am, micro.layout
                where = self._to_device(mb.loss_mask) > 0  # only the trained tokens' log-probs are used
                shape, heads = layout.input_ids.shape, int(mb.loss_mask.gt(0).sum())
                policy_forward = (layers_forward_flops(self._model_config, *shape)
                                  + head_forward_flops(self._model_config, heads))
                kernel += policy_forward * (int(recompute) + int(ref is not None))
                if values is not None:
                    kernel += layers_forward_flops(self._critic_config, *shape)
                if teacher is not None:
                    kernel += (layers_forward_flops(self._teacher_config, *shape)
                               + head_forward_flops(self._teacher_config, heads))
                if recompute:
                    lp, e = token_logprobs(self.engine, ids, am, self.spec.temperature, with_entropy=True,
                                           positions=where, layout=layout)
                    put(old, rows, lp)
                    put(entropy, rows, e)
                if ref is not None:
                    put(ref, rows, self._ref_logprobs(ids, am, where, layout))
                if values is not None:
                    put(values, rows, self._values(self.critic, layout))
                if teacher is not None:
                    put(teacher, rows, token_logprobs(self.teacher, ids, am, self.spec.temperature, positions=where,
                                                      layout=layout)[0])
            plan_s, plan_wait = planned.planned_s, planned.waited_s
        self.engine.train()
        batch.old_logprobs = old if recompute else None
        batch.ref_logprobs, batch.values, batch.teacher_logprobs = ref, values, teacher
        mask = batch.loss_mask
        self._scored_sums = {"actor/entropy_nats": float((entropy * mask).sum())} if recompute else {}
        if kernel:
            self._scored_sums["_kernel_flops"] = kernel
        self._scored_sums.update({"_max/time/plan_s": plan_s, "_max/time/plan_wait_s": plan_wait})
        if batch.values is not None:
            self._scored_sums["critic/values_mean"] = float((batch.values * mask).sum())
        return batch

    def _order(self, batch: TrainBatch, generator: torch.Generator | None = None) -> torch.Tensor:
        """The rows in a random order (`generator`; None: as they are), each group's rows kept
        together when prefixes are shared (they share only within a micro-batch)."""
        if self.share != "off":
            return group_order(batch.group_ids, generator)
        return torch.randperm(len(batch), generator=generator) if generator is not None else torch.arange(len(batch))

    def _compute_rate(self) -> float | None:
        """The FLOP/s this rank expects to compute at: the measured peak at the planner's learner
        efficiency (None before the peak is measured)."""
        if not self.peak_tflops:
            return None
        return self.peak_tflops * 1e12 * LEARNER_EFFICIENCY.get(str(self._dtype).removeprefix("torch."), 0.25)

    def _layout(self, mb: TrainBatch, ids: torch.Tensor, am: torch.Tensor, passes: float = 3.0,
                hidden_s: float = 0.0) -> Layout:
        """How this micro-batch's rows enter the models (trainer/layouts.py): packed end to end
        and, with `trainer.shared_prefix`, each group's rows as one prefix tree; `auto` decides by
        net time over the `passes` forwards the layout serves at this rank's compute rate, the
        planning not hidden behind `hidden_s` seconds of compute included. On a CPU learner in bf16
        no bin grows past the plain attention's limit to hold more trees (`max_bin_slots`): longer
        bins take SDPA's slower backward (8x4 recipe: ~2.0 against ~1.35 ms per slot)."""
        return plan_layout(ids, am, pack=self.pack, group_ids=mb.group_ids, share=self.share,
                           config=self._model_config, flops_per_s=self._compute_rate(), passes=passes,
                           hidden_s=hidden_s, max_bin_slots=self.max_bin_slots)

    def _plan_ahead(self, batch: TrainBatch, micro_batches: list[torch.Tensor], passes: float) -> PlanAhead:
        """The micro-batches of `batch` (rows each), their layouts planned one ahead on a worker
        thread while the one before computes on the GPU, credited with that micro-batch's expected
        compute; on CPU planned in turn (the compute holds every core)."""
        rate = self._compute_rate()
        ahead = self.device.type == "cuda"

        def plan(rows: torch.Tensor, hidden_s: float) -> MicroBatch:
            mb = batch.select(rows)
            ids, am = self._to_device(mb.input_ids), self._to_device(mb.attention_mask)
            return MicroBatch(rows, mb, ids, am, self._layout(mb, ids, am, passes=passes, hidden_s=hidden_s))

        def compute_s(micro: MicroBatch) -> float:
            return layers_forward_flops(self._model_config, *micro.layout.input_ids.shape) * passes / rate

        return PlanAhead(micro_batches, plan, compute_s if rate and self._model_config and ahead else None, ahead=ahead)

    def _ref_logprobs(self, ids: torch.Tensor, am: torch.Tensor, where: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The reference policy's log-probs: its own engine, or (LoRA) the policy with adapters off."""
        if self.ref is not None:
            return token_logprobs(self.ref, ids, am, self.spec.temperature, positions=where, layout=layout)[0]
        with self.engine.module.disable_adapter():
            return token_logprobs(self.engine, ids, am, self.spec.temperature, positions=where, layout=layout)[0]

    def _values(self, critic, layout: Layout) -> torch.Tensor:
        """V(prefix up to t) at position t, aligned with the log-prob of token t+1: [B, T-1]
        (0 where the row has ended, in a layout without padding)."""
        return layout.per_token(critic(**layout.model_inputs(self._dtype)).logits[..., 0].float())

    def _global_normalizer(self, mask: torch.Tensor) -> LossNormalizer:
        local = LossNormalizer.of(mask)
        counts = torch.tensor([local.tokens, local.sequences], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)  # on the rank's device: NCCL reduces CUDA tensors only
        return LossNormalizer(tokens=float(counts[0]), sequences=float(counts[1]),
                              max_response_len=float(self.spec.max_response_len))

    def update(self, shard: TrainBatch, outcomes: Outcomes, step: int, kl_coef: float,
               width: int) -> tuple[dict[str, float], dict[str, float]]:
        """The step on this rank, where its `shard` of the batch (`width` tokens wide, less the
        first) stays: score it, estimate the step's advantages with the other ranks
        (trainer/advantages.py), train. Returns the update's metric sums, with the scoring's
        seconds, and the estimate's metrics (the same on every rank)."""
        started = time.perf_counter()
        batch = self.score(shard)
        sums = {"_max/time/score_s": time.perf_counter() - started}
        est = estimate_on_ranks(self.spec.algorithm, batch, outcomes, kl_coef, self.rank, self.world_size, width,
                                self.device)
        batch.advantages, batch.returns = est.advantages, est.returns
        return {**sums, **self.train_step(batch, step, kl_coef)}, est.metrics

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
        if needs_score:  # called without `update`'s score phase (tests, tools)
            batch = self.score(batch)
        mask = batch.loss_mask
        sums: dict[str, float] = defaultdict(float, self._scored_sums)
        self._scored_sums = {}
        sums["_tokens"] = float(mask.sum())
        sums["_max/perf/peak_tflops"] = self._peak()
        if batch.old_logprobs is not None:
            _add_mismatch(sums, batch.old_logprobs, batch.rollout_logprobs, mask)
        train_policy = step >= spec.algorithm.critic_warmup_steps or self.critic is None
        generator = torch.Generator().manual_seed((spec.seed * 1_000_003 + step * 7919 + self.rank) % 2**31)
        for epoch in range(spec.algorithm.ppo_epochs):
            order = self._order(batch, generator)
            for mb_rows in torch.tensor_split(order, spec.algorithm.mini_batches):
                norm = self._global_normalizer(mask[mb_rows])
                plan = self._micro_batches(batch, mb_rows)
                if self.critic is not None:
                    planned = self._plan_ahead(batch, plan, train_passes(self._checkpointing))
                    _accumulate(self.critic, planned, lambda micro: self._critic_backward(micro, norm, sums))
                    _count_planning(sums, planned)
                    sums["_updates/critic"] += 1
                    # counted like the actor's below: a critic that never updates stops the run too
                    sums["_skipped/critic"] += float(_skipped(self.critic))
                if not train_policy:
                    continue
                planned = self._plan_ahead(batch, plan, train_passes(self._checkpointing, frozen=bool(self.lora)))
                _accumulate(self.engine, planned,
                            lambda micro: self._backward(micro, norm, kl_coef, sums, first_pass=epoch == 0))
                _count_planning(sums, planned)
                grad_norm = self.engine.get_global_grad_norm()
                finite = grad_norm is None or math.isfinite(float(grad_norm))
                sums["_updates"] += 1
                sums["actor/lr_per_update"] += float(self.engine.get_lr()[0])
                sums["actor/grad_norm"] += float(grad_norm) if grad_norm is not None and finite else 0.0
                sums["_skipped"] += float(_skipped(self.engine))
        self.heap.after_update()  # CPU: a heap grown past its bound gives its free pages back
        sums["_max/host/heap_trims"] = float(self.heap.trims)
        return dict(sums)

    def _backward(self, micro: MicroBatch, norm: LossNormalizer, kl_coef: float, sums: dict[str, float],
                  first_pass: bool = True) -> None:
        """One micro-batch's policy loss, backward. Without a scored old policy (one update per
        step) the forward's own detached log-probs are the old policy's. The policy-gradient term
        is reweighted by the behaviour-policy correction (`algorithm.importance_correction`);
        `first_pass` counts the per-token metrics once per step, not once per epoch."""
        spec, a = self.spec, self.spec.algorithm
        mb, ids, am, layout = micro.data, micro.ids, micro.am, micro.layout
        mask, adv, behaviour = (self._to_device(t) for t in (mb.loss_mask, mb.advantages, mb.rollout_logprobs))
        fused = mb.old_logprobs is None
        routers: list[torch.Tensor] | None = [] if a.router_aux_loss_coef > 0 else None
        logp, entropy = token_logprobs(self.engine, ids, am, spec.temperature,
                                       with_entropy=a.entropy_coef > 0 or (fused and first_pass),
                                       entropy_grad=a.entropy_coef > 0, positions=mask > 0, router_aux=routers,
                                       layout=layout)
        old = logp.detach() if fused else self._to_device(mb.old_logprobs)
        if fused and first_pass:
            _add_mismatch(sums, old.cpu(), mb.rollout_logprobs, mb.loss_mask)
            sums["actor/entropy_nats"] += float((entropy.detach() * mask).sum())
        ref = None if mb.ref_logprobs is None else self._to_device(mb.ref_logprobs)
        out = policy_objective(logp, old, behaviour, adv, mask, a, norm, kl_coef, entropy=entropy, ref_logprobs=ref,
                               router_aux=routers[0] if routers else None)
        if first_pass:
            for k, v in out.importance_sums.items():
                sums[k] += v
            lengths = mb.attention_mask.sum(dim=1).tolist()
            sums["_trained_tokens"] += float(sum(lengths) * a.ppo_epochs)
            sums["_flops"] += train_flops(self._model_config, lengths) * a.ppo_epochs
            sums["_computed_tokens"] += float(layout.slots) * a.ppo_epochs
        # what the kernels computed in this pass (every epoch): the layout's slots, the head's positions
        sums["_kernel_flops"] += kernel_train_flops(self._model_config, *layout.input_ids.shape,
                                                    head_tokens=int(mb.loss_mask.gt(0).sum()),
                                                    checkpointing=self._checkpointing, frozen=bool(self.lora))
        if out.kl_sum is not None:
            sums["actor/kl_nats"] += out.kl_sum
        if out.router_aux is not None:
            sums["actor/router_aux_loss"] += out.router_aux
        # DeepSpeed averages gradients over data-parallel ranks; the normalizer is already global,
        # so undo that average, and do not let it divide by the accumulation steps again.
        self.engine.backward(out.loss * self.world_size, scale_wrt_gas=False)
        sums["actor/loss_nats"] += float(out.loss.detach())
        sums["actor/pg_loss_nats"] += out.pg_loss_sum
        sums["actor/clip_frac"] += out.clipped_sum
        sums["_loss_tokens"] += float(mask.sum())

    def _critic_backward(self, micro: MicroBatch, norm: LossNormalizer, sums: dict[str, float]) -> None:
        mb, layout = micro.data, micro.layout
        mask, old, returns = (self._to_device(t) for t in (mb.loss_mask, mb.values, mb.returns))
        values = self._values(self.critic, layout)
        sums["_kernel_flops"] += layers_forward_flops(self._critic_config, *layout.input_ids.shape) * \
            train_passes(self._checkpointing)
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

    def weight_metas(self) -> list[WeightMeta]:
        return self.export.metas()

    # The weight sync's calls on this rank (`rl.wire.base.SenderHost`): its driver side places a
    # sender of its transport here (rl/wire/collective.py, object_store.py, ipc.py), then joins
    # and sends through it.

    def attach_sender(self, sender: WeightSender) -> None:
        """Hold the learner side of the weight sync: it reads the weights through `self.export`
        and nothing else of this rank (the sender before is closed)."""
        if self._sender is not None:
            self._sender.close()
        sender.bind(self.export, self.rank, self.device)
        self._sender = sender

    def sync_join(self, link) -> None:
        """Join the transport (`link`: the collective's group address, the IPC relay, per sender)."""
        self._sender.join(link)

    def sync_send(self, order: SendOrder):
        """Send the weights (every rank: ZeRO-3 gathers are collective); what the sender returns."""
        return self._sender.send(order)

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
            checkpoints.save_pretrained(path, adapter_path, self.engine, self.export, self.rank,
                                        self.spec.trainer.zero_stage, self.spec.model.lora if self.lora else None)
