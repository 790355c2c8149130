"""What one step takes, predicted before a run from its real lengths and this host's speeds.

Every sequence at `max_model_len` is an upper bound far from a step (a chat prompt of 50 tokens
and answers of 30 in a 128-token budget). Here a step is modelled phase by phase from:

- the lengths (`Lengths`): the prompts' mean (tokenized from the data, or the last run's), the
  completions' mean and the longest one of a step (the last run's, else a prior: half of
  `rollout.max_new_tokens` on average and the cap for the longest);
- the host (`Host`): the matmul peak in the run's dtype measured in process (a sub-second probe,
  `rl.plan.flops.measure_matmul_tflops`) or a GPU's datasheet figure, and the memory bandwidth
  (a copy probe, or the datasheet);
- efficiencies of each phase measured by this repo's benchmarks (below), not fitted per run.

Phases: the rollout (prefill of every sample's prompt; then one decode step per token of the
longest completion, each reading the weights once and doing the batch's matmuls, plus the
engine's work per step and per request); the learner (3 forward passes of FLOPs over the tokens
it computes, every row's or with shared prefixes each group's prompt once, the LM head over the
completions only; the scoring passes; AdamW's memory traffic); the weight sync (the weights'
bytes at the sync's measured rate). A synchronous step
is their sum; an asynchronous one (`algorithm.off_policy_steps` > 0) overlaps rollout and learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rl.plan.flops import forward_flops_per_token

# Each figure below was measured on this repo's 2-core CPU hosts (docs/benchmarks.md), as a fraction
# of the matmul peak measured in the same process where it is an efficiency:
# - the learner: SmolLM2-135M, one GRPO step of 64 rows (bench.shared_prefix), FLOPs counted as
#   the learner does the work (the layers over the tokens it computes, the LM head over the
#   completion tokens only): bf16 0.20-0.31, fp32 0.46-0.63 (shared prefixes at the low end).
#   GPUs: peers report about the same fraction for small models, so the bf16 figure is used.
LEARNER_EFFICIENCY = {"bfloat16": 0.25, "float32": 0.5}
# - and per update, beside the FLOPs: AdamW reads and writes ~32 bytes per trained parameter
#   (fp32 master, gradient, two moments), plus DeepSpeed's fixed work (bench.planner's tiny model:
#   0.15 s of learner time for almost no FLOPs)
OPTIMIZER_BYTES_PER_PARAM = 32
LEARNER_STEP_OVERHEAD_S = 0.1
# - the rollout (bench.planner, SmolLM2 bf16 math_chat at 48 and 256 new tokens): every sample is
#   a request of its own (its own seed), so every sample's prompt is prefilled; a decode step
#   reads the weights once at the measured bandwidth, plus the engine's scheduling and sampling;
#   the batch's matmuls run at ~0.3 of the peak (bench.rollout: SmolLM2 bf16 decoding at 42 ms
#   per step = 13.7 ms of weights at 19.7 GB/s + 8.6 GFLOP at 0.85 TFLOP/s x 0.36)
PREFILL_EFFICIENCY = 0.25
DECODE_FLOP_EFFICIENCY = 0.3
DECODE_STEP_OVERHEAD_S = 0.004
REQUEST_OVERHEAD_S = 0.0007  # per request: admission, detokenizing, results (the tiny model's 512 requests: 0.41 s)
# - a full weight sync (bench.planner: 270 MB of SmolLM2 bf16 in 0.43 s: gloo broadcast and vLLM's load);
#   on GPUs (NCCL or CUDA IPC, and vLLM's load on the device) an assumed 20 GB/s, not measured here
#   (NVLink moves hundreds of GB/s; the engine's load bounds it)
SYNC_BYTES_PER_S = 0.6e9
SYNC_BYTES_PER_S_GPU = 20e9
# - what a step spends beyond the three (rewards, the driver's batching, logging), per sample
STEP_OVERHEAD_PER_SAMPLE_S = 0.0003


@dataclass(frozen=True)
class Lengths:
    """The token lengths a step's time depends on, and where they come from."""

    prompt: float  # mean prompt tokens (chat template applied)
    completion: float  # mean completion tokens per sample (model tokens, all turns)
    longest: float  # the longest completion of a step: the decode steps
    source: str


