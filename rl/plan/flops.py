"""What a step costs: model FLOPs per trained token, the device's matmul peak, MFU and price.

Two utilisations, each named for what it is (`utilisation`):

- effective MFU (`perf/effective_mfu_frac`): the work the model needs for the trained tokens,
  every row as if alone (forward + backward = 3 forward passes of the matmuls and causal
  attention; `train_flops`), per second over the peak. Not what an implementation happens to do
  (recomputed log-probs, checkpointed activations), so it compares implementations (PaLM's
  definition, Appendix B); a layout that computes less than that work (shared prefixes computed
  once) reads above the hardware's figure, and may pass 100%.
- hardware utilisation (`perf/hw_util_frac`): the FLOPs the kernels computed (`kernel_train_flops`
  over the layout that ran: a shared prefix once, padding and filler slots as computed, attention
  dense over each model row, the scoring forwards, recomputations), per second over the measured
  peak. Above 100% means the peak probe read the host too low.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # torch only where a device is measured: the planner's estimate runs before
    import torch  # a run starts, where a refused command must answer at once


def forward_flops_per_token(config: Mapping[str, Any], seq_len: float) -> float:
    """Forward FLOPs of one token of a decoder-only transformer (a HF config as a dict).

    2 FLOPs per weight of every matmul (attention projections with grouped KV heads, the gated
    MLP, the LM head; the embedding lookup is free) plus attention's QK^T and AV over the causal
    context, on average half of `seq_len` positions: 2 * 2 * d_attn * seq_len / 2 per layer.
    """
    hidden = config["hidden_size"]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    matmul_weights = layers * (attn + mlp) + hidden * config["vocab_size"]
    return 2.0 * matmul_weights + layers * 2.0 * heads * head_dim * seq_len


def train_flops(config: Mapping[str, Any], lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of these lengths (backward = 2 forwards)."""
    return sum(3.0 * forward_flops_per_token(config, n) * n for n in lengths)


def layers_forward_flops(config: Mapping[str, Any], rows: int, length: int) -> float:
    """Forward FLOPs of the model's layers (no LM head) over `rows` model rows of `length` slots
    each, every slot computed (filler and padding too) and attention dense over the row (a
    masked-out pair costs as much as a kept one: a 4D or block-causal mask is applied, not skipped).
    Mixture-of-experts models count the experts each token is routed to."""
    hidden = config["hidden_size"]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    experts = config.get("num_experts_per_tok") or 1
    inter = (config.get("moe_intermediate_size") or config["intermediate_size"]) if experts > 1 else config["intermediate_size"]
    per_token = 2.0 * layers * (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
                                + 3 * hidden * inter * experts)
    return rows * length * (per_token + layers * 4.0 * heads * head_dim * length)


def head_forward_flops(config: Mapping[str, Any], tokens: int) -> float:
    """Forward FLOPs of the LM head over `tokens` selected positions (the learner applies it to
    the positions it needs only, `trainer/logprobs.py`)."""
    return 2.0 * config["hidden_size"] * config["vocab_size"] * tokens


def train_passes(checkpointing: bool = False, frozen: bool = False) -> int:
    """Forward passes' worth of FLOPs a training step computes over the layers: forward + backward
    (input and weight gradients, 2 forwards' worth; frozen weights, LoRA's, get no weight gradient:
    1), one more forward under activation checkpointing."""
    return 1 + (1 if frozen else 2) + int(checkpointing)


def kernel_train_flops(config: Mapping[str, Any], rows: int, length: int, head_tokens: int,
                       checkpointing: bool = False, frozen: bool = False) -> float:
    """FLOPs the kernels compute in one training forward + backward of a micro-batch laid out as
    `rows` x `length` model slots (`trainer.layouts.Layout.input_ids`' shape), the LM head over
    `head_tokens` positions: its chunks are recomputed in the backward (trainer/logprobs.py), so 4
    of its matmuls (3 when its weight is `frozen`)."""
    layers = layers_forward_flops(config, rows, length) * train_passes(checkpointing, frozen)
    return layers + head_forward_flops(config, head_tokens) * (3 if frozen else 4)


def utilisation(train_metrics: Mapping[str, float], learner_s: float, ranks: int) -> dict[str, float]:
    """The learner's effective MFU and hardware utilisation over `learner_s` seconds on `ranks`
    ranks, from the reduced metrics `perf/model_tflop` (unshared model FLOPs), `perf/kernel_tflop`
    (FLOPs the kernels computed) and `perf/peak_tflops` (the measured peak of one rank); {} when
    they are missing. Nothing is clamped: a hardware figure over 1 is reported as it is (the step
    line names the probe then, `rl/log/run_log.py`)."""
    peak = train_metrics.get("perf/peak_tflops", 0.0)
    if peak <= 0 or learner_s <= 0:
        return {}
    capacity = learner_s * peak * ranks
    out: dict[str, float] = {}
    if "perf/model_tflop" in train_metrics:
        out["perf/effective_mfu_frac"] = train_metrics["perf/model_tflop"] / capacity
    if "perf/kernel_tflop" in train_metrics:
        out["perf/hw_util_frac"] = train_metrics["perf/kernel_tflop"] / capacity
    return out


def matmul_peak_tflops(dtype: torch.dtype, device: torch.device | str, config: Mapping[str, Any] | None = None,
                       seconds: float = 0.5) -> float:
    """The peak the learner's utilisation is measured against: the best of the square probe and
    (given the model's `config`) a probe of the model's own MLP product, [tokens, hidden] x
    [hidden, intermediate], both in the run's `dtype` on its device. A model's matmuls can run
    faster than a 2048-square product (another blocking, a shape the library tunes for); against
    the square figure alone the kernels' utilisation would read over 100%."""
    best = measure_matmul_tflops(dtype, device, seconds=seconds)
    if config and config.get("hidden_size") and config.get("intermediate_size"):
        tokens = 8192 if torch_device_type(device) == "cuda" else 4096
        mlp = (tokens, int(config["hidden_size"]), int(config["intermediate_size"]))
        best = max(best, measure_matmul_tflops(dtype, device, seconds=seconds, shape=mlp))
    return best


