"""Device check: our torch-side code on a GPU against CPU and float64 references, in one short run.

1. logprobs: `trainer.logprobs.token_logprobs` on a SmolLM2-135M-shaped toy causal LM defined here
   (torch only: vocab 49,152, hidden 576, 2 layers, head tied to the embedding; it takes what
   token_logprobs passes: input_ids, attention_mask or packed position_ids, output_hidden_states,
   logits_to_keep). Rows long enough for several chunks of `LOGPROB_CHUNK_TOKENS`, a prompt prefix
   left out. Against plain log_softmax/gather in float64 on the CPU: fp32 (< 1e-4), fp32 with
   entropy at temperature 0.7 (< 1e-4), bf16 (figures only); packed vs padded fp32 (< 1e-5);
   chunked vs one chunk (< 1e-5); gradients of sum(logp) [+ 0.5 sum(entropy)] w.r.t. every
   parameter (the head's weight is the embedding's) against a plain full-logits autograd pass on the
   same device, for the bias-free Linear head (custom backward) and another head class
   (checkpointed chunks): relative error < 1e-4.
2. objective: `rl.algo.objective.policy_objective` for every policy_loss x loss_agg (importance
   corrections in turn, entropy bonus and KL term on): loss and the gradients to logp and entropy
   on the device vs the CPU, fp32, relative error < 1e-5 (fp32 sums over ~10^3 tokens reduced in another order on the GPU differ by ~10 ulp: 1.7e-6 was seen on an H100).
3. shared_prefix: `trainer.layouts.plan_layout` with shared prefixes (trainer/prefix_tree.py) on
   the device: a group's rows as one tree against packed rows, fp32 values < 1e-5 and gradients
   relative < 1e-4, bf16 figures, `prefix_sharing_matches`; then forward + backward seconds of a
   30-layer toy in bf16, packed against shared, at a math_chat shape and a long-completion one.
4. peak: the in-process matmul probe the planner uses (`rl.plan.flops.measure_matmul_tflops`)
   beside the card's datasheet peak, bf16 and fp32.
5. weight_wire: `rl.wire.collective` over a gloo group between two spawned processes: the sender
   holds the toy model's parameters on the device and sends `trainer.weights.WeightExport`
   (ZeRO-0) buckets as host copies, as rl/wire/collective.py's CollectiveSender does when
   `on_host`; the CPU receiver checks every tensor is equal; MB/s (1e6 bytes) in fp32 and bf16.

Figures print as PASS/FAIL lines and go to $OUT/gpu_check.json (OUT default /tmp); exit status 1
when a check fails. Needs torch plus hydra-core/omegaconf (for rl.config.schema) only:
    .venv/bin/python bench/gpu_check.py --device cpu            # here
    python -m pip install --no-index --no-deps --target /tmp/site .gpu_wheels/*.whl \
      && PYTHONPATH=/tmp/site:. python bench/gpu_check.py --device cuda   # GPU box, carry .gpu_wheels
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from rl.algo.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, LossNormalizer  # noqa: E402
from rl.algo.objective import policy_objective  # noqa: E402
from rl.config.schema import AlgorithmConfig  # noqa: E402
from rl.plan.memory_plan import LOGPROB_CHUNK_TOKENS  # noqa: E402
from rl.wire import collective  # noqa: E402
from rl.plan.flops import datasheet_tflops, measure_matmul_tflops  # noqa: E402
from trainer.layouts import plan_layout  # noqa: E402
from trainer.logprobs import packing_matches, prefix_sharing_matches, token_logprobs  # noqa: E402
from trainer.packing import pack_rows  # noqa: E402
from trainer.weights import WeightExport  # noqa: E402

VOCAB, HIDDEN, HEADS, FFN, LAYERS, MAX_POS = 49152, 576, 9, 1536, 2, 1024  # SmolLM2-135M's vocab/hidden/heads
LENGTHS, PROMPT = (768, 640, 512, 384, 256, 128), 16  # 2,688 tokens: 3 chunks; 6 rows pack into 4 bins


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN, eps=1e-5), nn.RMSNorm(HIDDEN, eps=1e-5)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up, self.down = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class ToyLM(nn.Module):
    """What token_logprobs needs of a HF causal LM: hidden_states[-1] is the final-normed state;
    position ids restarting at 0 without an attention mask mean packed rows (block-causal)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(MAX_POS, HIDDEN)
        self.layers, self.norm = nn.ModuleList(Layer() for _ in range(layers)), nn.RMSNorm(HIDDEN, eps=1e-5)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        self.lm_head.weight = self.embed.weight  # tied, as SmolLM2's

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, output_hidden_states=False,
                logits_to_keep=0, **_):
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        if attention_mask is not None and attention_mask.dim() == 4:  # a prepared (tree) mask, as HF takes one
            mask = attention_mask
        elif position_ids is None:
            am = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            position_ids, mask = (am.long().cumsum(-1) - 1).clamp(min=0), (causal & am.bool()[:, None, :])[:, None]
        else:
            seq = (position_ids == 0).long().cumsum(-1)
            mask = (causal & (seq[:, :, None] == seq[:, None, :]))[:, None]
        x = self.embed(input_ids) + self.pos(position_ids)
        hidden = [x]
        for layer in self.layers:
            x = layer(x, mask)
            hidden.append(x)
        hidden[-1] = x = self.norm(x)
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return SimpleNamespace(logits=logits, hidden_states=tuple(hidden) if output_hidden_states else None)


