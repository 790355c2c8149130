"""Learner benchmark: trained tokens/s and MFU of our DeepSpeed learner against a bare torch loop.

The work is one GRPO step's update on the `27m` model shape (bench/models.py): 32 rows of a
6-10 token prompt and a completion of 128 tokens (`fixed`), or of 1 to 128 tokens spread over the
rows (`varlen`, right-padded to the longest row, as `rl.data.batch.build_train_batch` pads them). Random
token ids, advantages and rollout log-probs; the same `TrainBatch` objects go to both sides.

- ours: `trainer.learner.LearnerWorker` in this process (world size 1, DeepSpeed on gloo, ZeRO
  stage 2 unless `--zero-stage`), called as the driver loop calls it every step: `score(batch)`
  then `train_step(batch, step)`. The algorithm is GRPO's defaults with the KL term off (the bare
  loop has no reference model; `--kl` puts it back). Our micro-batches are padding-free by default
  (`trainer.padding_free`: rows packed end to end, trainer/packing.py); `varlen+padded` is `varlen`
  with that off, `varlen+budget` with token-budget micro-batches (`trainer.max_tokens_per_micro_batch`).
  Only our side has these.
- bare: the same HF model (`from_pretrained`, same dtype, same torch thread count), torch AdamW on
  its parameters, one forward over the padded batch, log-softmax (model dtype) gathered at the next
  tokens times the advantages, masked mean, backward, `clip_grad_norm_`, step, `zero_grad`.

Both sides run in this process, their timed steps interleaved (ours, bare, ours, ...) so that load
from other processes on a shared machine falls on both alike; warm-up steps are excluded and the
median step is reported. Trained tokens are the non-pad tokens of the rows; MFU is the model FLOPs
of those tokens (`rl.plan.flops.train_flops`: forward + backward, padding and recomputation not counted)
per second over this process's matmul peak, measured at start with the same thread count.

Targets: ours bf16 MFU >= 50% of the measured bf16 peak; ours >= 0.9x bare tokens/s (issue 21; 0.85x before).

On a GPU (`--device cuda`, the default where torch sees one) both sides run on the first visible
GPU: ours as a rank Ray gave that GPU (`rl.plan.devices.actor_device`: DeepSpeed on CUDA, NCCL default
group), bare with the model and AdamW on it; the batch starts on the host for both, as the driver
hands it over. Every timed region starts and ends with `torch.cuda.synchronize()`, and each side
reports its peak GPU memory (`torch.cuda.max_memory_allocated`, reset at each step: it includes
the other side's resident weights and optimizer states, this process holding both) and its step's
own extra over what was allocated when the step began. MFU is given against the matmul peak
measured on the GPU in this process and against the card's datasheet dense peak
(`rl.plan.flops.DATASHEET_TFLOPS`; fp32 against the plain FP32 figure unless TF32 matmuls are on), or
the measured one alone for a card not in the table.

`--profile` instead times the phases of a bf16 step on the fixed batch, ours beside bare (model
forward, log-probs over the vocabulary, autograd backward, ZeRO gradient hooks, gradient norm,
AdamW, the rest of the optimizer step), by wrapping those calls, then lists the top operators of
one step of each under torch.profiler (`bench/results/learner_profile.json`).

    python -m bench.learner [--quick] [--dtypes bfloat16,float32] [--steps 6] [--warmup 2]
                            [--shapes fixed,varlen,varlen+budget] [--zero-stage 2] [--kl]
                            [--device cpu|cuda] [--out bench/results/learner.json]
    python -m bench.learner --profile [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from bench.machine import add_device_arg, machine_info, resolve_device, write_result
from rl.plan.flops import datasheet_card, datasheet_tflops, measure_matmul_tflops, train_flops
from rl.data.types import TrainBatch

ROWS = 32  # 4 prompts x 8 samples: one GRPO step's batch
GROUP = 8
COMPLETION = 128
PROMPT = (6, 10)
BUDGET = 2048  # padded tokens per micro-batch in `varlen+budget`
SHAPES = ("fixed", "varlen", "varlen+padded", "varlen+budget")


# ---- batches ---------------------------------------------------------------------------------

def make_batch(shape: str, vocab: int, seed: int = 0, rows: int = ROWS) -> TrainBatch:
    """A right-padded TrainBatch laid out as `rl.data.batch.build_train_batch` lays one out."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(PROMPT[0], PROMPT[1] + 1, (rows,), generator=g).tolist()
    if shape == "fixed":
        completion_lens = [COMPLETION] * rows
    else:  # evenly spread over 1..COMPLETION, in random row order
        spread = torch.linspace(1, COMPLETION, rows).round().long()
        completion_lens = spread[torch.randperm(rows, generator=g)].tolist()
    width = max(p + c for p, c in zip(prompt_lens, completion_lens))
    input_ids = torch.zeros((rows, width), dtype=torch.long)  # pad id 0
    attention = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width - 1))
    rollout_lp = torch.zeros((rows, width - 1))
    row_adv = torch.randn(rows, generator=g)
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        input_ids[i, : p + c] = torch.randint(3, vocab, (p + c,), generator=g)
        attention[i, : p + c] = 1
        span = slice(p - 1, p - 1 + c)
        loss_mask[i, span] = 1.0
        # a random-init model gives about -log(vocab) to every token; the sampler's log-probs near it
        rollout_lp[i, span] = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(c, generator=g)
    return TrainBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
                      rollout_logprobs=rollout_lp, advantages=row_adv[:, None] * loss_mask,
                      group_ids=torch.arange(rows) // GROUP, policy_version=0)


