"""Build the built-in code speed-up task and its tiny policy offline: `python -m launch.prepare_tiny_code`.

Writes OUT/data/{train,test}.jsonl (one row per problem: prompt, reference, harness, tests, hidden
tests, benchmark input, ...; see `rl.code_tasks`), a word-level tokenizer over C tokens and a small
Llama model (OUT/model, loadable by transformers and vLLM), and OUT/prepare_summary.json.

The model is warmed up by SFT on a mix of rewrites of each training problem's slow function (copies
of it, faster O(n) ones, O(1) closed forms and near-miss wrong ones; `rl.code_tasks.DEFAULT_MIX`)
and stopped once a sample at temperature 1.0 is an exactly correct rewrite about half of the time,
a medium and a fast one each now and then. GRPO then starts from a policy that is right about
half the time, mostly with the slow copy (speed-up 1), sometimes with a medium (1.6-22x fewer
instructions) or a fast (~70x) program. On one CPU thread the build takes ~1-2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from launch.prepare_tiny import build_model, word_tokenizer
from rl.code_tasks import (
    CORRECT_KINDS,
    KINDS,
    CodeProblem,
    all_code_problems,
    code_corpus,
    code_speedup_splits,
    sft_examples,
)
from trainer.sft import sequence_logprobs, sft_train

MAX_POSITIONS = 256
MAX_NEW_TOKENS = 64  # the longest variant has 48 tokens (+ EOS)


def kind_probabilities(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[CodeProblem]
) -> dict[str, float]:
    """Mean chance, over `problems`, that one T=1.0 sample is exactly a known variant of each kind.

    Teacher-forced (no sampling noise); `correct` sums the slow, medium and fast kinds.
    """
    pairs = [(p.prompt, src, kind) for p in problems for kind in KINDS for src in p.variants.get(kind, ())]
    if not pairs:
        return {k: 0.0 for k in (*KINDS, "correct")}
    probs = sequence_logprobs(model, tokenizer, [p for p, _, _ in pairs], [c for _, c, _ in pairs]).exp()
    out = {k: 0.0 for k in KINDS}
    for (_, _, kind), prob in zip(pairs, probs.tolist()):
        out[kind] += prob / len(problems)
    out["correct"] = sum(out[k] for k in CORRECT_KINDS)
    return out


@torch.no_grad()
def sample_completions(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    *,
    n: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 256,
) -> list[list[str]]:
    """`n` completions per prompt (text up to EOS, special tokens dropped), in prompt order.

    Prompts are batched by token length so no batch needs padding (positions then match what the
    model saw in training and what vLLM does). Sampling uses a forked RNG seeded with `seed`.
    """
    eos = tokenizer.eos_token_id
    encoded = [tokenizer(p).input_ids for p in prompts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)] += [i] * n
    out: list[list[str]] = [[] for _ in prompts]
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length in sorted(by_len):
            idx = by_len[length]
            for start in range(0, len(idx), batch_size):
                chunk = idx[start : start + batch_size]
                ids = torch.tensor([encoded[i] for i in chunk])
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                    **sampling,
                )
                for i, row in zip(chunk, gen[:, length:].tolist()):
                    row = row[: row.index(eos)] if eos in row else row
                    out[i].append(tokenizer.decode(row, skip_special_tokens=True).strip())
    model.train(was_training)
    return out


def sampled_kinds(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[CodeProblem],
    *,
    n: int,
    seed: int,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Share of `n` samples per problem that are exactly a slow/medium/fast/wrong variant or none
    (`other`), `correct` (slow + medium + fast), and per problem the share of correct samples."""
    samples = sample_completions(model, tokenizer, [p.prompt for p in problems], n=n, seed=seed,
                                 temperature=temperature)
    counts: Counter[str] = Counter()
    per_problem: dict[str, float] = {}
    for problem, texts in zip(problems, samples):
        kinds = [problem.kind_of(t) for t in texts]
        counts.update(kinds)
        per_problem[problem.problem_id] = sum(k in CORRECT_KINDS for k in kinds) / max(1, len(kinds))
    total = max(1, sum(counts.values()))
    shares = {k: counts[k] / total for k in (*KINDS, "other")}
    shares["correct"] = sum(shares[k] for k in CORRECT_KINDS)
    return {
        "n_samples": sum(counts.values()),
        "shares": shares,
        "problems_with_a_correct_sample": sum(v > 0 for v in per_problem.values()) / max(1, len(per_problem)),
        "per_problem_correct": per_problem,
    }