@dataclass(frozen=True)
class Host:
    """Speeds of the devices the roles run on, and where they come from."""

    peak_tflops: float  # matmuls in the run's dtype
    memory_gbps: float  # bytes read per second (decoding reads the weights once per step)
    source: str


@dataclass(frozen=True)
class StepTime:
    rollout_s: float
    learner_s: float
    sync_s: float
    other_s: float
    step_s: float


def predict_step(config: Mapping[str, Any], weight_bytes: float, s: Any, lengths: Lengths, host: Host,
                 trainable: int | None = None) -> StepTime:
    """Seconds of one step of a run with settings `s` (`rl.plan.memory_plan.Settings`) on a
    model of HF `config` (the keys `forward_flops_per_token` reads) holding `weight_bytes`, with
    `trainable` parameters in the optimizer (default: weight_bytes / the dtype's bytes)."""
    peak, bandwidth = host.peak_tflops * 1e12, host.memory_gbps * 1e9
    prompts, samples = s.prompts_per_step, s.samples_per_step
    workers = max(s.rollout_workers, 1)
    seq = lengths.prompt + lengths.completion
    head = 2.0 * config["hidden_size"] * config["vocab_size"]  # LM-head FLOPs of one token
    # rollout: each worker its share of the samples, all at once
    prefill = samples * lengths.prompt * forward_flops_per_token(config, lengths.prompt)
    decode = samples * lengths.completion * forward_flops_per_token(config, lengths.prompt + lengths.completion / 2)
    rollout_s = (prefill / (peak * PREFILL_EFFICIENCY) + decode / (peak * DECODE_FLOP_EFFICIENCY)
                 + samples * REQUEST_OVERHEAD_S) / workers
    weights_read = weight_bytes / max(s.tensor_parallel_size, 1)
    rollout_s += lengths.longest * (weights_read / bandwidth + DECODE_STEP_OVERHEAD_S)
    # learner: the layers over the tokens it computes (with shared prefixes each prompt once),
    # the LM head over the completion tokens; forward + backward, plus the scoring forwards
    computed = samples * seq
    if s.shared_prefix and s.n > 1:  # where the tree pays (trainer/prefix_tree.py `layout_cost`)
        computed = min(computed, prompts * lengths.prompt + samples * lengths.completion)
    forward = computed * (forward_flops_per_token(config, seq) - head) + samples * lengths.completion * head
    passes = 3.0 * s.ppo_epochs * (1 + (1 if s.critic else 0))
    passes += (s.kl_coef > 0) + s.recompute_old_logprobs + s.critic
    if s.gradient_checkpointing:
        passes += s.ppo_epochs
    learners = max(s.learners, 1)
    if trainable is None:
        trainable = int(weight_bytes / (2 if s.dtype == "bfloat16" else 4))
    updates = s.ppo_epochs * s.mini_batches
    learner_s = (forward * passes / (peak * LEARNER_EFFICIENCY.get(s.dtype, 0.25) * learners)
                 + updates * (trainable * OPTIMIZER_BYTES_PER_PARAM / learners / bandwidth + LEARNER_STEP_OVERHEAD_S))
    sync_s = weight_bytes / (SYNC_BYTES_PER_S_GPU if s.on_gpu else SYNC_BYTES_PER_S) if s.lora_rank == 0 else 0.0
    other_s = samples * STEP_OVERHEAD_PER_SAMPLE_S
    work = max(rollout_s, learner_s) if s.off_policy_steps > 0 else rollout_s + learner_s
    return StepTime(rollout_s, learner_s, sync_s, other_s, work + sync_s + other_s)
