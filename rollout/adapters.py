"""The base weights a LoRA sync is merged into, on the rollout side: read from the model's
safetensors files by whichever process loads the weights into the engine (the `RolloutWorker`
actor, `rollout/worker.py`, or each of vLLM's worker processes, `rollout/vllm_worker.py`). Below
both, so neither reaches up to the other."""

from __future__ import annotations

import os

import torch

from rl.wire.lora import AdapterMerger, kept_weight_names
from rollout.protocol import RolloutSpec


def adapter_merger(spec: RolloutSpec) -> AdapterMerger | None:
    """With `model.lora`: the base weights of the targeted (and stacked) modules, read from the
    model's safetensors files, that every LoRA sync is merged into; else None (full syncs). Kept
    in host memory, not on the engine's GPU: vLLM has already claimed its share of that, and the
    planner counts this copy on the host (each merge copies one weight over, `rl.wire.lora.merge`)."""
    cfg = spec.model.lora
    if cfg.rank <= 0:
        return None
    import glob

    from safetensors import safe_open

    dtype = getattr(torch, spec.model.dtype)
    base: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(spec.model.path, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in kept_weight_names(f.keys(), cfg.target_modules):
                weight = f.get_tensor(name)  # kept as stored (fp32 when it is): merged, then cast once
                base[name] = weight.to(torch.float32 if weight.dtype == torch.float32 else dtype)
    if not base:
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: no such weights in the "
                         f"safetensors files of {spec.model.path}")
    return AdapterMerger(base, cfg.alpha / cfg.rank, dtype)