class OtherHead(nn.Linear):
    """Not exactly nn.Linear: token_logprobs takes its checkpointed-chunk path."""


def toy_model(seed: int = 0, layers: int = LAYERS) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(layers)


def item(out: dict, name: str, ok: bool, **nums) -> None:
    out[name] = {"pass": bool(ok), **nums}
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in nums.items())
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: {shown}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(LENGTHS), width), generator=g) * mask
    positions = mask[:, 1:].bool() & (torch.arange(width - 1)[None] >= PROMPT - 1)  # completion tokens only
    return ids, mask, positions


def reference(base: ToyLM, ids, mask, positions, temps=(1.0, 0.7)) -> dict:
    """Plain float64 CPU log_softmax/gather (and entropy) per temperature, [B, T-1], 0 elsewhere."""
    ref = copy.deepcopy(base).double()
    out = {t: (torch.zeros(positions.shape, dtype=torch.float64), torch.zeros(positions.shape, dtype=torch.float64))
           for t in temps}
    with torch.no_grad():
        h = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
        h, targets = h[:, :-1][positions], ids[:, 1:][positions]
        for t in temps:
            lps, ents = [], []
            for s in range(0, len(h), 512):
                logp = (F.linear(h[s:s + 512], ref.lm_head.weight) / t).log_softmax(-1)
                lps.append(logp.gather(-1, targets[s:s + 512, None])[:, 0])
                ents.append(-(logp.exp() * logp).sum(-1))
            out[t][0][positions], out[t][1][positions] = torch.cat(lps), torch.cat(ents)
    return out


def diff(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> tuple[float, float]:
    d = (a.detach().double().cpu() - b.double().cpu())[where].abs()
    return float(d.mean()), float(d.max())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm().clamp(min=1e-30))


def plain_loss(model, ids, mask, positions, temperature: float, entropy: bool) -> torch.Tensor:
    """sum(logp) [+ 0.5 sum(entropy)] through the full logits of the selected tokens, plain autograd."""
    h = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    logp = (model.lm_head(h[:, :-1][positions]).float() / temperature).log_softmax(-1)
    loss = logp.gather(-1, ids[:, 1:][positions][:, None]).sum()
    return loss + 0.5 * -(logp.exp() * logp).sum() if entropy else loss