def fresh(batch: TrainBatch) -> TrainBatch:
    """A copy as the driver hands it over every step (score() fills in fields)."""
    return dataclasses.replace(batch, old_logprobs=None, ref_logprobs=None, values=None, returns=None)


def batch_work(batch: TrainBatch, hf_config: dict) -> tuple[int, float]:
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return int(sum(lengths)), train_flops(hf_config, lengths)


# ---- the two sides ---------------------------------------------------------------------------

def synchronizer(device: str) -> Callable[[], None]:
    """What a timed region waits for at its ends: the GPU's queued kernels (CUDA runs them
    asynchronously to the host); nothing on CPU."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def memory_start(device: str) -> int:
    """GPU only: reset the peak and return what is allocated as a step begins."""
    if device != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def memory_end(device: str, start: int) -> dict[str, float]:
    """GPU only (after a synchronize): the step's peak allocated memory and its extra over `start`."""
    if device != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated()
    return {"peak_gib": peak / 2**30, "step_gib": (peak - start) / 2**30}


class Ours:
    """Our learner, world size 1, in this process."""

    def __init__(self, model_path: str, dtype: str, zero_stage: int, budget: int, kl: bool, threads: int,
                 peak: float, device: str = "cpu", padding_free: bool = True, lr: float | None = None):
        from rl.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
        from rl.plan.devices import actor_device
        from rl.wire.collective import free_port
        from trainer.learner import LearnerWorker
        from trainer.learner_setup import LearnerSpec

        algorithm = AlgorithmConfig(kl_coef=0.001 if kl else 0.0, **({} if lr is None else {"lr": lr}))
        trainer = TrainerConfig(zero_stage=zero_stage, max_tokens_per_micro_batch=budget, padding_free=padding_free)
        self.spec = LearnerSpec(ModelConfig(path=model_path, dtype=dtype), algorithm, trainer,
                                samples_per_step=ROWS, max_response_len=COMPLETION, temperature=1.0, seed=0,
                                threads=threads, peak_tflops=peak)
        self.worker = LearnerWorker(self.spec, rank=0, world_size=1)
        if device == "cuda":  # outside Ray a rank is given no GPU: this one has the first visible one, as from Ray
            self.worker.device_kind = actor_device(["0"], torch.cuda.is_available(), "learner rank 0")
        self.worker.setup("127.0.0.1", free_port())
        self.device, self.sync = device, synchronizer(device)
        self.step_no = 0
        self.last: dict[str, float] = {}

    def step(self, batch: TrainBatch) -> dict[str, float]:
        b = fresh(batch)
        self.sync()
        memory = memory_start(self.device)
        c0, t0 = time.process_time(), time.perf_counter()
        b = self.worker.score(b)
        self.sync()
        t1 = time.perf_counter()
        metrics = self.worker.train_step(b, self.step_no, self.spec.algorithm.kl_coef)
        self.sync()
        t2 = time.perf_counter()
        self.step_no += 1
        self.last = metrics
        return {"step_s": t2 - t0, "cpu_s": time.process_time() - c0, "score_s": t1 - t0, "train_s": t2 - t1,
                **memory_end(self.device, memory)}

    def close(self) -> None:
        del self.worker


