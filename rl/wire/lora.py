"""LoRA adapters on the weight-sync wire: names, and merging them into the rollout engine's weights.

With `model.lora.rank > 0` the learner trains only peft's LoRA matrices (A: [rank, in], B:
[out, rank] for each targeted linear layer) and a weight sync sends just those: a few percent of
the model. The rollout side merges them into the base weights it kept from `model.path`,
W = W0 + (alpha / rank) * B @ A, computed in fp32 from W0 as the checkpoint stores it and cast to
the engine's dtype once (merging into bf16-rounded W0 rounds twice and loses small updates: on
SmolLM2 in bf16 that raised the learner-rollout mismatch from 0.060 to 0.091 nats), and loads W like
any full weight. Merging on
receive works with every engine (vLLM and HF) and keeps generation at full speed: no adapter
kernels in the sampling loop.

vLLM stacks some projections into one layer (q/k/v into qkv_proj, gate/up into gate_up_proj) and
a layer whose weights arrive only in part would be re-made with the missing part uninitialised;
so the rollout side keeps and sends every projection of a stack any targeted module belongs to
(`stacked_targets`), merged or as it was. Pure tensors: no peft, Ray or vLLM here.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

# Projections vLLM loads into one stacked layer (Llama, Mistral, Qwen and the like).
STACKS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PEFT_PREFIX = "base_model.model."


def wire_name(param_name: str) -> str:
    """The name a LoRA matrix travels under: peft's parameter name without its wrapper prefix,
    adapter name and `.weight`, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`
    -> `model.layers.0.self_attn.q_proj.lora_A`."""
    name = param_name.removeprefix(_PEFT_PREFIX).removesuffix(".weight")
    for part in ("lora_A", "lora_B"):
        if name.endswith(f".{part}"):  # as peft saves it (no adapter name)
            return name
        head, sep, _adapter = name.rpartition(f".{part}.")
        if sep:
            return f"{head}.{part}"
    raise ValueError(f"{param_name!r} is not a LoRA matrix (no .lora_A. or .lora_B. in its name)")


def split_wire_name(name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.lora_A` -> (`model.layers.0.self_attn.q_proj`, `lora_A`)."""
    module, _, part = name.rpartition(".")
    if part not in ("lora_A", "lora_B") or not module:
        raise ValueError(f"{name!r} is not a LoRA wire name (<module>.lora_A or <module>.lora_B)")
    return module, part


def stacked_targets(target_modules: Iterable[str]) -> set[str]:
    """The targeted module names plus every projection stacked with one of them by vLLM."""
    targets = set(target_modules)
    for stack in STACKS:
        if targets & set(stack):
            targets |= set(stack)
    return targets


def kept_weight_names(names: Iterable[str], target_modules: Iterable[str]) -> list[str]:
    """The checkpoint weights (`<module>.weight`) the rollout side keeps to merge into."""
    wanted = stacked_targets(target_modules)
    return [n for n in names if n.endswith(".weight") and n.removesuffix(".weight").rpartition(".")[2] in wanted]


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """W0 + scaling * B @ A in fp32, returned in `dtype` (default W0's), on the adapter's device:
    W0 may be kept on the host (the rollout side keeps it there, outside the engine's GPU share)
    and is copied over one weight at a time."""
    if a.shape[1] != base.shape[1] or b.shape[0] != base.shape[0] or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a weight of "
                         f"shape {tuple(base.shape)}")
    device = a.device
    return (base.to(device).float() + scaling * (b.to(device).float() @ a.float())).to(dtype or base.dtype)


class AdapterMerger:
    """The rollout side of a LoRA sync: the base weights it keeps, and the merge of every
    adapter that arrives into them (the base weights themselves are never changed)."""

    def __init__(self, base: dict[str, torch.Tensor], scaling: float, dtype: torch.dtype | None = None) -> None:
        """`base`: the weights as the checkpoint stores them (fp32 where it does: a bf16 engine
        then gets round(W0 + delta) rather than round(round(W0) + delta), which drops small
        adapter updates twice); `dtype`: the engine's (default: each base weight's own)."""
        self.base, self.scaling, self.dtype = base, scaling, dtype

    def merged(self, adapter: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(weight name, merged weight) for every kept weight: those with an A and B in `adapter`
        merged as soon as both arrived, the others (stacked siblings) as they were, at the end."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        for name, tensor in adapter:
            module, part = split_wire_name(name)
            weight = f"{module}.weight"
            if weight not in self.base:
                raise KeyError(f"LoRA matrix {name!r} targets {weight!r}, which the rollout side did not keep from "
                               "the model's checkpoint: learner and rollout disagree on model.lora.target_modules")
            pair = pending.setdefault(module, {})
            pair[part] = tensor
            if len(pair) == 2:
                yield weight, merge(self.base[weight], pair["lora_A"], pair["lora_B"], self.scaling, self.dtype)
                done.add(weight)
                del pending[module]
        if pending:
            raise ValueError(f"LoRA matrices without their pair: {sorted(pending)}")
        for weight, tensor in self.base.items():
            if weight not in done:
                yield weight, tensor.to(self.dtype or tensor.dtype)