def grads_of(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_logprobs(device: torch.device) -> dict:
    out: dict = {}
    base = toy_model()
    ids_c, mask_c, pos_c = make_batch()
    selected = int(pos_c.sum())
    packed = pack_rows(ids_c, mask_c)
    ref = reference(base, ids_c, mask_c, pos_c)
    ids, mask, pos = ids_c.to(device), mask_c.to(device), pos_c.to(device)
    model = copy.deepcopy(base).to(device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, mask, positions=pos)
        sync(device)
        started = time.perf_counter()
        lp, _ = token_logprobs(model, ids, mask, positions=pos)
        sync(device)
        call_ms = 1e3 * (time.perf_counter() - started)
        mean, worst = diff(lp, ref[1.0][0], pos_c)
        outside = float(lp.detach().cpu()[~pos_c].abs().max())
        item(out, "fp32_vs_fp64", worst < 1e-4 and outside == 0, mean_abs=mean, max_abs=worst, tokens=selected,
             chunks=math.ceil(selected / LOGPROB_CHUNK_TOKENS), chunk_tokens=LOGPROB_CHUNK_TOKENS,
             outside_max=outside, call_ms=call_ms)
        lp7, ent7 = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=True, entropy_grad=False,
                                   positions=pos)
        (m1, w1), (m2, w2) = diff(lp7, ref[0.7][0], pos_c), diff(ent7, ref[0.7][1], pos_c)
        item(out, "fp32_entropy_t0.7", max(w1, w2) < 1e-4, logp_mean=m1, logp_max=w1, entropy_mean=m2, entropy_max=w2)
        one, _ = token_logprobs(model, ids, mask, positions=pos, chunk_tokens=selected)
        item(out, "chunked_vs_one_chunk", float((lp - one).abs().max()) < 1e-5, max_abs=float((lp - one).abs().max()))
        lpp, entp = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=True, positions=pos,
                                   layout=plan_layout(ids, mask, pack=True))
        worst = max(float((lpp - lp7).abs().max()), float((entp - ent7).abs().max()))
        matches = packing_matches(model, VOCAB, device)
        item(out, "packed_vs_padded_fp32", packed is not None and matches and worst < 1e-5, max_abs=worst,
             rows=len(LENGTHS), bins=0 if packed is None else packed.input_ids.shape[0], packing_matches=matches)
        bf = copy.deepcopy(base).to(device, torch.bfloat16)
        lpb, entb = token_logprobs(bf, ids, mask, temperature=0.7, with_entropy=True, positions=pos)
        (m1, w1), (m2, w2) = diff(lpb, ref[0.7][0], pos_c), diff(entb, ref[0.7][1], pos_c)
        item(out, "bf16_vs_fp64 (figures only)", bool(torch.isfinite(lpb).all() and torch.isfinite(entb).all()),
             logp_mean=m1, logp_max=w1, entropy_mean=m2, entropy_max=w2)
        del bf
    for head in ("linear", "other_head"):
        if head == "other_head":
            model.lm_head.__class__ = OtherHead
        for entropy in (False, True):
            def chunked():
                lp, ent = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=entropy, positions=pos)
                return lp.sum() + 0.5 * ent.sum() if entropy else lp.sum()
            sync(device)
            started = time.perf_counter()
            got = grads_of(model, chunked)
            sync(device)
            fwd_bwd_ms = 1e3 * (time.perf_counter() - started)
            want = grads_of(model, lambda: plain_loss(model, ids, mask, pos, 0.7, entropy))
            head_err = rel(got["embed.weight"], want["embed.weight"])
            worst = max(rel(got[n], want[n]) for n in want)
            item(out, f"grad_{head}{'_entropy' if entropy else ''}", set(got) == set(want) and worst < 1e-4,
                 head_weight_rel=head_err, max_param_rel=worst, chunked_fwd_bwd_ms=fwd_bwd_ms)
    model.lm_head.__class__ = nn.Linear
    if device.type == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def check_objective(device: torch.device) -> dict:
    out: dict = {}
    g = torch.Generator().manual_seed(2)
    b, t = 16, 96
    mask = (torch.arange(t)[None] < torch.randint(4, t + 1, (b,), generator=g)[:, None]).float()
    old = -3 * torch.rand(b, t, generator=g)
    data = dict(logp=old + 0.3 * torch.randn(b, t, generator=g), old=old,
                behaviour=old + 0.1 * torch.randn(b, t, generator=g),
                advantages=torch.randn(b, 1, generator=g) + 0.1 * torch.randn(b, t, generator=g), mask=mask,
                entropy=3 * torch.rand(b, t, generator=g), ref=old + 0.2 * torch.randn(b, t, generator=g))
    norm = LossNormalizer.of(mask, max_response_len=t)
    corrections = ("none", "token_tis", "seq_mask", "behaviour_clip")

    def run(algo, dev):
        x = {k: v.clone().to(dev) for k, v in data.items()}
        logp, ent = x["logp"].requires_grad_(), x["entropy"].requires_grad_()
        res = policy_objective(logp, x["old"], x["behaviour"], x["advantages"], x["mask"], algo, norm, kl_coef=0.05,
                               entropy=ent, ref_logprobs=x["ref"])
        res.loss.backward()
        return res.loss.detach().cpu(), logp.grad.cpu(), ent.grad.cpu(), res.clipped_sum

    worst_all, k = 0.0, 0
    for loss in POLICY_LOSSES.names():
        for agg in LOSS_AGGREGATIONS:
            algo = AlgorithmConfig(policy_loss=loss, loss_agg=agg, entropy_coef=0.01, off_policy_steps=1,
                                   importance_correction=corrections[k % len(corrections)])
            k += 1
            (l1, g1, e1, c1), (l0, g0, e0, c0) = run(algo, device), run(algo, "cpu")
            loss_rel = float((l1 - l0).abs() / max(float(l0.abs()), 1e-2))
            grad_rel = float((g1 - g0).abs().max() / g0.abs().max().clamp(min=1e-30))
            ent_rel = float((e1 - e0).abs().max() / e0.abs().max().clamp(min=1e-30))
            worst = max(loss_rel, grad_rel, ent_rel)
            worst_all = max(worst_all, worst)
            item(out, f"{loss}/{agg}/{algo.importance_correction}", worst <= 1e-5, loss=float(l0), loss_rel=loss_rel,
                 logp_grad_rel=grad_rel, entropy_grad_rel=ent_rel, clipped_dev=c1, clipped_cpu=c0)
    out["max_rel"] = worst_all
    return out


