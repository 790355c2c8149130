"""What a step costs: model FLOPs per trained token, the device's matmul peak, MFU and price.

MFU counts the work the model needs (forward + backward = 3 forward passes of the matmuls and
attention), not what an implementation happens to do (recomputed log-probs, checkpointed
activations), so it compares implementations honestly (PaLM's definition, Appendix B).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch


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


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 2048,
                          seconds: float = 0.5) -> float:
    """This process's measured square-matmul peak in TFLOP/s (with its torch thread count)."""
    device = torch.device(device)
    if device.type == "cuda":
        size = 8192
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: first call pays for thread-pool start and packing
    sync()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        done += 1
    sync()
    return 2.0 * size**3 * done / (time.perf_counter() - started) / 1e12


def step_cost(seconds: float, devices: int, price_per_device_hour: float) -> float:
    """Price of `seconds` of wall time on `devices` devices (learner ranks + rollout workers)."""
    return seconds / 3600.0 * devices * price_per_device_hour