def _write_jsonl(path: Path, problems: list[CodeProblem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps(p.to_row()) + "\n")


def build_tiny_code(
    out_dir: str = "artifacts/tiny_code",
    seed: int = 0,
    *,
    per_problem: int = 40,
    mix: dict[str, float] | None = None,
    steps: int = 1000,
    target_correct: float = 0.5,
    target_faster: float = 0.07,
    probe_every: int = 25,
    batch_size: int = 32,
    lr: float = 3e-3,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    n_samples: int = 8,
    threads: int | None = 1,
    log_every: int = 100,
) -> dict[str, Any]:
    """Write the data, train tokenizer and model, warm up, evaluate, save; returns the summary.

    The warm-up runs at most `steps` SFT steps on `per_problem` (prompt, variant) pairs per
    training problem mixed by `mix` (kind -> weight, default `rl.code_tasks.DEFAULT_MIX`) and stops
    once the teacher-forced chance that a T=1.0 sample is an exactly correct variant, averaged
    over the training problems and checked every `probe_every` steps, reaches `target_correct`
    and the chances that it is a medium and a fast variant each reach `target_faster`
    (target_correct 0 or above 1: never stop early). Stopping on the probe rather than a step
    count keeps the result similar across seeds, which learn to copy the prompt at different
    steps. The final model is then sampled `n_samples` times per problem at T=1.0 to report the
    share of each variant kind (0 skips it). `threads` sets torch's CPU threads while it runs
    (None or 0: leave them); the caller's setting is restored.
    """
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _build(out_dir, seed, per_problem=per_problem, mix=mix, steps=steps,
                      target_correct=target_correct, target_faster=target_faster,
                      probe_every=probe_every, batch_size=batch_size,
                      lr=lr, hidden=hidden, layers=layers, heads=heads, n_samples=n_samples,
                      log_every=log_every)
    finally:
        torch.set_num_threads(threads_before)


def _build(
    out_dir: str,
    seed: int,
    *,
    per_problem: int,
    mix: dict[str, float] | None,
    steps: int,
    target_correct: float,
    target_faster: float,
    probe_every: int,
    batch_size: int,
    lr: float,
    hidden: int,
    layers: int,
    heads: int,
    n_samples: int,
    log_every: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out_dir)
    train, test = code_speedup_splits(seed)
    _write_jsonl(out / "data" / "train.jsonl", train)
    _write_jsonl(out / "data" / "test.jsonl", test)

    # The vocabulary covers every problem of every family, so it does not depend on the split.
    tokenizer = word_tokenizer(code_corpus(all_code_problems()), model_max_length=MAX_POSITIONS)
    model = build_model(tokenizer, seed, hidden=hidden, layers=layers, heads=heads, max_positions=MAX_POSITIONS)
    examples = sft_examples(train, seed=seed, per_problem=per_problem, mix=mix)
    probes: list[dict[str, float]] = []

    def reached_target(done: int) -> bool:
        if not 0 < target_correct <= 1 or done % probe_every:
            return False
        probs = kind_probabilities(model, tokenizer, train)
        probes.append({"step": done, **{k: round(v, 4) for k, v in probs.items()}})
        if log_every:
            print(f"probe step {done}: " + " ".join(f"{k} {v:.3f}" for k, v in probs.items()), flush=True)
        return probs["correct"] >= target_correct and min(probs["medium"], probs["fast"]) >= target_faster

    t_sft = time.perf_counter()
    losses = sft_train(
        model,
        tokenizer,
        [p for p, _ in examples],
        [c for _, c in examples],
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        log_every=log_every,
        warmup_steps=min(50, steps // 10),
        stop_fn=reached_target,
    )
    sft_s = time.perf_counter() - t_sft

    model_dir = out / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)

    summary: dict[str, Any] = {
        "seed": seed,
        "model_dir": str(model_dir),
        "train_file": str(out / "data" / "train.jsonl"),
        "test_file": str(out / "data" / "test.jsonl"),
        "n_train": len(train),
        "n_test": len(test),
        "families": dict(Counter(p.family for p in train + test)),
        "n_sft_examples": len(examples),
        "params": sum(p.numel() for p in model.parameters()),
        "config": {"hidden": hidden, "layers": layers, "heads": heads, "vocab": len(tokenizer),
                   "max_positions": MAX_POSITIONS},
        "sft_steps": len(losses),
        "sft_max_steps": steps,
        "sft_target_correct": target_correct,
        "sft_target_faster": target_faster,
        "sft_probes": probes,
        "sft_batch_size": batch_size,
        "sft_lr": lr,
        "sft_first_loss": losses[0] if losses else None,
        "sft_final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
        "expected_kinds_train": kind_probabilities(model, tokenizer, train),
        "expected_kinds_test": kind_probabilities(model, tokenizer, test),
        "sft_s": round(sft_s, 2),
    }
    if n_samples:
        t_eval = time.perf_counter()
        for name, problems, offset in (("train", train, 1), ("test", test, 2)):
            res = sampled_kinds(model, tokenizer, problems, n=n_samples, seed=seed + offset)
            summary[f"sampled_{name}"] = {k: v for k, v in res.items() if k != "per_problem_correct"}
        summary["eval_s"] = round(time.perf_counter() - t_eval, 2)
    summary["total_s"] = round(time.perf_counter() - t0, 2)
    (out / "prepare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/tiny_code", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="most SFT warm-up steps")
    parser.add_argument(
        "--target-correct", type=float, default=None,
        help="stop the warm-up once a T=1.0 sample is an exactly correct rewrite with this chance",
    )
    parser.add_argument(
        "--target-faster", type=float, default=None,
        help="... and a medium and a fast rewrite each with this chance",
    )
    parser.add_argument("--samples", type=int, default=None, help="samples per problem for the report (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"threads": args.threads}
    if args.steps is not None:
        kwargs["steps"] = args.steps
    if args.target_correct is not None:
        kwargs["target_correct"] = args.target_correct
    if args.target_faster is not None:
        kwargs["target_faster"] = args.target_faster
    if args.samples is not None:
        kwargs["n_samples"] = args.samples
    summary = build_tiny_code(args.out, args.seed, **kwargs)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
