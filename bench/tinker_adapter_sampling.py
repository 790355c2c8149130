"""Tinker service sampling benchmark (issue 60.7): sampled tokens/s of the base model, of one saved
adapter and of several adapters in one batch, in one job, on the engine the service samples with.

The engine is `rollout.vllm_engine.VLLMEngine` as `launch.serve` builds it (vLLM's CPU build,
eager, one engine; `serve.adapter_sampling=auto` on CPU: the fleet's `rollout.max_loras=0`, each
adapter merged into the engine's weights for its batch, `MergedAdapters`). The adapters are peft
folders as the service's `save_weights_for_sampler` writes them (rank 8, alpha 32, on attention, MLP
and the LM head: the SDK's defaults), their B matrices random (a trained adapter's are not zero).
One call = `--samples` requests of one `--prompt-len`-token prompt, `--max-tokens` tokens each, every
request its own seed, temperature 1, EOS ignored (every sample is `--max-tokens` long, so the
cases sample the same number of tokens). Cases, taking turns each round (so load from other processes
falls on all alike), warm-up round excluded, the median of `--repeats` rounds reported:

- base: the base model (no adapter);
- adapter: one adapter, whose merged layers the engine kept from its last batch (a sampler's
  steady state: its calls after the first);
- adapter, merged afresh: the same, merged again for the batch (a new save, e.g. the RL loop's
  `save_weights_and_get_sampling_client` every step: the merge's cost in full);
- N adapters: `--adapters` adapters, `--samples`/N requests each, in one call (a batch per adapter,
  each merged afresh: the engine keeps one adapter's merged layers).

It also checks the adapter's sampled log-probs against peft's forward of the same tokens (the
trainer's model) and that the base model's samples after the adapter batches equal those before, bit
for bit. `--vllm-lora`: the one-adapter case also through vLLM's LoRA (`serve.adapter_sampling=lora`),
in an engine of its own (a process of its own, after the others; ~12x slower on CPU: 1 timed round).

    python -m bench.tinker_adapter_sampling [--shape smollm2] [--samples 32] [--max-tokens 8] [--prompt-len 36]
        [--adapters 4] [--repeats 3] [--threads 2] [--vllm-lora] [--out bench/results/tinker_adapter_sampling.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.machine import machine_info, write_result

RANK, TARGETS_NOTE = 8, "attention, MLP and LM head (train_attn, train_mlp, train_unembed: the SDK's defaults)"


def make_adapter(model_dir: str, folder: str, seed: int):
    """A peft adapter as the service's trainer saves one (trainer/adapter_trainer.py), B random."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.adapter_trainer import LORA_ALPHA, lora_targets

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                            target_modules=lora_targets(base, True, True, True)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(folder)
    return model.eval()


def _engine(model_dir: str, args: argparse.Namespace, merged: bool):
    from rl.config.schema import ModelConfig, RolloutConfig
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import VLLMEngine, vllm_env

    os.environ.update(vllm_env(1, args.threads))
    rollout = RolloutConfig(max_model_len=512, enforce_eager=True, kv_cache_gib=1, max_new_tokens=args.max_tokens,
                            max_loras=0 if merged else 4, max_lora_rank=64)
    return VLLMEngine(RolloutSpec(ModelConfig(path=model_dir, dtype="float32"), rollout, seed=0,
                                  threads=args.threads), 0)


def _requests(prompt: list[int], adapters: list[str | None], seed: int):
    from rl.data.types import GenerationRequest

    return [GenerationRequest(prompt_ids=prompt, prompt_text="", group_id=0, sample_index=i, seed=seed + i,
                              temperature=1.0, adapter=adapter, ignore_eos=True) for i, adapter in enumerate(adapters)]


def _timed(engine, requests) -> tuple[float, list]:
    started = time.perf_counter()
    samples = engine.generate(requests)
    took = time.perf_counter() - started
    errors = [s.error for s in samples if s.error]
    if errors:
        raise RuntimeError(f"the engine refused a request: {errors[0]}")
    return sum(len(s.completion_ids) for s in samples) / took, samples


