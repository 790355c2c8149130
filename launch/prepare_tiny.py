"""Build the built-in tiny policy and its task with no network: `python -m launch.prepare_tiny`.

Writes OUT/data/{train,test}.jsonl (columns `prompt`, `answer`: 2-digit addition), a locally
trained tokenizer and a small Llama model (OUT/model, loadable by transformers and vLLM), and
OUT/prepare_summary.json. The model is warmed up by SFT just enough to answer correctly some of
the time when sampled at temperature 1.0, so GRPO has a signal to amplify and room to improve.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rl.tasks import Problem, addition_corpus, addition_splits
from trainer.sft import sequence_logprobs, sft_train

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


def build_tokenizer(
    corpus: list[str],
    *,
    pre_tokenizer: Any = None,
    decoder: Any = None,
    model_max_length: int = 64,
) -> PreTrainedTokenizerFast:
    """Word-level tokenizer trained on `corpus`: one token per digit and per symbol.

    Special ids are fixed (pad 0, bos 1, eos 2, unk 3). Encoding a text prepends BOS and never
    appends EOS, so `tokenizer(prompt).input_ids` is exactly what the model saw in training.
    By default words are split at punctuation and into single digits and decoded by joining the
    pieces without spaces (the arithmetic task); other tasks pass their own `pre_tokenizer` and
    `decoder` (e.g. `word_tokenizer` below: whitespace-separated words, joined with spaces).
    """
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizer if pre_tokenizer is not None else pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=[PAD, BOS, EOS, UNK]))
    # default: join pieces without spaces: ["6", "2"] -> "62"
    tok.decoder = decoder if decoder is not None else decoders.Fuse()
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # for batched generation; the SFT collator pads on its own
        model_max_length=model_max_length,
    )


def word_tokenizer(corpus: list[str], model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Word-level tokenizer for texts whose words are separated by single spaces (e.g. C tokens).

    Each whitespace-separated word of `corpus` is one token; decoding joins tokens with one space,
    so decoded text re-encodes to the same ids. Special tokens as in `build_tokenizer`.
    """
    return build_tokenizer(
        corpus,
        pre_tokenizer=pre_tokenizers.WhitespaceSplit(),
        decoder=decoders.WordPiece(prefix="##", cleanup=False),  # no word starts with "##": joins with " "
        model_max_length=model_max_length,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 64,
) -> LlamaForCausalLM:
    """A random-init Llama (head_dim 32, which vLLM's CPU attention supports), fixed by `seed`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.float().eval()


@torch.no_grad()
def sample_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[Problem],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int = 6,
    batch_size: int = 256,
) -> dict[str, float]:
    """Exact-match accuracy of completions (decoded up to EOS, stripped) and how many are clean.

    `well_formed` counts completions that are digits only and end with EOS. temperature 0 means
    greedy. Sampling uses a forked RNG so the caller's global state is untouched.
    """
    correct = well_formed = 0
    eos = tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
            sampling: dict[str, Any] = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature > 0
                else {"do_sample": False}
            )
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
            for problem, row in zip(chunk, out[:, enc.input_ids.shape[1] :].tolist()):
                ended = eos in row
                text = tokenizer.decode(row[: row.index(eos)] if ended else row, skip_special_tokens=True)
                text = text.strip()
                correct += text == problem.answer
                well_formed += ended and text.isdigit()
    n = max(1, len(problems))
    return {"accuracy": correct / n, "well_formed": well_formed / n, "n": float(len(problems))}


def expected_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> float:
    """Mean probability that a T=1.0 sample is exactly the answer followed by EOS (no sampling noise)."""
    logp = sequence_logprobs(model, tokenizer, [p.prompt for p in problems], [p.answer for p in problems])
    return float(logp.exp().mean()) if len(problems) else 0.0


def _write_jsonl(path: Path, problems: list[Problem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps(p.to_row()) + "\n")


def prepare_tiny(
    out_dir: str = "artifacts/tiny",
    seed: int = 0,
    *,
    n_train: int = 5000,
    n_test: int = 500,
    n_eval: int = 300,
    steps: int = 1000,
    target_accuracy: float = 0.3,
    probe_every: int = 10,
    n_probe: int = 256,
    batch_size: int = 64,
    lr: float = 3e-3,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    threads: int | None = 1,
    log_every: int = 100,
) -> dict[str, Any]:
    """Generate data, train tokenizer and model, warm up, evaluate, save; returns the summary.

    The warm-up runs at most `steps` SFT steps and stops as soon as the expected T=1.0 accuracy
    (mean probability of answer + EOS) on `n_probe` training prompts, checked every `probe_every`
    steps, reaches `target_accuracy`.
    Stopping on accuracy rather than a step count matters: when the model picks up the carry
    differs a lot between seeds, and GRPO needs a policy that is right only some of the time.
    Set `target_accuracy` to 0 or above 1 to disable it. `threads` sets torch's CPU threads
    while it runs (None or 0: leave them); the caller's setting is restored afterwards.
    """
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _prepare(out_dir, seed, n_train=n_train, n_test=n_test, n_eval=n_eval, steps=steps,
                        target_accuracy=target_accuracy, probe_every=probe_every, n_probe=n_probe,
                        batch_size=batch_size, lr=lr, hidden=hidden, layers=layers, heads=heads,
                        log_every=log_every)
    finally:
        torch.set_num_threads(threads_before)  # callers (the train driver, tests) keep their setting


def _prepare(
    out_dir: str,
    seed: int,
    *,
    n_train: int,
    n_test: int,
    n_eval: int,
    steps: int,
    target_accuracy: float,
    probe_every: int,
    n_probe: int,
    batch_size: int,
    lr: float,
    hidden: int,
    layers: int,
    heads: int,
    log_every: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out_dir)
    train, test = addition_splits(n_train, n_test, seed=seed)
    _write_jsonl(out / "data" / "train.jsonl", train)
    _write_jsonl(out / "data" / "test.jsonl", test)

    tokenizer = build_tokenizer(addition_corpus())
    model = build_model(tokenizer, seed, hidden=hidden, layers=layers, heads=heads)
    probe_set = train[-n_probe:]
    probes: list[tuple[int, float]] = []

    def reached_target(done: int) -> bool:
        if not 0 < target_accuracy <= 1 or done % probe_every:
            return False
        acc = expected_accuracy(model, tokenizer, probe_set)
        probes.append((done, acc))
        return acc >= target_accuracy

    t_sft = time.perf_counter()
    losses = sft_train(
        model,
        tokenizer,
        [p.prompt for p in train],
        [p.answer for p in train],
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        log_every=log_every,
        warmup_steps=min(50, steps // 10),
        stop_fn=reached_target,
    )
    sft_s = time.perf_counter() - t_sft

    eval_set = test[:n_eval]
    sampled = sample_accuracy(model, tokenizer, eval_set, temperature=1.0, seed=seed)
    greedy = sample_accuracy(model, tokenizer, eval_set, temperature=0.0, seed=seed)

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
        "params": sum(p.numel() for p in model.parameters()),
        "config": {"hidden": hidden, "layers": layers, "heads": heads, "vocab": len(tokenizer)},
        "sft_steps": len(losses),
        "sft_max_steps": steps,
        "sft_target_probe_accuracy": target_accuracy,
        "sft_probe_accuracy": probes[-1][1] if probes else None,
        "sft_batch_size": batch_size,
        "sft_lr": lr,
        "sft_first_loss": losses[0] if losses else None,
        "sft_final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
        "eval_n": len(eval_set),
        "expected_accuracy_t1": expected_accuracy(model, tokenizer, eval_set),
        "sampled_accuracy_t1": sampled["accuracy"],
        "sampled_well_formed_t1": sampled["well_formed"],
        "greedy_accuracy": greedy["accuracy"],
        "greedy_well_formed": greedy["well_formed"],
        "sft_s": round(sft_s, 2),
        "total_s": round(time.perf_counter() - t0, 2),
    }
    (out / "prepare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/tiny", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="most SFT warm-up steps")
    parser.add_argument(
        "--target-accuracy", type=float, default=None,
        help="stop the warm-up once the expected T=1.0 accuracy on training prompts reaches this",
    )
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (0: leave as is); 1 is within ~20% of 2 for this model on an idle 2-core "
        "machine and stays fast when the cores are shared, where 2 threads can slow down 50x",
    )
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"threads": args.threads}
    if args.steps is not None:
        kwargs["steps"] = args.steps
    if args.target_accuracy is not None:
        kwargs["target_accuracy"] = args.target_accuracy
    summary = prepare_tiny(args.out, args.seed, **kwargs)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