def torch_device_type(device: torch.device | str) -> str:
    return device.type if hasattr(device, "type") else str(device).split(":")[0]


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 2048,
                          seconds: float = 0.5, windows: int = 1, budget_s: float | None = None,
                          shape: tuple[int, int, int] | None = None) -> float:
    """This process's measured square-matmul peak in TFLOP/s (with its torch thread count): the best
    of `windows` timed windows of `seconds` (each at least one product), stopping once `budget_s`
    has passed after the first.

    A dtype this host computes far slower than fp32 (bf16 on a CPU without AMX: ~1 GFLOP/s, so one
    2048-square product takes ~17 s) is probed at a smaller size: a 256-square product first tells
    the speed, and `size` halves while one product would take over 2 windows. The probe then costs
    about `budget_s`, not minutes, and its figure is the same order (small products run a little
    below the peak). `shape` (m, k, n): an [m, k] x [k, n] product instead of a square one (m
    halves as `size` does on a slow dtype)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        size = 8192
    m, k, n = shape if shape is not None else (size, size, size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(a, b) -> float:
        started = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - started

    if device.type != "cuda":
        small = torch.randn(256, 256, dtype=dtype, device=device)
        timed(small, small)  # the first call pays for thread-pool start and packing
        per_flop = timed(small, small) / (2.0 * 256**3)
        while m > 256 and per_flop * 2.0 * m * k * n > 2 * seconds:
            m //= 2
            if shape is None:
                k = n = m
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    timed(a, b)  # warm-up at this size
    best, first = 0.0, time.perf_counter()
    for _ in range(windows):
        done, started = 0, time.perf_counter()
        while done == 0 or time.perf_counter() - started < seconds:
            a @ b
            sync()  # else a GPU queues far more than `seconds` of matmuls before the clock is read
            done += 1
        best = max(best, 2.0 * m * k * n * done / (time.perf_counter() - started) / 1e12)
        if budget_s is not None and time.perf_counter() - first > budget_s:
            break
    return best


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Host memory bandwidth as this process sees it (its torch threads): the best of `repeats`
    copies of a `mib` MiB tensor, bytes read + written per second, in GB/s. What bounds decoding:
    every token step reads all the weights once."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best / 1e9


# Memory bandwidth from NVIDIA's datasheets, GB/s per GPU (A100: the 80 GB SXM figure).
DATASHEET_GBPS: dict[str, float] = {"H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0, "A100": 2039.0,
                                    "L40S": 864.0, "L4": 300.0, "RTX 4090": 1008.0, "H20": 4000.0,
                                    "GB200": 8000.0}

# Dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's datasheets, TFLOP/s at boost clock, per
# GPU: (bf16, tf32, fp32 without tensor cores). fp32 matmuls run at the tf32 figure only where torch
# allows TF32 (`torch.backends.cuda.matmul.allow_tf32`, off by default), else at the fp32 one.
DATASHEET_TFLOPS: dict[str, tuple[float, float, float]] = {
    "H100 SXM": (989.4, 494.7, 66.9),
    "H100 PCIe": (756.5, 378.0, 51.2),
    "H200": (989.4, 494.7, 66.9),  # H200 SXM: the H100 SXM's compute
    "A100": (312.0, 156.0, 19.5),  # SXM and PCIe, 40 and 80 GB
    "L40S": (362.05, 183.0, 91.6),
    "L4": (121.0, 60.0, 30.3),
    "RTX 4090": (165.2, 82.6, 82.6),  # Ada whitepaper: bf16 with fp32 accumulate
    "H20": (148.0, 74.0, 44.0),  # NVIDIA H20 product brief
    "GB200": (2500.0, 1250.0, 90.0),  # one Blackwell GPU of a GB200 NVL72: the rack's dense figures / 72
}
# torch.cuda.get_device_name() (upper-cased) -> card; first match wins. Other variants (H100/H200
# NVL, H800, A800, RTX 4090 D, AWS's A10G, which has no NVIDIA datasheet) have other peaks and are
# not in the table.
_CARDS = ((r"H100.*PCIE", "H100 PCIe"), (r"H100(?!.*NVL)", "H100 SXM"), (r"H200(?!.*NVL)", "H200"),
          (r"A100", "A100"), (r"L40S", "L40S"), (r"\bL4\b", "L4"), (r"RTX 4090(?! D)", "RTX 4090"),
          (r"\bH20\b", "H20"), (r"GB200", "GB200"))


def datasheet_card(device_name: str) -> str | None:
    """The `DATASHEET_TFLOPS` entry of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    name = device_name.upper()
    return next((card for pattern, card in _CARDS if re.search(pattern, name)), None)


def datasheet_tflops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The card's datasheet dense peak for matmuls in `dtype` (float32 at the TF32 rate when `tf32`),
    or None for a card not in the table (report the measured peak alone then)."""
    import torch

    card = datasheet_card(device_name)
    if card is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    bf16, tf32_peak, fp32 = DATASHEET_TFLOPS[card]
    return bf16 if dtype == torch.bfloat16 else (tf32_peak if tf32 else fp32)


def step_cost(seconds: float, devices: int, price_per_device_hour: float) -> float:
    """Price of `seconds` of wall time on `devices` devices (learner ranks + rollout workers)."""
    return seconds / 3600.0 * devices * price_per_device_hour
