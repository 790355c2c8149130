"""The built-in math task for an instruct model: arithmetic and short word problems of graded
difficulty, asked through the model's chat template, answered as a number.

An instruct model samples chatty text at temperature 1 ("13 + 14 equals 17.", or a story), so a
task made only of 2-digit sums gives GRPO groups that are all wrong. The levels mix questions it
mostly gets right with ones it mostly gets wrong, so that sampled groups disagree:

- `one_digit`: `a + b`, `a - b` (a >= b), `a * b` with one-digit operands;
- `two_one`: a two-digit and a one-digit number, added or subtracted;
- `two_two`: two two-digit numbers added;
- `word`: a one-sentence story over one-digit numbers (gets more, gives away, boxes of).

Every prompt states the answer format ("Reply with just the number."); the reward
(`configs/reward/math.yaml`) is `reward.builtin:math_answer` (math-verify against the `answer`
column) plus a small `reward.builtin:math_format` bonus. Train and test questions are disjoint.

- data: OUT/data/{train,test}.jsonl (columns `prompt`, `answer`, `level`), `write_data`;
- model: none of its own: `task=math_chat` trains `model=smollm2` (examples/smollm2.py) by default.

Built on first use (`rl.data.builtins.ensure_builtin`); by hand: `python -m examples.math_chat [--out DIR]`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

from examples.tiny import main
from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/math_chat"
INSTRUCTION = "Reply with just the number."
# Share of each level in both splits: a third easy, the rest where the model has room to improve.
MIX = {"one_digit": 0.35, "two_one": 0.25, "two_two": 0.2, "word": 0.2}

NAMES = ("Tom", "Anna", "Sam", "Lily", "Max", "Emma", "Ben", "Mia", "Leo", "Zoe")
THINGS = ("apples", "books", "coins", "pencils", "cards", "stickers", "marbles", "cookies")


def _arith(a: int, op: str, b: int) -> tuple[str, int]:
    return f"What is {a} {op} {b}?", {"+": a + b, "-": a - b, "*": a * b}[op]


def _word(kind: int, name: str, thing: str, a: int, b: int) -> tuple[str, int]:
    if kind == 0:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == 1:
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    return f"There are {a} boxes with {b} {thing} in each box. How many {thing} are there in all?", a * b


def questions(level: str) -> list[tuple[str, int]]:
    """Every question of a level, in a fixed order (the splits sample from these)."""
    one, two = range(1, 10), range(10, 100)
    makers: dict[str, Callable[[], list[tuple[str, int]]]] = {
        "one_digit": lambda: [_arith(a, op, b) for a in one for b in one for op in "+-*" if op != "-" or a >= b],
        "two_one": lambda: [_arith(a, op, b) for a in two for b in one for op in "+-"],
        "two_two": lambda: [_arith(a, "+", b) for a in two for b in two],
        "word": lambda: [_word(k, n, t, a, b) for k in range(3) for n in NAMES for t in THINGS for a in one for b in one
                         if k != 1 or a > b],
    }
    return makers[level]()


def math_splits(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train/test rows in the proportions of `MIX` (each split shuffled), fixed by `seed`. Test
    questions are distinct and never in train (a pool may hold a question twice: the boxes story
    does not name anyone); a level with fewer questions left than its share of train (one-digit
    sums: 207 in all) repeats them, as epochs would."""
    rng = random.Random(seed)
    train: list[dict[str, Any]] = []
    test: list[dict[str, Any]] = []
    for level, share in MIX.items():
        pool = questions(level)
        k_train, k_test = round(n_train * share), round(n_test * share)
        rng.shuffle(pool)
        held = list(dict.fromkeys(pool))[:k_test]
        kept = set(held)
        rest = [q for q in pool if q not in kept]
        if len(held) < k_test or not rest:
            raise ValueError(f"level {level!r} has {len(set(pool))} questions, too few for {k_test} held out")
        picked = [rest[i % len(rest)] for i in range(k_train)]
        for rows, part in ((test, held), (train, picked)):
            rows += [{"prompt": f"{q} {INSTRUCTION}", "answer": str(a), "level": level} for q, a in part]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, *, n_train: int = 2000, n_test: int = 200) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl."""
    train, test = math_splits(n_train, n_test, seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", rows) for name, rows in (("train", train),
                                                                                            ("test", test))]


def build(out_dir: str = DEFAULT_DIR, seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """The task has data only (the model is `examples.smollm2`'s): `write_data`."""
    train_file, test_file = write_data(out_dir, seed, **kwargs)
    return {"train_file": train_file, "test_file": test_file}


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
