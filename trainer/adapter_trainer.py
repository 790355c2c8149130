"""`AdapterTrainer`: one training model of the Tinker service (launch/tinker/): a LoRA adapter set
over the base model in its own one-process DeepSpeed engine, trained by the client's calls.

The client drives every step itself: `forward_backward` adds the gradient of a loss it names
(rl/algo/datum_losses.py) over the data it sends, as many times as it likes; `optim_step` applies
them with the Adam hyper-parameters of that call and clears them. Each training model is its own
actor (its own process, base weights and optimizer), so clients training at once never see each
other's weights. Adapters are saved as peft folders, which vLLM's LoRA samples with
(`GenerationRequest.adapter`). A plain class: `launch/tinker/` runs it as a Ray actor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rl.algo.datum_losses import DatumLoss, datum_loss

LORA_ALPHA = 32.0  # the scale Tinker's LoRA uses whatever the rank (alpha / rank multiplies B @ A)
STATE_META = "adapter_trainer.json"  # beside a saved state: what the adapter is (create-from-state reads it)


@dataclass
class AdapterSpec:
    """What a training model is built from (plain data: it crosses a Ray boundary)."""

    base_path: str  # the base model's folder (the Hugging Face cache resolves a Hub id to one)
    base_model: str  # the name the client asked for (reported back in get_info)
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0
    dtype: str = "float32"
    threads: int = 0  # torch threads (0: leave them)
    max_tokens_per_micro_batch: int = 4096  # padded tokens per forward pass


@dataclass
class Datum:
    """One sequence of a forward_backward call: the model's input tokens and the loss's inputs,
    each [len(tokens)] (target_tokens int64; weights, logprobs, advantages float32)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def lora_targets(model: torch.nn.Module, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    """The linear layers' names LoRA adapts, by the part of the model they sit in: attention
    (a module path with `attn`), MLP (`mlp`, MoE experts included) and the LM head (`lm_head`)."""
    names: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = path.rpartition(".")[2]
        if path.endswith("lm_head"):
            if train_unembed:
                names.add(leaf)
        elif "attn" in path:
            if train_attn:
                names.add(leaf)
        elif "mlp" in path or "expert" in path:
            if train_mlp:
                names.add(leaf)
    return sorted(names)


class AdapterTrainer:
    def __init__(self, spec: AdapterSpec):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from trainer.engine import build_engine, ds_config, init_single_process

        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        torch.manual_seed(spec.seed)
        init_single_process()
        targets: list[str] = []

        def load() -> torch.nn.Module:
            model = AutoModelForCausalLM.from_pretrained(spec.base_path, dtype=getattr(torch, spec.dtype))
            targets.extend(lora_targets(model, spec.train_attn, spec.train_mlp, spec.train_unembed))
            if not targets:
                raise ValueError(f"{spec.base_model}: no linear layers to adapt with train_attn={spec.train_attn}, "
                                 f"train_mlp={spec.train_mlp}, train_unembed={spec.train_unembed}")
            return get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, target_modules=targets,
                                                    lora_dropout=0.0, bias="none"))

        config = ds_config(micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=0, dtype=spec.dtype)
        # the client's Adam settings are set on each optim_step; the schedule never changes them
        self.engine = build_engine(load, config, lr=1e-4, weight_decay=0.0, lr_lambda=lambda _: 1.0)
        self.targets = targets
        self.engine.train()
        self.steps = 0

    def where(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "targets": self.targets}

    def info(self) -> dict[str, Any]:
        params = list(self.engine.module.parameters())
        return {"lora_rank": self.spec.rank, "targets": self.targets, "steps": self.steps,
                "trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}

    # ---- the model's log-probs of the targets ----------------------------------------------------

    def _target_logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """log p(target_tokens[t] | tokens[:t+1]) of each datum ([len(tokens)], with gradient when
        it is enabled), over micro-batches of at most `max_tokens_per_micro_batch` padded tokens."""
        from trainer.logprobs import token_logprobs

        out: list[torch.Tensor] = []
        budget = self.spec.max_tokens_per_micro_batch
        start = 0
        while start < len(data):
            end, width = start, 0
            while end < len(data) and (end == start or max(width, len(data[end].tokens) + 1) * (end - start + 1) <= budget):
                width = max(width, len(data[end].tokens) + 1)
                end += 1
            part = data[start:end]
            ids = torch.zeros((len(part), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, d in enumerate(part):
                targets = d.inputs["target_tokens"].long()
                row = list(d.tokens) + [int(targets[-1])] if len(d.tokens) else []
                ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
                mask[i, :len(row)] = 1
            shifted = all(torch.equal(d.inputs["target_tokens"].long()[:-1], torch.tensor(d.tokens[1:], dtype=torch.long))
                          for d in part)
            if shifted:  # the usual case: each target is the next input token (the LM head chunked)
                logp, _ = token_logprobs(self.engine, ids, mask)
            else:  # targets of the client's own choosing: gather them from the whole logits
                logits = self.engine(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=False).logits
                targets = torch.zeros((len(part), width - 1), dtype=torch.long)
                for i, d in enumerate(part):
                    targets[i, :len(d.tokens)] = d.inputs["target_tokens"].long()
                logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
            out += [logp[i, :len(d.tokens)] for i, d in enumerate(part)]
            start = end
        return out

    # ---- the client's calls ----------------------------------------------------------------------

    def forward_backward(self, data: list[Datum], loss_name: str, loss_config: dict[str, float],
                         forward_only: bool = False) -> dict[str, Any]:
        """The loss `loss_name` over `data` (a sum over data and tokens) and, unless `forward_only`,
        its gradient added to the adapters'. Returns per datum its target log-probs and per-token
        loss, and the metrics `loss:sum`."""
        loss = DatumLoss.of(loss_name, loss_config)
        for i, d in enumerate(data):
            missing = [k for k in loss.inputs if k not in d.inputs]
            if missing:
                raise ValueError(f"datum {i}: loss_fn={loss_name!r} needs loss_fn_inputs {missing}")
            extra = sorted(set(d.inputs) - set(loss.inputs))
            if extra:
                raise ValueError(f"datum {i}: loss_fn={loss_name!r} takes loss_fn_inputs {list(loss.inputs)}, not "
                                 f"{extra} (per-token clip thresholds are not served: use loss_fn_config)")
            bad = [k for k in loss.inputs if tuple(d.inputs[k].shape) != (len(d.tokens),)]
            if bad:
                raise ValueError(f"datum {i}: loss_fn_inputs {bad} must have shape [{len(d.tokens)}] (one value per "
                                 "input token)")
        with torch.set_grad_enabled(not forward_only):
            logps = self._target_logprobs(data)
            total = torch.zeros(())
            per_datum = []
            for d, logp in zip(data, logps):
                value, per_token = datum_loss(loss, logp, d.inputs)
                total = total + value
                per_datum.append({"logprobs": logp.detach().float().cpu(), "elementwise_loss": per_token.detach().float().cpu()})
            if not forward_only:
                if not math.isfinite(float(total.detach())):
                    raise ValueError(f"the loss is {float(total)}: check the advantages and logprobs sent")
                self.engine.backward(total, scale_wrt_gas=False)
        return {"outputs": per_datum, "metrics": {"loss:sum": float(total.detach())}}

    def optim_step(self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-12,
                   weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> dict[str, float]:
        """One AdamW step with these settings on the gradients added since the last one (none: the
        parameters stay, Adam's moments do not move)."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))) if grads else 0.0
        if grad_clip_norm > 0 and norm > grad_clip_norm:
            for g in grads:
                g.mul_(grad_clip_norm / (norm + 1e-6))
        for group in self.engine.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        if grads:
            self.engine.step()
            self.steps += 1
        self.engine.module.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "learning_rate": learning_rate}

    # ---- files -----------------------------------------------------------------------------------

    def save_adapter(self, path: str) -> str:
        """The adapters alone as a peft folder (what a sampler loads), written whole or not at all;
        a folder saved before under `path` is replaced by the new one (`swap_in`)."""
        tmp = _fresh(path)
        self.engine.module.save_pretrained(tmp, safe_serialization=True)
        return swap_in(tmp, path)

    def save_state(self, path: str) -> str:
        """Adapters and optimizer (DeepSpeed's checkpoint), and what the adapter is (`STATE_META`),
        replacing a state saved before under `path`."""
        tmp = _fresh(path)
        self.engine.save_checkpoint(tmp, tag="state")
        with open(os.path.join(tmp, STATE_META), "w") as f:
            json.dump(asdict(self.spec), f)
        return swap_in(tmp, path)

    def load_state(self, path: str, optimizer: bool) -> None:
        """The adapters of a saved state, and its optimizer's moments too when `optimizer`."""
        loaded, _ = self.engine.load_checkpoint(path, tag="state", load_optimizer_states=optimizer,
                                                load_lr_scheduler_states=optimizer, load_module_strict=False)
        if loaded is None:
            raise FileNotFoundError(f"no saved training state under {path}")
        self.engine.module.zero_grad(set_to_none=True)


def _fresh(path: str) -> str:
    """An empty folder beside `path` to write a save into (removed first if a failed save left it)."""
    tmp = f"{path}~tmp"  # (~: never in a checkpoint name, launch/tinker/registry._NAME)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    return tmp


def swap_in(tmp: str, path: str) -> str:
    """Put the folder `tmp` at `path`, replacing what was there: the old folder is moved aside, the
    new one renamed in, the old one removed. A reader of `path` finds the old files or the new ones,
    never a mix; the new folder (and its files) are new inodes, which is how the rollout engine
    tells a second save under the same name from the first (rollout/vllm_engine.AdapterRequests)."""
    old = None
    if os.path.exists(path):
        old = f"{path}~old-{os.getpid()}-{time.monotonic_ns()}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def saved_spec(path: str) -> AdapterSpec:
    """The AdapterSpec a state under `path` was saved with."""
    with open(os.path.join(path, STATE_META)) as f:
        return AdapterSpec(**json.load(f))