def toy_config(layers: int) -> dict:
    """The toy's shape as the HF config keys `trainer.prefix_tree.layout_cost` reads (its MLP has
    two matrices, not three: the cost model overstates it a little, alike for every layout)."""
    return {"hidden_size": HIDDEN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "intermediate_size": FFN, "vocab_size": VOCAB}


def grouped_batch(groups: int, n: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int = 3):
    """GRPO-shaped rows: `groups` prompts of a length in `prompt`, each with `n` completions of a
    length in `completion`; right-padded, with the completion positions and group ids."""
    g = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for _ in range(groups):
        p = torch.randint(1, VOCAB, (int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g)),), generator=g)
        for _ in range(n):
            c = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
            rows.append(torch.cat([p, torch.randint(1, VOCAB, (c,), generator=g)]))
            spans.append(len(p))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    positions = mask[:, 1:].bool() & (torch.arange(width - 1)[None] >= torch.tensor(spans)[:, None] - 1)
    return ids, mask, positions, torch.arange(len(rows)) // n


def check_shared_prefix(device: torch.device) -> dict:
    """trainer/prefix_tree.py on the device: a group's rows as one prefix tree give the padded
    log-probs and gradients (fp32: values < 1e-5, gradients relative < 1e-4; bf16: figures), the
    model passes `prefix_sharing_matches`; then the time of a forward + backward through
    `token_logprobs` on a 30-layer toy (SmolLM2's depth and widths) in bf16, rows packed end to
    end against shared prefixes (each layout planned on the host beforehand, its time given
    apart), at GRPO shapes: 8 and 32 prompts of 45-60 tokens x 8 completions of 16-48
    (math_chat), and 8 x 8 completions of 64-256."""
    out: dict = {}
    ids, mask, positions, groups = grouped_batch(4, 4, (100, 200), (20, 300))
    ids, mask, positions, groups = ids.to(device), mask.to(device), positions.to(device), groups.to(device)
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(4)).to(device) * positions
    for dtype in (torch.float32, torch.bfloat16):
        results = []
        for share in ("off", "on"):
            model = toy_model().to(device, dtype)
            layout = plan_layout(ids, mask, pack=True, group_ids=groups, share=share, config=toy_config(LAYERS))
            lp, ent = token_logprobs(model, ids, mask, 0.7, with_entropy=True, positions=positions, layout=layout)
            ((lp * weights).sum() + 0.5 * (ent * weights).sum()).backward()
            results.append((layout, lp.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
        (base, lp0, g0), (tree, lp1, g1) = results
        value = float((lp0 - lp1).abs().max())
        grad = max(rel(g1[k], g0[k]) for k in g0)
        name = "fp32" if dtype == torch.float32 else "bf16"
        ok = (value < 1e-5 and grad < 1e-4) if dtype == torch.float32 else True
        item(out, f"shared_vs_{base.name}_{name}", ok and tree.name == "shared", max_abs_logprob=value,
             max_rel_grad=grad, computed_tokens=tree.slots, unshared_tokens=base.slots)
    item(out, "prefix_sharing_matches", prefix_sharing_matches(toy_model().to(device), VOCAB, device))
    layers = 30
    model = toy_model(layers=layers).to(device, torch.bfloat16)
    for shape, args in {"math_chat 8x8 (45-60 + 16-48)": (8, 8, (45, 60), (16, 48)),
                        "math_chat 32x8 (45-60 + 16-48)": (32, 8, (45, 60), (16, 48)),
                        "long 8x8 (45-60 + 64-256)": (8, 8, (45, 60), (64, 256))}.items():
        ids, mask, positions, groups = (t.to(device) for t in grouped_batch(*args))
        layouts, plan_s = {}, {}
        for share in ("off", "on"):  # planned on the host, as the learner plans each micro-batch
            t0 = time.perf_counter()
            layouts[share] = plan_layout(ids, mask, pack=True, group_ids=groups, share=share, config=toy_config(layers))
            sync(device)
            plan_s[share] = time.perf_counter() - t0
        seconds = {}
        for share in ("off", "on") * 4:  # interleaved; the first pair warms up
            sync(device)
            t0 = time.perf_counter()
            lp, _ = token_logprobs(model, ids, mask, positions=positions, layout=layouts[share])
            lp.sum().backward()
            sync(device)
            seconds.setdefault(share, []).append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        off, on = (sorted(seconds[k][1:])[len(seconds[k][1:]) // 2] for k in ("off", "on"))
        tokens = int(mask.sum())
        auto = plan_layout(ids, mask, pack=True, group_ids=groups, share="auto", config=toy_config(layers)).name
        item(out, f"speed {shape}", True, tokens=tokens, packed_s=off, shared_s=on, speedup=off / on,
             packed_plan_s=plan_s["off"], shared_plan_s=plan_s["on"],
             speedup_with_plan=(off + plan_s["off"]) / (on + plan_s["on"]), auto_picks=auto)
    return out


def check_peak(device: torch.device) -> dict:
    """The matmul peak the planner measures in process (rl.plan.flops.measure_matmul_tflops)
    beside the card's datasheet figure, bf16 and fp32 (TF32 off)."""
    out: dict = {}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    for dtype in (torch.bfloat16, torch.float32):
        t0 = time.perf_counter()
        measured = max(measure_matmul_tflops(dtype, device, seconds=0.3) for _ in range(3))
        sheet = datasheet_tflops(name, dtype) if name else None
        item(out, f"peak {str(dtype).removeprefix('torch.')}", True, measured_tflops=measured,
             datasheet_tflops=sheet or 0.0, ratio=measured / sheet if sheet else 0.0,
             probe_s=time.perf_counter() - t0)
    return out


def _wire_process(rank: int, port: int, device: str, reps: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback (the box may have no network)
    group = collective.init_group("127.0.0.1", port, rank, 2, "gloo", timeout_s=120)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model = toy_model().to(dtype)
            if rank == 0:  # the learner: CollectiveSender.send with on_host (gloo and a CUDA learner)
                export = WeightExport(list(model.to(device).named_parameters()), rank=0, zero_stage=0)
                on_host = torch.device(device).type == "cuda"
                times, sent = [], 0
                for _ in range(reps):
                    sync(torch.device(device))
                    started, sent = time.perf_counter(), 0
                    with export.resident():
                        for bucket in export.buckets():
                            collective.send(group, [[t.cpu() if on_host else t for _, t in bucket]])
                            sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    times.append(time.perf_counter() - started)
                results.put(("send", str(dtype), sent, times))
            else:  # a rollout worker on the CPU: every tensor as the learner holds it
                named = list(model.named_parameters())
                expected, metas = dict(named), WeightExport(named, rank=0, zero_stage=0).metas()
                bad, seen, receive_s = set(), [], []
                for _ in range(reps):
                    stats: dict[str, float] = {}
                    names = []
                    for name, tensor in collective.receive(group, metas, "cpu", stats=stats):
                        names.append(name)
                        if not torch.equal(tensor, expected[name].detach()):
                            bad.add(name)
                    seen.append(names == [m.name for m in metas])
                    receive_s.append(stats.get("receive_s", 0.0))
                results.put(("receive", str(dtype), sorted(bad), all(seen), receive_s))
    finally:
        collective.close_group(group)


def check_weight_wire(device: torch.device, reps: int = 4, threads: int = 1) -> dict:
    import torch.multiprocessing as mp

    out: dict = {}
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_wire_process, args=(collective.free_port(), str(device), reps, threads, results), nprocs=2, join=True)
    got: dict = {}
    while not results.empty():
        msg = results.get()
        got[(msg[0], msg[1])] = msg[2:]
    for dtype in ("torch.float32", "torch.bfloat16"):
        sent, times = got[("send", dtype)]
        bad, in_order, receive_s = got[("receive", dtype)]
        timed = times[1:] or times  # the first send is a warm-up (buffers, page faults)
        item(out, f"wire_{dtype.removeprefix('torch.')}", not bad and in_order, mb=sent / 1e6,
             best_mb_s=sent / 1e6 / min(timed), median_mb_s=sent / 1e6 / sorted(timed)[len(timed) // 2],
             receive_s_best=min(receive_s[1:] or receive_s), mismatched=len(bad), host_copies=device.type == "cuda")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--only", default="", help="comma-separated checks: logprobs,objective,shared_prefix,peak,"
                                               "weight_wire")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    report = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "cpu_threads": torch.get_num_threads(), "checks": {}}
    print(f"gpu_check on {device} ({report['gpu'] or 'cpu'}), torch {torch.__version__}", flush=True)
    checks = {"logprobs": check_logprobs, "objective": check_objective, "shared_prefix": check_shared_prefix,
              "peak": check_peak,
              "weight_wire": lambda d: check_weight_wire(d, threads=max(1, min(4, torch.get_num_threads())))}
    for name, fn in checks.items():
        if args.only and name not in args.only.split(","):
            continue
        print(f"[{name}]", flush=True)
        started = time.perf_counter()
        try:
            figures = fn(device)
            figures["pass"] = all(v["pass"] for v in figures.values() if isinstance(v, dict))
        except Exception:  # noqa: BLE001 - a check that raises fails; the others still run
            figures = {"pass": False, "error": traceback.format_exc()}
            print(figures["error"], flush=True)
        figures["seconds"] = time.perf_counter() - started
        report["checks"][name] = figures
        print(f"{'PASS' if figures['pass'] else 'FAIL'} {name} ({figures['seconds']:.1f} s)", flush=True)
    report["pass"] = all(c["pass"] for c in report["checks"].values())
    path = Path(os.environ.get("OUT") or "/tmp") / "gpu_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"{'PASS' if report['pass'] else 'FAIL'} overall; wrote {path}", flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
