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

Phases: the rollout (prefill of each distinct prompt once, vLLM's prefix cache sharing it over a
group; then one decode step per token of the longest completion, each reading the weights once
and doing the batch's matmuls); the learner (3 forward passes of FLOPs over the tokens it
computes: every row's, or with shared prefixes each group's prompt once; plus the scoring
passes); the weight sync (the weights' bytes at the sync's measured rate). A synchronous step
is their sum; an asynchronous one (`algorithm.off_policy_steps` > 0) overlaps rollout and learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rl.plan.flops import forward_flops_per_token

# Measured by this repo's benchmarks on SmolLM2-135M (bench/README.md), as fractions of the peak
# measured in the same process:
# - the learner's MFU (bench.learner, padding-free varlen batch): bf16 0.40, fp32 0.66 of a CPU
#   peak; GPUs: the 0.4 peers report for small models (NeMo-RL's and verl's performance pages).
LEARNER_EFFICIENCY = {"bfloat16": 0.40, "float32": 0.60}
# - decoding (bench.rollout, vLLM CPU eager, 32 requests x 128 tokens): a step reads the weights
#   once at the measured bandwidth and runs the batch's matmuls at ~0.3 of the peak (SmolLM2 bf16:
#   42 ms per step = 13.7 ms of weights at 19.7 GB/s + 8.6 GFLOP at 0.85 TFLOP/s x 0.36).
DECODE_FLOP_EFFICIENCY = 0.3
DECODE_BANDWIDTH_EFFICIENCY = 1.0
# - the engine's own work per decode step (scheduling, sampling, detokenizing), CPU and GPU alike
DECODE_STEP_OVERHEAD_S = 0.004
PREFILL_EFFICIENCY = 0.3
# - a weight sync: bytes at this rate (bench.weight_sync, gloo broadcast + vLLM load, CPU)
SYNC_BYTES_PER_S = 0.4e9
# - what a step spends outside the three (rewards, the driver's batching, logging), per sample
STEP_OVERHEAD_PER_SAMPLE_S = 0.002


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


def predict_step(config: Mapping[str, Any], weight_bytes: float, s: Any, lengths: Lengths, host: Host) -> StepTime:
    """Seconds of one step of a run with settings `s` (`rl.plan.memory_plan.Settings`) on a
    model of HF `config` (the keys `forward_flops_per_token` reads) holding `weight_bytes`."""
    peak = host.peak_tflops * 1e12
    prompts, samples = s.prompts_per_step, s.samples_per_step
    workers = max(s.rollout_workers, 1)
    seq = lengths.prompt + lengths.completion
    # rollout: each worker its share of the prompts, all at once
    prefill = prompts * lengths.prompt * forward_flops_per_token(config, lengths.prompt)
    decode = samples * lengths.completion * forward_flops_per_token(config, lengths.prompt + lengths.completion / 2)
    rollout_s = (prefill / (peak * PREFILL_EFFICIENCY) + decode / (peak * DECODE_FLOP_EFFICIENCY)) / workers
    weights_read = weight_bytes / max(s.tensor_parallel_size, 1)
    rollout_s += lengths.longest * (weights_read / (host.memory_gbps * 1e9 * DECODE_BANDWIDTH_EFFICIENCY)
                                    + DECODE_STEP_OVERHEAD_S)
    # learner: forward + backward over the tokens it computes, plus the scoring forwards
    computed = samples * seq
    if s.shared_prefix and s.n > 1:  # where the tree pays (trainer/prefix_tree.py `layout_cost`)
        computed = min(computed, prompts * lengths.prompt + samples * lengths.completion)
    per_token = forward_flops_per_token(config, seq)
    passes = 3.0 * s.ppo_epochs * (1 + (1 if s.critic else 0))
    passes += (s.kl_coef > 0) + s.recompute_old_logprobs + s.critic
    if s.gradient_checkpointing:
        passes += s.ppo_epochs
    learner_s = computed * per_token * passes / (peak * LEARNER_EFFICIENCY.get(s.dtype, 0.4) * max(s.learners, 1))
    sync_s = weight_bytes / SYNC_BYTES_PER_S if s.lora_rank == 0 else 0.0
    other_s = samples * STEP_OVERHEAD_PER_SAMPLE_S
    work = max(rollout_s, learner_s) if s.off_policy_steps > 0 else rollout_s + learner_s
    return StepTime(rollout_s, learner_s, sync_s, other_s, work + sync_s + other_s)