def _prompt(model_dir: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    text = ("Question: a farmer has 17 sheep and buys 23 more, then sells 9 of them at the market on Sunday. "
            "How many sheep does the farmer have now? Think step by step and give the answer at the end. ") * 4
    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"][:n]


def run_merged(model_dir: str, work: str, args: argparse.Namespace, out) -> None:
    """(a process of its own) The base, one-adapter and several-adapter cases on one engine."""
    import numpy as np
    import torch

    try:
        folders = [os.path.join(work, f"adapter-{i}") for i in range(max(args.adapters, 1))]
        first = make_adapter(model_dir, folders[0], 0)
        for i, folder in enumerate(folders[1:], 1):
            make_adapter(model_dir, folder, i)
        engine = _engine(model_dir, args, merged=True)
        prompt = _prompt(model_dir, args.prompt_len)
        per = max(1, args.samples // len(folders))
        several = [folder for folder in folders for _ in range(per)]
        cases: dict[str, list[float]] = {"base": [], "adapter": [], "adapter, merged afresh": [],
                                         f"{len(folders)} adapters x {per} samples": []}
        merge_s: list[float] = []
        base_first = None
        for round_ in range(args.warmup + args.repeats):
            seed = 1000 * round_
            rates = {}
            rates["base"], base = _timed(engine, _requests(prompt, [None] * args.samples, seed))
            base_first = base_first or base
            engine._merged.forget() if engine._merged is not None else None
            started = time.perf_counter()
            with engine._adapter_merger().merged(folders[0], ("bench", round_)):  # the merge alone, timed
                merge_s.append(time.perf_counter() - started)
            engine._merged.forget()
            rates["adapter, merged afresh"], _ = _timed(engine, _requests(prompt, [folders[0]] * args.samples, seed))
            rates["adapter"], one = _timed(engine, _requests(prompt, [folders[0]] * args.samples, seed))
            engine._merged.forget()
            rates[f"{len(folders)} adapters x {per} samples"], _ = _timed(engine, _requests(prompt, several, seed))
            if round_ >= args.warmup:
                for name, rate in rates.items():
                    cases[name].append(rate)
        base_again = engine.generate(_requests(prompt, [None] * args.samples, 0))
        worst = 0.0
        with torch.no_grad():
            for s in one[:8]:
                ids = torch.tensor([prompt + s.completion_ids])
                logp = torch.log_softmax(first(input_ids=ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])
                theirs = logp[-len(s.completion_ids):, 0].numpy()
                worst = max(worst, float(np.max(np.abs(theirs - np.asarray(s.logprobs)))))
        out.put({"cases": cases, "merge_s": merge_s[args.warmup:],
                 "base_restored_exactly": [(s.completion_ids, s.logprobs) for s in base_first]
                 == [(s.completion_ids, s.logprobs) for s in base_again],
                 "adapter_vs_peft_max_abs_logprob": worst, "prompt_tokens": len(prompt)})
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        out.put({"error": traceback.format_exc()})


def run_vllm_lora(model_dir: str, work: str, args: argparse.Namespace, out) -> None:
    """(a process of its own) The one-adapter case through vLLM's LoRA, and the base beside it."""
    try:
        folder = os.path.join(work, "adapter-0")
        engine = _engine(model_dir, args, merged=False)
        prompt = _prompt(model_dir, args.prompt_len)
        _timed(engine, _requests(prompt, [folder] * 2, 0))  # warm-up: loads the adapter
        base, _ = _timed(engine, _requests(prompt, [None] * args.samples, 1))
        adapter, _ = _timed(engine, _requests(prompt, [folder] * args.samples, 1))
        out.put({"cases": {"base (engine with vLLM's LoRA)": [base], "adapter (vLLM's LoRA)": [adapter]}})
    except BaseException:  # noqa: BLE001
        import traceback

        out.put({"error": traceback.format_exc()})


def in_spawned_process(target, *args_, timeout_s: float = 3600) -> dict[str, Any]:
    """`target(*args_, queue)` in a fresh (spawned) process: the dict it puts on the queue, or a
    RuntimeError with the traceback it put there as {"error": ...}. The engine's threads and vLLM's
    state die with the process, so cases do not share an engine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args_, out))
    proc.start()
    try:
        got = out.get(timeout=timeout_s)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if "error" in got:
        raise RuntimeError(f"{target.__name__} failed:\n{got['error']}")
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2", help="a bench/models.py shape or real model (default smollm2)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=36)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-lora", action="store_true", help="also the one-adapter case through vLLM's LoRA")
    parser.add_argument("--out", default="bench/results/tinker_adapter_sampling.json")
    args = parser.parse_args(argv)
    from bench.models import build

    model_dir = str(build(args.shape).resolve())
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as work:
        got = in_spawned_process(run_merged, model_dir, work, args)
        if args.vllm_lora:
            got["cases"].update(in_spawned_process(run_vllm_lora, model_dir, work, args)["cases"])
    base = statistics.median(got["cases"]["base"])
    rows = {name: {"tokens_per_s": round(statistics.median(rates), 2), "runs": [round(r, 2) for r in rates],
                   "vs_base": round(statistics.median(rates) / base, 3)} for name, rates in got["cases"].items()}
    print(f"\n{args.shape}: {args.samples} samples x {args.max_tokens} tokens from a {got['prompt_tokens']}-token prompt, "
          f"{args.threads} threads; adapters rank {RANK} on {TARGETS_NOTE}; median of {args.repeats}")
    print(f"{'case':<40} {'tokens/s':>9} {'x base':>7}")
    for name, row in rows.items():
        print(f"{name:<40} {row['tokens_per_s']:>9.1f} {row['vs_base']:>7.2f}")
    print(f"merging one adapter (read, merge, pack): {statistics.median(got['merge_s']):.2f} s (median)")
    print(f"adapter log-probs vs peft's forward: max |diff| {got['adapter_vs_peft_max_abs_logprob']:.2e}; "
          f"base samples after the adapters' batches equal those before: {got['base_restored_exactly']}")
    result = {"benchmark": "tinker_adapter_sampling", "shape": args.shape, "samples": args.samples,
              "max_tokens": args.max_tokens, "prompt_tokens": got["prompt_tokens"], "threads": args.threads,
              "adapters": args.adapters, "lora_rank": RANK, "repeats": args.repeats, "cases": rows,
              "merge_s": [round(x, 3) for x in got["merge_s"]],
              "adapter_vs_peft_max_abs_logprob": got["adapter_vs_peft_max_abs_logprob"],
              "base_restored_exactly": got["base_restored_exactly"], "machine": machine_info()}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
