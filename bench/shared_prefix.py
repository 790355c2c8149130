"""Shared-prefix micro-batches against padding-free ones: learner tokens/s on the real model.

Two workloads, each one GRPO step's batch of 8 prompts x 8 samples on SmolLM2-135M-Instruct
(30 layers, 49k vocabulary), laid out as `rl.data.batch.build_train_batch` lays one out:

- `math_chat`: the recipe's prompts (examples/math_chat.py) through the model's chat template
  (its system prompt included, 40-60 tokens), completions of 16-48 tokens (`rollout.max_new_tokens`
  is 48 in configs/task/math_chat.yaml); `trainer.micro_batch_size=16` as the recipe sets it.
- `calculator_agent`: episodes shaped as examples/calculator_agent.py makes them, rendered with
  the same template: a system message describing the calculator tool, the user's sum, the
  assistant's tool call, the tool's result, the answer. Six of a group's eight samples make the
  right call (the same tokens, so their first turns are shared too); two make another.

Completion tokens are the rendered texts (not random ids) where the workload has them, random
ids of the drawn length for math_chat's completions. Both sides are the same `LearnerWorker`
(ZeRO-2, padding-free packing on), its `share` switched per step: `off` (rows packed end to end)
or `auto` (trainer/prefix_tree.py). Steps are interleaved, warm-up excluded, median reported.
Also measured: the log-probs of the two layouts on the first micro-batch, |difference| max and
mean, in fp32 and bf16 (bf16 matmuls over different shapes round differently).

Target (issue 34): shared >= 1.5x padding-free tokens/s on both workloads.

    python -m bench.shared_prefix [--dtypes bfloat16,float32] [--steps 3] [--warmup 1]
                                  [--out bench/results/shared_prefix.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

from bench.learner import fresh, learner_machine_info, matmul_peak
from bench.machine import write_result
from bench.models import real_model
from rl.data.types import TrainBatch

PROMPTS, N = 8, 8
TOOL_SYSTEM = ("You can call one tool. To call it, reply with <tool_call>{\"name\": \"calculator\", \"arguments\": "
               "{\"expression\": ...}}</tool_call> and nothing else; its result comes back in a tool message. "
               "Tools: " + json.dumps([{"type": "function", "function": {
                   "name": "calculator", "description": "Evaluate an integer expression of digits and + - *",
                   "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}}}]))


def _batch(rows: list[tuple[list[int], list[tuple[int, int]]]], seed: int) -> TrainBatch:
    """Right-padded rows (token ids, trained spans [start, end) of tokens) in groups of N."""
    g = torch.Generator().manual_seed(seed)
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1))
    for i, (ids, spans) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        for start, end in spans:
            loss_mask[i, start - 1:end - 1] = 1.0  # log p(token t) sits at position t-1
    adv = torch.randn(len(rows), generator=g)[:, None] * loss_mask
    return TrainBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
                      rollout_logprobs=-3.0 * loss_mask, advantages=adv,
                      group_ids=torch.arange(len(rows)) // N, policy_version=0)


def math_chat_batch(tok, seed: int = 0) -> TrainBatch:
    from examples.math_chat import math_splits

    rng = random.Random(seed)
    train, _ = math_splits(200, 10, seed=seed)
    rows = []
    for r in rng.sample(train, PROMPTS):
        prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        for _ in range(N):
            completion = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(16, 48))]
            rows.append((prompt + completion, [(len(prompt), len(prompt) + len(completion))]))
    return _batch(rows, seed)


def agent_batch(tok, seed: int = 0) -> TrainBatch:
    """Calculator-agent episodes: [system, user, assistant call, tool result, assistant answer];
    the trained spans are the two assistant turns (their content and end-of-turn token)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(PROMPTS):
        terms = [rng.randint(10, 99) for _ in range(3)]
        right = "+".join(map(str, terms))
        for k in range(N):
            expression = right if k < 6 else "+".join(map(str, terms[:2] + [rng.randint(10, 99)]))
            call = "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
                "</tool_call>"
            result = str(eval(expression))  # digits and + only
            answer = result if rng.random() < 0.8 else str(int(result) + rng.randint(1, 9))
            messages = [{"role": "system", "content": TOOL_SYSTEM},
                        {"role": "user", "content": f"What is {' + '.join(map(str, terms))}? Use the calculator."},
                        {"role": "assistant", "content": call}, {"role": "tool", "content": result},
                        {"role": "assistant", "content": answer}]
            spans, ids = [], []
            for end in range(1, len(messages) + 1):  # each message's tokens: the render's growth
                upto = tok.apply_chat_template(messages[:end], tokenize=True, return_dict=False)
                if messages[end - 1]["role"] == "assistant":
                    head = tok.apply_chat_template(messages[:end - 1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
                    spans.append((len(head), len(upto)))
                ids = upto
            rows.append((ids, spans))
    return _batch(rows, seed)


def layouts_agree(worker, batch: TrainBatch) -> dict[str, float]:
    """|log-prob difference| between the two layouts on the first micro-batch (no update): max
    and mean over its trained tokens."""
    from trainer.logprobs import token_logprobs

    rows = worker._micro_batches(batch, worker._order(batch), forward_only=True)[0]
    mb = batch.select(rows)
    where = mb.loss_mask > 0
    out = {}
    with torch.no_grad():
        for share in ("off", "on"):
            worker.share = share
            layout = worker._layout(mb, mb.input_ids, mb.attention_mask)
            out[share] = token_logprobs(worker.engine, mb.input_ids, mb.attention_mask, positions=where,
                                        layout=layout)[0]
    gap = (out["off"] - out["on"]).abs()[where]
    return {"max": float(gap.max()), "mean": float(gap.mean())}


def run(dtype: str, workload: str, batch: TrainBatch, path: str, steps: int, warmup: int, threads: int,
        peak: float) -> dict:
    from rl.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
    from rl.wire.collective import free_port
    from trainer.learner import LearnerWorker
    from trainer.learner_setup import LearnerSpec

    spec = LearnerSpec(ModelConfig(path=path, dtype=dtype), AlgorithmConfig(kl_coef=0.0),
                       TrainerConfig(zero_stage=2, micro_batch_size=16), samples_per_step=len(batch),
                       max_response_len=64, temperature=1.0, seed=0, threads=threads, peak_tflops=peak)
    worker = LearnerWorker(spec, rank=0, world_size=1)
    worker.setup("127.0.0.1", free_port())
    assert worker.share == "auto", worker.share
    diff = layouts_agree(worker, batch)
    times: dict[str, list[float]] = {"padding_free": [], "shared": []}
    metrics: dict[str, dict] = {}
    for i in range(warmup + steps):
        for side, share in (("padding_free", "off"), ("shared", "auto")):
            worker.share = share
            b = fresh(batch)
            t0 = time.perf_counter()
            b = worker.score(b)
            metrics[side] = worker.train_step(b, i)
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    tokens = float(batch.attention_mask.sum())
    out = {"workload": workload, "dtype": dtype, "rows": len(batch), "trained_tokens": tokens,
           "row_tokens_mean": tokens / len(batch), "logprob_abs_diff": diff}
    for side, t in times.items():
        computed = metrics[side]["_computed_tokens"] / metrics[side]["_trained_tokens"]  # raw sums of one rank
        out[side] = {"step_s": statistics.median(t), "step_s_all": [round(x, 3) for x in t],
                     "tokens_per_s": tokens / statistics.median(t), "computed_per_trained_token": computed,
                     # the layouts' planning (trainer/layouts.py PlanAhead) and the part the compute did not hide
                     "plan_s": metrics[side]["_max/time/plan_s"],
                     "plan_wait_s": metrics[side]["_max/time/plan_wait_s"]}
    out["speedup"] = out["shared"]["tokens_per_s"] / out["padding_free"]["tokens_per_s"]
    del worker
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--workloads", default="math_chat,calculator_agent")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="bench/results/shared_prefix.json")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    path = str(real_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    threads = torch.get_num_threads()
    builders = {"math_chat": math_chat_batch, "calculator_agent": agent_batch}
    dtypes = args.dtypes.split(",")
    peaks = {d: matmul_peak(d, 1.5) for d in dtypes}
    results = []
    for dtype in dtypes:
        for workload in args.workloads.split(","):
            r = run(dtype, workload, builders[workload](tok), path, args.steps, args.warmup, threads, peaks[dtype])
            results.append(r)
            print(f"{workload:17s} {dtype:9s} rows {r['rows']} x {r['row_tokens_mean']:.0f} tokens: "
                  f"padding-free {r['padding_free']['tokens_per_s']:7.1f} tok/s "
                  f"(computed/trained {r['padding_free']['computed_per_trained_token']:.2f}), "
                  f"shared {r['shared']['tokens_per_s']:7.1f} tok/s "
                  f"(computed/trained {r['shared']['computed_per_trained_token']:.2f}; planning "
                  f"{1e3 * r['shared']['plan_s']:.0f} ms, {1e3 * r['shared']['plan_wait_s']:.0f} ms waited): "
                  f"{r['speedup']:.2f}x; "
                  f"log-prob |diff| max {r['logprob_abs_diff']['max']:.2e} mean {r['logprob_abs_diff']['mean']:.2e}",
                  flush=True)
    write_result(args.out, {"machine": learner_machine_info(threads, peaks), "results": results,
                            "target": "shared >= 1.5x padding-free tokens/s"})


if __name__ == "__main__":
    main()
