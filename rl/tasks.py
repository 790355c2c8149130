"""Synthetic verifiable tasks for the built-in tiny setup (torch-free).

Two-number addition is the smallest task whose answer can be checked by exact string match and
that a ~1M-parameter model can half-learn in seconds: a good starting point for GRPO on a laptop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
