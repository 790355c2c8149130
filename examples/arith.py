"""The built-in arithmetic task: 2-digit addition with a tiny policy that is right some of the time.

Two-number addition is the smallest task whose answer can be checked by exact string match and
that a ~1M-parameter model can half-learn in seconds: a good starting point for GRPO on a laptop.

- data: `addition_splits` (columns `prompt`, `answer`), written to OUT/data/{train,test}.jsonl;
- model: a digit-level tokenizer and a small Llama (OUT/model), warmed up by SFT just enough to
  answer correctly some of the time when sampled at temperature 1.0, so GRPO has a signal to
  amplify and room to improve (`build`; `python -m examples.arith`);
- reward: `configs/reward/arith.yaml` (the default `reward=arith`): `reward.builtin:exact_answer`
  against the `answer` column plus a small `reward.builtin:format_number` bonus.

`python -m launch.train` on its defaults builds this task on first use (`rl.data.builtins.ensure_builtin`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from examples.tiny import ProbeStop, Recipe, TaskBuild, at_two_temperatures, build_tokenizer, main, warm_up
from rl.data.jsonl import write_jsonl
from trainer.sft import sequence_logprobs

DEFAULT_DIR = "artifacts/tiny"


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; the completion must equal `answer` exactly."""

    prompt: str
    answer: str

    def to_row(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer}


def addition_prompt(a: int, b: int) -> str:
    """The prompt text, e.g. `37+25=`: no spaces, no trailing newline."""
    return f"{a}+{b}="


def addition_problem(a: int, b: int) -> Problem:
    return Problem(prompt=addition_prompt(a, b), answer=str(a + b))


def addition_splits(
    n_train: int, n_test: int, seed: int = 0, lo: int = 10, hi: int = 99
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train/test sets of `a+b=` problems with operands in [lo, hi], fixed by `seed`.

    Operand pairs are drawn without replacement, so no test prompt appears in training.
    """
    if lo < 0 or hi < lo:
        raise ValueError(f"operand range must satisfy 0 <= lo <= hi, got lo={lo}, hi={hi}")
    span = hi - lo + 1
    total = span * span
    if n_train < 0 or n_test < 0 or n_train + n_test > total:
        raise ValueError(
            f"n_train + n_test = {n_train + n_test} must be in [0, {total}] "
            f"(the number of distinct pairs with operands in [{lo}, {hi}])"
        )
    rng = random.Random(seed)
    codes = rng.sample(range(total), n_train + n_test)
    problems = [addition_problem(lo + c // span, lo + c % span) for c in codes]
    return problems[:n_train], problems[n_train:]


def addition_corpus(lo: int = 0, hi: int = 99) -> list[str]:
    """Text covering every symbol the task uses; enough to train the task's tokenizer."""
    return [addition_prompt(a, b) + str(a + b) for a in range(lo, hi + 1) for b in (lo, hi)]


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, *, n_train: int = 5000, n_test: int = 500) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl (disjoint prompts, fixed by `seed`)."""
    train, test = addition_splits(n_train, n_test, seed=seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", (p.to_row() for p in problems))
            for name, problems in (("train", train), ("test", test))]


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


RECIPE = Recipe()  # size and warm-up of the tiny policy (examples.tiny.Recipe)


def build(
    out_dir: str = DEFAULT_DIR,
    seed: int = 0,
    *,
    target_accuracy: float = 0.3,
    **recipe: Any,
) -> dict[str, Any]:
    """Generate data, train tokenizer and model, warm up, evaluate, save; returns the summary.

    The warm-up runs at most `steps` SFT steps and stops as soon as the expected T=1.0 accuracy
    (mean probability of answer + EOS) on `n_probe` training prompts, checked every `probe_every`
    steps, reaches `target_accuracy`.
    Stopping on accuracy rather than a step count matters: when the model picks up the carry
    differs a lot between seeds, and GRPO needs a policy that is right only some of the time.
    Set `target_accuracy` to 0 or above 1 to disable it. `recipe`: any field of `Recipe`
    (steps, batch_size, lr, probe_every, hidden, layers, heads, threads, log_every, n_train, n_test,
    n_eval, n_probe).
    """
    with TaskBuild(out_dir, seed, RECIPE, recipe) as task:
        r = task.recipe
        train, test = addition_splits(r.n_train, r.n_test, seed=seed)
        write_data(out_dir, seed, n_train=r.n_train, n_test=r.n_test)
        tokenizer = build_tokenizer(addition_corpus())
        model = task.model(tokenizer)
        probe_set = train[-r.n_probe:]
        stop = ProbeStop("accuracy", target_accuracy, r.probe_every,
                         lambda: expected_accuracy(model, tokenizer, probe_set))
        _, sft_summary = warm_up(model, tokenizer, [p.prompt for p in train], [p.answer for p in train],
                                 r, seed, stop_fn=stop)
        eval_set = test[:r.n_eval]
        sampled = at_two_temperatures(functools.partial(sample_accuracy, model, tokenizer, eval_set), seed)
        expected = {"eval_n": len(eval_set), "expected_accuracy_t1": expected_accuracy(model, tokenizer, eval_set)}
        return task.finish(model, tokenizer, train, test, stop.figures(), sft_summary, sampled, expected)


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
