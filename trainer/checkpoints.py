"""What one learner rank writes and reads: its training state (DeepSpeed checkpoints, every rank
its shard) and the policy as a transformers folder that vLLM and HF load directly."""

from __future__ import annotations

import os

from rl.wire import lora
from trainer.engine import full_state_dict


def save_state(path: str, engine, critic=None) -> None:
    """Full training state (weights, optimizer, lr schedule); the critic's in `critic/` beside it."""
    engine.save_checkpoint(path, tag="state")
    if critic is not None:
        critic.save_checkpoint(os.path.join(path, "critic"), tag="state")


def load_state(path: str, engine, critic=None) -> None:
    for each, where in ((engine, path), (critic, os.path.join(path, "critic"))):
        if each is None:
            continue
        loaded, _ = each.load_checkpoint(where, tag="state")
        if loaded is None:
            raise FileNotFoundError(f"no learner checkpoint under {where}")


def save_pretrained(path: str, adapter_path: str | None, engine, export, rank: int, zero_stage: int,
                    lora_cfg=None) -> None:
    """Every rank calls this (ZeRO-3 gathers are collective); rank 0 writes safetensors. With
    LoRA (`lora_cfg`) that is the base model with the adapters merged in, and `adapter_path` gets
    the adapters alone as a peft folder (`PeftModel.from_pretrained(base, adapter_path)`)."""
    if lora_cfg is None:
        state = export.state_dict()
        if rank == 0:
            engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
        return
    state = full_state_dict(engine.module, zero_stage)
    if rank != 0:
        return
    peft_model = engine.module
    adapters = {name: t for name, t in state.items() if ".lora_" in name}
    base = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): t
            for name, t in state.items() if ".lora_" not in name}
    merger = lora.AdapterMerger({n: base[n] for n in lora.kept_weight_names(base, lora_cfg.target_modules)},
                                lora_cfg.alpha / lora_cfg.rank)
    merged = dict(base)
    merged.update(merger.merged((lora.wire_name(n), t) for n, t in adapters.items()))
    peft_model.get_base_model().save_pretrained(path, state_dict=merged, safe_serialization=True)
    if adapter_path:
        peft_model.save_pretrained(adapter_path, state_dict=adapters, safe_serialization=True)