class Bare:
    """The same model in a plain torch forward + backward + AdamW loop."""

    def __init__(self, model_path: str, dtype: str, lr: float = 1e-3, max_grad_norm: float = 1.0,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        if device != "cpu":
            self.model.to(device)
        self.device, self.sync = torch.device(device), synchronizer(device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm

    def loss(self, batch: TrainBatch) -> torch.Tensor:
        # the batch comes from the host, as ours gets it (`.to` is a no-op on CPU)
        ids, am, mask, adv = (t.to(self.device) for t in (batch.input_ids, batch.attention_mask, batch.loss_mask,
                                                          batch.advantages))
        logits = self.model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(logp.float() * adv * mask).sum() / mask.sum()

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self.sync()
        memory = memory_start(self.device.type)
        c0, t0 = time.process_time(), time.perf_counter()
        self.loss(batch).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return {"step_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                **memory_end(self.device.type, memory)}

    def close(self) -> None:
        del self.model, self.opt


# ---- measuring -------------------------------------------------------------------------------

def interleaved(sides: dict[str, Callable[[TrainBatch], dict[str, float]]], batch: TrainBatch, warmup: int,
                steps: int) -> dict[str, list[dict[str, float]]]:
    """Every side runs `warmup` untimed steps, then `steps` timed ones in turn."""
    for _ in range(warmup):
        for run in sides.values():
            run(batch)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(steps):
        for name, run in sides.items():
            times[name].append(run(batch))
    return times


MEMORY_KEYS = ("peak_gib", "step_gib")  # GPU only: the largest of the timed steps


def summarize(times: list[dict[str, float]], tokens: int, flops: float, peak: float,
              sheet: float | None = None) -> dict[str, float]:
    """Median step and its throughput; MFU of the measured peak and (GPU) of the datasheet's."""
    out = {k: (max if k in MEMORY_KEYS else statistics.median)(t[k] for t in times) for k in times[0]}
    out["step_s_all"] = [round(t["step_s"], 4) for t in times]
    out["step_s_min"] = min(t["step_s"] for t in times)
    out["tokens_per_s"] = tokens / out["step_s"]
    out["tflops"] = flops / out["step_s"] / 1e12
    out["mfu"] = out["tflops"] / peak
    if sheet:
        out["mfu_datasheet"] = out["tflops"] / sheet
    return out


# ---- profile: where a step's time goes ------------------------------------------------------

class Phases:
    """Inclusive wall time of named calls, accumulated by wrapping them (instance attributes)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.seconds: dict[str, float] = {}
        self.enabled = False
        self.sync = sync  # GPU: each timed call waits for its kernels (and for those queued before it)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)


def instrument_ours(ours: Ours, phases: Phases) -> None:
    import trainer.learner as learner_module

    engine = ours.worker.engine
    opt = engine.optimizer
    phases.wrap(ours.worker, "score", "score")
    phases.wrap(ours.worker, "train_step", "train_step")
    phases.wrap(learner_module, "token_logprobs", "token_logprobs")
    phases.wrap(engine.module, "forward", "model forward")
    phases.wrap(engine, "backward", "engine.backward")
    phases.wrap(engine, "_backward_epilogue", "backward epilogue")
    phases.wrap(engine, "step", "engine.step")
    if hasattr(opt, "process_gradients"):  # ZeRO 1/2: per-parameter gradient hooks
        phases.wrap(opt, "process_gradients", "grad hooks")
    if hasattr(opt, "scaled_global_norm"):
        phases.wrap(opt, "scaled_global_norm", "grad norm")
    inner = getattr(opt, "optimizer", None)
    if inner is not None and inner is not opt:
        phases.wrap(inner, "step", "AdamW")


def instrument_bare(bare: Bare, phases: Phases) -> None:
    phases.wrap(bare, "step", "step")
    phases.wrap(bare, "loss", "loss")
    phases.wrap(bare.model, "forward", "model forward")
    phases.wrap(torch.nn.utils, "clip_grad_norm_", "clip")  # restored by the caller
    phases.wrap(bare.opt, "step", "AdamW")
    phases.wrap(bare.opt, "zero_grad", "zero_grad")


def phase_rows(ours: dict[str, float], bare: dict[str, float]) -> list[tuple[str, float, float]]:
    """Exclusive seconds per phase, ours beside bare (per step)."""
    g = lambda d, k: d.get(k, 0.0)  # noqa: E731
    o_back = g(ours, "engine.backward") - g(ours, "grad hooks") - g(ours, "backward epilogue")
    o_rest = g(ours, "train_step") - g(ours, "token_logprobs") - g(ours, "engine.backward") - g(ours, "engine.step")
    o_opt_other = g(ours, "engine.step") - g(ours, "AdamW") - g(ours, "grad norm")
    b_back = g(bare, "step") - g(bare, "loss") - g(bare, "clip") - g(bare, "AdamW") - g(bare, "zero_grad")
    return [
        ("model forward", g(ours, "model forward"), g(bare, "model forward")),
        ("log-probs over the vocab (+entropy)", g(ours, "token_logprobs") - g(ours, "model forward"),
         g(bare, "loss") - g(bare, "model forward")),
        ("loss, importance weights, metrics, batch slicing", o_rest, 0.0),
        ("autograd backward", o_back, b_back),
        ("ZeRO gradient hooks (bucket copies, reduce)", g(ours, "grad hooks"), 0.0),
        ("backward epilogue (last bucket, flags)", g(ours, "backward epilogue"), 0.0),
        ("gradient norm / clipping", g(ours, "grad norm"), g(bare, "clip")),
        ("AdamW", g(ours, "AdamW"), g(bare, "AdamW")),
        ("step: fp32 grads, unscale, master->model copy, lr", o_opt_other, g(bare, "zero_grad")),
        ("score()", g(ours, "score"), 0.0),
        ("total", g(ours, "score") + g(ours, "train_step"), g(bare, "step")),
    ]


def profile(path: str, hf_config: dict, dtype: str, threads: int, peak: float, args) -> dict:
    """Phase times of ours and bare on the fixed batch (interleaved steps, mean per step), then
    the top operators of one step of each under torch.profiler (on a GPU: by self GPU time)."""
    import warnings

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    warnings.filterwarnings("ignore", message=".*optimizer.step.*")  # our timing wrapper on AdamW.step

    batch = make_batch("fixed", hf_config["vocab_size"], seed=args.seed)
    ours = Ours(path, dtype, args.zero_stage, 0, args.kl, threads, peak, args.device)
    bare = Bare(path, dtype, device=args.device)
    po, pb = Phases(synchronizer(args.device)), Phases(synchronizer(args.device))
    gpu = args.device == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    sort_key = "self_device_time_total" if gpu else "self_cpu_time_total"
    instrument_ours(ours, po)
    clip = torch.nn.utils.clip_grad_norm_
    instrument_bare(bare, pb)
    try:
        interleaved({"ours": ours.step, "bare": bare.step}, batch, args.warmup, 0)
        po.enabled = pb.enabled = True
        interleaved({"ours": ours.step, "bare": bare.step}, batch, 0, args.steps)
        po.enabled = pb.enabled = False
        rows = [(name, o / args.steps, b / args.steps) for name, o, b in phase_rows(po.seconds, pb.seconds)]
        print(f"\nWhere a step's time goes ({dtype}, fixed batch, mean of {args.steps} steps, seconds):")
        print(f"{'phase':52s} {'ours':>8s} {'bare':>8s} {'ours-bare':>9s}")
        for name, o, b in rows:
            print(f"{name:52s} {o:8.3f} {b:8.3f} {o - b:+9.3f}")
        ops = {}
        for name, run in (("ours", ours.step), ("bare", bare.step)):
            with torch_profile(activities=activities) as prof:
                run(batch)
            table = prof.key_averages().table(sort_by=sort_key, row_limit=args.profile_ops,
                                              max_name_column_width=55)
            print(f"\nTop operators, one {name} step (self {'GPU' if gpu else 'CPU'} time):\n{table}")
            ops[name] = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count,
                          **({"self_gpu_s": e.self_device_time_total / 1e6} if gpu else {})}
                         for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, sort_key))[:args.profile_ops]]
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
        ours.close()
        bare.close()
    return {"dtype": dtype, "shape": "fixed", "steps": args.steps, "device": args.device,
            "phases_s": [{"phase": n, "ours": o, "bare": b} for n, o, b in rows], "top_ops": ops}


def learner_machine_info(threads: int, peaks: dict[str, float], device: str = "cpu",
                         sheet: dict[str, float | None] | None = None) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(l.split(":", 1)[1].strip() for l in lines if l.startswith("model name"))
        flags = next(l.split(":", 1)[1].split() for l in lines if l.startswith("flags"))
        isa = sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx")))
    except (OSError, StopIteration):
        isa = []
    info = {**machine_info(), "isa": isa, "torch_threads": threads, "device": device, "matmul_peak_tflops": peaks}
    if device == "cuda":
        name = torch.cuda.get_device_name()
        info.update(gpu_name=name, datasheet_card=datasheet_card(name), datasheet_tflops=sheet,
                    tf32_matmuls=torch.backends.cuda.matmul.allow_tf32)
    return info


def matmul_peak(dtype: str, seconds: float, tries: int = 3, device: str = "cpu") -> float:
    """The best of a few short `measure_matmul_tflops` runs: on a shared machine another
    process's burst lowers one run, never raises it."""
    return max(measure_matmul_tflops(getattr(torch, dtype), device, seconds=seconds / tries) for _ in range(tries))


def datasheet_peaks(device: str) -> dict[str, float | None]:
    """GPU: the card's datasheet dense peak per dtype (None for a card not in the table); CPU: none."""
    if device != "cuda":
        return {}
    name, tf32 = torch.cuda.get_device_name(), torch.backends.cuda.matmul.allow_tf32
    return {d: datasheet_tflops(name, getattr(torch, d), tf32) for d in ("bfloat16", "float32")}


def model_path(shape: str) -> str:
    from bench.models import build

    return str(build(shape))


def run(args: argparse.Namespace) -> dict:
    threads = torch.get_num_threads()
    path = args.model or model_path("27m")
    torch.set_num_threads(threads)
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    peaks = {d: matmul_peak(d, args.peak_seconds, device=args.device) for d in ("bfloat16", "float32")}
    sheet = datasheet_peaks(args.device)
    info = learner_machine_info(threads, peaks, args.device, sheet)
    if args.device == "cuda":
        said = {d: f"datasheet {v:.1f}" if v else "not in the datasheet table" for d, v in sheet.items()}
        print(f"matmul peak on {info['gpu_name']}: bf16 {peaks['bfloat16']:.1f} TFLOP/s ({said['bfloat16']}), "
              f"fp32 {peaks['float32']:.1f} TFLOP/s ({said['float32']}, TF32 {'on' if info['tf32_matmuls'] else 'off'})",
              flush=True)
    else:
        print(f"matmul peak ({threads} threads): bf16 {peaks['bfloat16']:.3f} TFLOP/s, "
              f"fp32 {peaks['float32']:.3f} TFLOP/s; load average {info['load_avg_at_start']}", flush=True)
    result = {"machine": info,
              "settings": {"model": path, "rows": ROWS, "completion_tokens": COMPLETION, "prompt_tokens": PROMPT,
                           "warmup": args.warmup, "steps": args.steps, "zero_stage": args.zero_stage, "kl": args.kl,
                           "budget_tokens": BUDGET, "device": args.device},
              "targets": {"ours_bf16_mfu": 0.5, "ours_over_bare": 0.9}, "rows": []}
    if args.profile:
        result["profile"] = profile(path, hf_config, "bfloat16", threads, peaks["bfloat16"], args)
    else:
        result["rows"] = compare(path, hf_config, threads, peaks, args, sheet)
    info["matmul_peak_tflops_at_end"] = {d: matmul_peak(d, args.peak_seconds, device=args.device)
                                         for d in ("bfloat16", "float32")}
    info["load_avg_at_end"] = os.getloadavg()
    return result


def compare(path: str, hf_config: dict, threads: int, peaks: dict[str, float], args,
            sheet: dict[str, float | None] | None = None) -> list[dict]:
    rows = []
    gpu = args.device == "cuda"
    print(_HEAD + (_GPU_HEAD if gpu else ""), flush=True)
    for dtype in args.dtypes:
        peak, sheet_peak = peaks[dtype], (sheet or {}).get(dtype)
        bare = Bare(path, dtype, device=args.device)
        ours_by_variant: dict[tuple[int, bool], Ours] = {}
        for shape in args.shapes:
            variant = (BUDGET if shape.endswith("+budget") else 0, not shape.endswith("+padded"))
            if variant not in ours_by_variant:
                ours_by_variant[variant] = Ours(path, dtype, args.zero_stage, variant[0], args.kl, threads, peak,
                                                args.device, padding_free=variant[1])
            ours = ours_by_variant[variant]
            batch = make_batch(shape.split("+")[0], hf_config["vocab_size"], seed=args.seed)
            tokens, flops = batch_work(batch, hf_config)
            times = interleaved({"ours": ours.step, "bare": bare.step}, batch, args.warmup, args.steps)
            row = {"dtype": dtype, "shape": shape, "rows": len(batch), "padded_width": batch.input_ids.shape[1],
                   "trained_tokens": tokens, "padded_tokens": batch.input_ids.numel(), "model_tflop": flops / 1e12,
                   "ours": summarize(times["ours"], tokens, flops, peak, sheet_peak),
                   "bare": summarize(times["bare"], tokens, flops, peak, sheet_peak)}
            row["ratio"] = row["ours"]["tokens_per_s"] / row["bare"]["tokens_per_s"]
            rows.append(row)
            print(_line(row) + (_gpu_line(row) if gpu else ""), flush=True)
        for ours in ours_by_variant.values():
            ours.close()
        bare.close()
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return rows


_HEAD = (f"{'dtype':9s} {'shape':14s} {'ours tok/s':>10s} {'bare tok/s':>10s} {'ratio':>6s} "
         f"{'ours MFU':>8s} {'bare MFU':>8s}   median step (s)")


_GPU_HEAD = f"   {'datasheet MFU ours/bare':>23s}   peak GPU GiB ours/bare (step's own)"


def _gpu_line(r: dict) -> str:
    o, b = r["ours"], r["bare"]
    sheet = f"{o['mfu_datasheet']:.1%} / {b['mfu_datasheet']:.1%}" if "mfu_datasheet" in o else "card not in table"
    return (f"   {sheet:>23s}   {o['peak_gib']:.2f} ({o['step_gib']:.2f}) / {b['peak_gib']:.2f} "
            f"({b['step_gib']:.2f})")


def _line(r: dict) -> str:
    o, b = r["ours"], r["bare"]
    return (f"{r['dtype']:9s} {r['shape']:14s} {o['tokens_per_s']:10.0f} {b['tokens_per_s']:10.0f} {r['ratio']:5.2f}x "
            f"{o['mfu']:8.1%} {b['mfu']:8.1%}   ours {o['step_s']:.3f} (score {o['score_s']:.3f}), "
            f"bare {b['step_s']:.3f}")


def checks(result: dict) -> str:
    """Each row against the targets."""
    t = result["targets"]
    lines = []
    for r in result["rows"]:
        checks = [f"ours/bare {r['ratio']:.2f} {'>=' if r['ratio'] >= t['ours_over_bare'] else '<'} "
                  f"{t['ours_over_bare']}"]
        if r["dtype"] == "bfloat16":
            m = r["ours"]["mfu"]
            checks.append(f"ours MFU {m:.1%} {'>=' if m >= t['ours_bf16_mfu'] else '<'} {t['ours_bf16_mfu']:.0%}")
            if "mfu_datasheet" in r["ours"]:
                m = r["ours"]["mfu_datasheet"]
                checks.append(f"of the datasheet peak {m:.1%} {'>=' if m >= t['ours_bf16_mfu'] else '<'} "
                              f"{t['ours_bf16_mfu']:.0%}")
        lines.append(f"  {r['dtype']} {r['shape']}: " + ", ".join(checks))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps, fixed shape only")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=6, help="timed steps per side (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--kl", action="store_true", help="GRPO's KL term (a reference-model forward in score())")
    p.add_argument("--profile", action="store_true",
                   help="instead of the table: where a bf16 step's time goes, ours beside bare (fixed batch)")
    p.add_argument("--profile-ops", type=int, default=25, help="operators listed per side with --profile")
    p.add_argument("--model", default=None, help="a HF model folder instead of bench.models.build('27m')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-seconds", type=float, default=3.0, help="matmul peak: best of 3 runs this long in all")
    p.add_argument("--out", default=None, help="default: bench/results/learner.json (learner_profile.json)")
    add_device_arg(p, "both sides")
    args = p.parse_args(argv)
    resolve_device(p, args)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES] + [d for d in args.dtypes if d not in ("bfloat16", "float32")]
    if unknown:
        p.error(f"unknown shape or dtype {unknown}: shapes {', '.join(SHAPES)}; dtypes bfloat16, float32")
    if args.quick:
        args.warmup, args.steps = 1, 3
        args.shapes = ["fixed"]
    out = Path(args.out or f"bench/results/learner{'_profile' if args.profile else ''}.json")
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # before DeepSpeed is imported
    result = run(args)
    if result["rows"]:
        print("targets:\n" + checks(result))
    write_result(out, result)


if __name__ == "__main__":
    main()
