"""The built-in Python code task for an instruct model: write a small function from its signature
and docstring, judged by hidden tests in the sandbox (`task=python_funcs`).

Its rows have HumanEval's columns (`prompt`, `code_prompt`, `test`, `entry_point`), so one reward
function, `reward.humaneval:passes`, scores both this task's training samples and HumanEval's
held-out ones (examples/humaneval.py; the task evaluates on HumanEval). The prompt is
HumanEval's instruction around the stub, so what the policy learns here (a fenced ```python block
holding the whole function) is what HumanEval asks for.

The problems are simple on purpose, for a 135M model: one-liners over numbers, lists and strings
(add a constant, filter a list, count a character...), each family with many constants and names so
that the prompts are distinct. The expected outputs in each `check` are computed here by the
family's reference implementation. None of them is a HumanEval problem: those that were
(a palindrome test, a list's largest element) and their mirror images are left out.

- data: OUT/data/train.jsonl (columns above and `family`, the family's name template), `write_data`;
- model: none of its own: `task=python_funcs` trains `model=smollm2` by default.

Built on first use (`rl.data.builtins.ensure_builtin`); by hand: `python -m examples.python_funcs [--out DIR]`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from examples.humaneval import INSTRUCTION
from examples.tiny import main
from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/python_funcs"
WORDS = ("hello", "banana", "Python", "level", "abc", "mississippi", "data", "Open AI", "racecar", "tree")
LISTS = ([1, 2, 3], [5, -2, 9, 0], [10], [4, 4, 1, 7, 3], [-3, -8, -1], [0, 12, 6, 8, 2, 15])
NUMBERS = (0, 1, 2, 5, -4, 11, 30)
ENGLISH = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


@dataclass(frozen=True)
class Family:
    """A kind of problem: `name` and `doc` templates over a constant `k`, the argument names, the
    reference implementation (given k) and the inputs the hidden tests call it with."""

    name: str
    args: str
    doc: str
    ref: Callable[[Any], Callable[..., Any]]
    inputs: list[tuple]
    constants: list[Any]

    def row(self, k: Any) -> dict[str, Any]:
        entry = self.name.format(k=k, word=ENGLISH.get(k, k) if isinstance(k, int) else k)
        fn = self.ref(k)
        shown = self.inputs[0]
        example = f"    >>> {entry}({', '.join(map(repr, shown))})\n    {fn(*shown)!r}\n"
        code_prompt = f"def {entry}({self.args}):\n    \"\"\"{self.doc.format(k=k)}\n{example}    \"\"\"\n"
        checks = "".join(f"    assert candidate({', '.join(map(repr, a))}) == {fn(*a)!r}\n" for a in self.inputs)
        return {"prompt": INSTRUCTION.format(code=code_prompt), "code_prompt": code_prompt,
                "test": f"def check(candidate):\n{checks}", "entry_point": entry, "family": self.name}


def families() -> list[Family]:
    ks = list(range(2, 11))
    nums = [(n,) for n in NUMBERS]
    lists = [(list(xs),) for xs in LISTS]
    words = [(w,) for w in WORDS]
    return [
        Family("add_{word}", "x", "Return x plus {k}.", lambda k: lambda x: x + k, nums, ks),
        Family("times_{word}", "x", "Return x multiplied by {k}.", lambda k: lambda x: x * k, nums, ks),
        Family("minus_{word}", "x", "Return x minus {k}.", lambda k: lambda x: x - k, nums, ks),
        Family("divisible_by_{word}", "n", "Return True if n is divisible by {k}, else False.",
               lambda k: lambda n: n % k == 0, [(n,) for n in (0, 6, 7, 20, 30, 45, 63)], ks),
        Family("greater_than_{word}", "xs", "Return the numbers in the list xs that are greater than {k}, in order.",
               lambda k: lambda xs: [x for x in xs if x > k], [([1, 5, 12, 3, 9],), ([],), ([10, 2, 8],), ([4, 11, 7],)],
               ks),
        Family("add_{word}_to_each", "xs", "Return a new list with {k} added to every number in xs.",
               lambda k: lambda xs: [x + k for x in xs], lists, ks),
        Family("first_{word}", "xs", "Return the first {k} elements of the list xs (all of them if it is shorter).",
               lambda k: lambda xs: xs[:k], lists, [2, 3, 4]),
        Family("repeat_{word}", "s", "Return the string s repeated {k} times.", lambda k: lambda s: s * k,
               words[:5], [2, 3, 4, 5]),
        Family("count_{k}", "s", "Return how many times the letter '{k}' occurs in the string s.",
               lambda k: lambda s: s.count(k), words, list("aeinoprst")),
        Family("sum_list", "xs", "Return the sum of the numbers in the list xs.", lambda k: lambda xs: sum(xs), lists,
               [None]),
        Family("reverse_string", "s", "Return the string s reversed.", lambda k: lambda s: s[::-1], words, [None]),
        Family("to_upper", "s", "Return the string s in upper case.", lambda k: lambda s: s.upper(), words, [None]),
        Family("squares", "xs", "Return a list of the squares of the numbers in xs.",
               lambda k: lambda xs: [x * x for x in xs], lists, [None]),
        Family("count_evens", "xs", "Return how many numbers in the list xs are even.",
               lambda k: lambda xs: sum(1 for x in xs if x % 2 == 0), lists, [None]),
        Family("absolute", "x", "Return the absolute value of x.", lambda k: lambda x: abs(x), nums, [None]),
    ]


def problems() -> list[dict[str, Any]]:
    """Every problem, in a fixed order: each family at each of its constants."""
    return [family.row(k) for family in families() for k in family.constants]


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0) -> list[str]:
    """OUT/data/train.jsonl: every problem, shuffled by `seed` (the prompt stream reshuffles per epoch)."""
    rows = problems()
    random.Random(seed).shuffle(rows)
    return [write_jsonl(Path(out_dir) / "data" / "train.jsonl", rows)]


BUILD_WHAT = "task data (no model of its own)"


def build(out_dir: str = DEFAULT_DIR, seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """The task has data only (the model is `examples.smollm2`'s): `write_data`."""
    (train_file,) = write_data(out_dir, seed)
    return {"train_file": train_file}


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
