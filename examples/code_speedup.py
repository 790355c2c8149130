"""The built-in "code speed-up" task: make a slow C function faster without changing its results.

Every problem is a function `long f(long n)` (defined for n >= 0) from one of a few families of
integer loops with small digit parameters. The policy sees the slow reference and must write an
equivalent faster one; the reward compiles it with a trusted harness (`HARNESS`), runs visible and
hidden tests and counts the instructions of a benchmark run under callgrind.

Sources are C tokens separated by single spaces and every integer constant is one digit, so the
whole task fits a word-level vocabulary of ~40 words, and every source compiles as written.
Prompts are at most 48 words and every variant at most 47 (48 tokens with EOS).
For each problem the generator also knows a few *variants* used to warm up the tiny policy by
SFT: the slow reference itself, "medium" O(n) rewrites that do less work per n (stepping by `a`
instead of testing `i % a`, hoisting a multiply or an inner loop out), a "fast" O(1) closed form
and "wrong" near-misses (off-by-one bound, wrong constant).

- data: `code_speedup_splits` (one row per problem: prompt, reference, harness, tests, hidden
  tests, benchmark input...), written to OUT/data/{train,test}.jsonl;
- model: a word-level tokenizer over C tokens and a small Llama (OUT/model), warmed up by SFT on a
  mix of rewrites of each training problem's slow function (copies of it, faster O(n) ones, O(1)
  closed forms and near-miss wrong ones; `DEFAULT_MIX`) and stopped once a sample at temperature
  1.0 is an exactly correct rewrite about half of the time, a medium and a fast one each now and
  then (`build`; `python -m examples.code_speedup`, ~1-2 minutes on one CPU thread). GRPO then
  starts from a policy that is right about half the time, mostly with the slow copy (speed-up 1),
  sometimes with a medium (1.6-22x fewer instructions) or a fast (~70x) program;
- reward: `configs/task/code_speedup.yaml` (`task=code_speedup`): `reward.code_speedup`, which
  sends each completion with the row's reference, harness and tests to the sandbox pool.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from examples.tiny import Recipe, TaskBuild, main, warm_up, word_tokenizer
from rl.data.jsonl import write_jsonl
from trainer.sft import sequence_logprobs

DEFAULT_DIR = "artifacts/tiny_code"

LANGUAGE = "c"
SEPARATOR = "=>"  # ends every prompt: "<slow reference> =>"
KINDS = ("slow", "medium", "fast", "wrong")
CORRECT_KINDS = ("slow", "medium", "fast")

# -O0 keeps the loops the source asks for (gcc -O1 and up may turn counting loops into closed
# forms by scalar evolution, which would erase the differences the task rewards), and -static
# removes the dynamic loader's ~90k instructions from every measurement: the fixed cost of a run
# (start-up, scanf, printf) is then ~42k instructions, so an O(1) solution reads as a ~50x speed-up.
COMPILE_FLAGS: tuple[str, ...] = ("-O0", "-static")

# Target instruction count of the slow reference's loop on the benchmark input (see `_bench_n`):
# large against the ~42k fixed cost, small enough that one callgrind run takes well under 0.5 s.
BENCH_LOOP_INSTRUCTIONS = 3_000_000

MAX_INPUTS = 64  # numbers the harness reads at most

HARNESS = r"""/* Trusted harness of the code speed-up task: built with the candidate (solution.c). */
#include <stdio.h>

long f(long n);

int main(void) {
    long xs[64];
    int k = 0;
    char sentinel[64];
    /* Read every number first, then the sentinel, and only then run the candidate: output that
       does not end with the sentinel means the program died or exited early. */
    while (k < 64 && scanf("%ld", &xs[k]) == 1)
        k++;
    if (scanf("%63s", sentinel) != 1)
        return 3;
    for (int i = 0; i < k; i++)
        printf("%ld\n", f(xs[i]));
    printf("%s\n", sentinel);
    return 0;
}
"""


@dataclass(frozen=True)
class CodeProblem:
    """One slow function plus what is needed to judge, benchmark and imitate rewrites of it."""

    problem_id: str
    family: str
    params: tuple[int, ...]
    reference: str
    variants: dict[str, tuple[str, ...]]  # kind (slow/medium/fast/wrong) -> sources
    tests: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (inputs, expected outputs)
    hidden_tests: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    bench_n: int
    compile_flags: tuple[str, ...] = COMPILE_FLAGS
    harness: str = field(default=HARNESS, repr=False)

    @property
    def prompt(self) -> str:
        return code_prompt(self.reference)

    def correct_variants(self) -> list[str]:
        return [src for kind in CORRECT_KINDS for src in self.variants.get(kind, ())]

    def kind_of(self, completion: str) -> str:
        """`slow`, `medium`, `fast` or `wrong` for a known variant (spacing ignored), else `other`."""
        text = " ".join(completion.split())
        for kind in KINDS:
            if text in self.variants.get(kind, ()):
                return kind
        return "other"

    def to_row(self) -> dict[str, Any]:
        """The dataset row (JSON-serialisable) the RL trainer and the reward service read."""
        return {
            "prompt": self.prompt,
            "problem_id": self.problem_id,
            "family": self.family,
            "language": LANGUAGE,
            "reference": self.reference,
            "harness": self.harness,
            "compile_flags": list(self.compile_flags),
            "tests": [_test_row(i, o) for i, o in self.tests],
            "hidden_tests": [_test_row(i, o) for i, o in self.hidden_tests],
            "bench_stdin": f"{self.bench_n}\n",
        }


def code_prompt(reference: str) -> str:
    return f"{reference} {SEPARATOR}"


def _test_row(inputs: tuple[int, ...], outputs: tuple[int, ...]) -> dict[str, str]:
    return {
        "stdin": "".join(f"{x}\n" for x in inputs),
        "expected_stdout": "".join(f"{y}\n" for y in outputs),
    }


# --------------------------------------------------------------------------------------------
# Families. Each builder returns the variants by kind (the first "slow" one is the reference) and
# the exact answer for n >= 0. Sources are space-separated tokens with one-digit constants.
# --------------------------------------------------------------------------------------------

HEAD = "long f ( long n ) {"


def _src(*parts: str) -> str:
    return " ".join([HEAD, *parts, "}"])


def _loop(var: str, start: Any, bound: str, step: str, body: str, limit: str = "n") -> str:
    return f"for ( long {var} = {start} ; {var} {bound} {limit} ; {step} ) {body}"


def _other(d: int) -> int:
    """A different one-digit parameter >= 2 (for wrong-constant variants)."""
    return d + 1 if d < 9 else d - 1


def _mod_cost(a: int, b: int = 0) -> int:
    """~Instructions per n of a loop testing `i % a == b` at -O0 (measured): powers of two need no
    division, and testing a remainder other than 0 then needs a sign fix-up."""
    if a in (2, 4, 8):
        return 14 if b else 8
    return 19


Variants = dict[str, list[str]]
Family = Callable[..., tuple[Variants, Callable[[int], int], int]]


def _count_loops(test: str, first: Any, a: int, bound: str = "<=") -> tuple[str, str]:
    """(slow, medium) functions counting the i in 1..n that pass `test`, the passing i being
    first, first + a, ...: slow tests every i, medium steps by a. `bound="<"` is the off-by-one."""
    return (_src("long c = 0 ;", _loop("i", 1, bound, "i ++", f"if ( {test} ) c ++ ;"), "return c ;"),
            _src("long c = 0 ;", _loop("i", first, bound, f"i += {a}", "c ++ ;"), "return c ;"))


def count_mult(a: int) -> tuple[Variants, Callable[[int], int], int]:
    """How many i in 1..n are multiples of a."""
    slow, medium = _count_loops(f"i % {a} == 0", a, a)
    slow_off, medium_off = _count_loops(f"i % {a} == 0", a, a, "<")
    v = {"slow": [slow], "medium": [medium], "fast": [_src(f"return n / {a} ;")],
         "wrong": [slow_off, medium_off, _src(f"return n / {_other(a)} ;"), _src(f"return ( n + 1 ) / {a} ;")]}
    return v, lambda n: n // a, _mod_cost(a)  # ~instructions per n of the slow loop at -O0


def count_mod(a: int, b: int) -> tuple[Variants, Callable[[int], int], int]:
    """How many i in 1..n leave remainder b (1 <= b < a) when divided by a."""
    ob = b + 1 if b + 1 < a else b - 1
    slow, medium = _count_loops(f"i % {a} == {b}", b, a)
    slow_off, medium_off = _count_loops(f"i % {a} == {b}", b, a, "<")
    wrong_remainder, _ = _count_loops(f"i % {a} == {ob}", b, a)
    v = {"slow": [slow], "medium": [medium], "fast": [_src(f"return ( n + {a} - {b} ) / {a} ;")],
         "wrong": [slow_off, wrong_remainder, _src(f"return ( n - {b} ) / {a} ;"), medium_off]}
    return v, lambda n: (n + a - b) // a, _mod_cost(a, b)


def sum_mult(a: int) -> tuple[Variants, Callable[[int], int], int]:
    """The sum of the multiples of a in 1..n."""
    def solve(n: int) -> int:
        m = n // a
        return a * m * (m + 1) // 2

    v = {
        "slow": [_src("long s = 0 ;", _loop("i", 1, "<=", "i ++", f"if ( i % {a} == 0 ) s += i ;"), "return s ;")],
        "medium": [_src("long s = 0 ;", _loop("i", a, "<=", f"i += {a}", "s += i ;"), "return s ;")],
        "fast": [_src(f"long m = n / {a} ;", f"return {a} * m * ( m + 1 ) / 2 ;")],
        "wrong": [
            _src("long s = 0 ;", _loop("i", 1, "<", "i ++", f"if ( i % {a} == 0 ) s += i ;"), "return s ;"),
            _src("long s = 0 ;", _loop("i", a, "<", f"i += {a}", "s += i ;"), "return s ;"),
            _src(f"long m = n / {a} ;", f"return {a} * m * ( m - 1 ) / 2 ;"),
        ],
    }
    return v, solve, _mod_cost(a)


def affine_sum(a: int, b: int) -> tuple[Variants, Callable[[int], int], int]:
    """The sum of a*i + b over i in 1..n (added in two steps, as a naive loop might)."""
    body = f"{{ s += {a} * i ; s += {b} ; }}"
    v = {
        "slow": [_src("long s = 0 ;", _loop("i", 1, "<=", "i ++", body), "return s ;")],
        "medium": [_src("long s = 0 ;", _loop("i", 1, "<=", "i ++", "s += i ;"), f"return {a} * s + {b} * n ;")],
        "fast": [_src(f"return {a} * n * ( n + 1 ) / 2 + {b} * n ;")],
        "wrong": [
            _src("long s = 0 ;", _loop("i", 1, "<", "i ++", body), "return s ;"),
            _src("long s = 0 ;", _loop("i", 0, "<=", "i ++", body), "return s ;"),
            _src("long s = 0 ;", _loop("i", 1, "<=", "i ++", "s += i ;"), f"return {a} * s + {b} ;"),
            _src(f"return {a} * n * ( n - 1 ) / 2 + {b} * n ;"),
        ],
    }
    return v, lambda n: a * n * (n + 1) // 2 + b * n, 10


def repeat_add(a: int) -> tuple[Variants, Callable[[int], int], int]:
    """i added a times, for each i in 1..n (an inner loop that is a multiplication in disguise)."""
    o = _other(a)
    # the inner loop counts j down to 0 (`j` as the condition) to keep sources under 48 tokens
    inner = f"for ( long j = {a} ; j ; j -- ) s += i ;"
    v = {
        "slow": [_src("long s = 0 ;", _loop("i", 1, "<=", "i ++", inner), "return s ;")],
        "medium": [
            _src("long s = 0 ;", _loop("i", 1, "<=", "i ++", f"s += {a} * i ;"), "return s ;"),
            _src("long s = 0 ;", _loop("i", 1, "<=", "i ++", "s += i ;"), f"return {a} * s ;"),
        ],
        "fast": [_src(f"return {a} * n * ( n + 1 ) / 2 ;")],
        "wrong": [
            _src("long s = 0 ;", _loop("i", 1, "<=", "i ++", f"for ( long j = {o} ; j ; j -- ) s += i ;"),
                 "return s ;"),
            _src("long s = 0 ;", _loop("i", 1, "<", "i ++", f"s += {a} * i ;"), "return s ;"),
            _src(f"return {a} * n * ( n - 1 ) / 2 ;"),
        ],
    }
    return v, lambda n: a * n * (n + 1) // 2, 8 + 5 * a


FAMILIES: dict[str, Family] = {
    "count_mult": count_mult,
    "count_mod": count_mod,
    "sum_mult": sum_mult,
    "affine_sum": affine_sum,
    "repeat_add": repeat_add,
}


def family_params(family: str) -> list[tuple[int, ...]]:
    """Every parameter setting of a family (digits only)."""
    if family in ("count_mult", "sum_mult", "repeat_add"):
        return [(a,) for a in range(2, 10)]
    if family == "count_mod":
        return [(a, b) for a in range(3, 10) for b in range(1, a)]
    if family == "affine_sum":
        # a power of two makes `a * i` a shift at -O0, too cheap for the medium rewrite to be
        # clearly faster (1.3x); with these the slow loop takes 1.65x the medium's instructions
        return [(a, b) for a in (3, 5, 6, 7, 9) for b in range(1, 10)]
    raise KeyError(f"unknown code family {family!r}; choose one of {', '.join(FAMILIES)}")


def _bench_n(per_n: int) -> int:
    return BENCH_LOOP_INSTRUCTIONS // per_n


def _cases(params: tuple[int, ...], solve: Callable[[int], int]):
    a = params[0]
    b = params[1] if len(params) > 1 else 0
    # One run per test group (the harness reads up to 64 inputs): every process start costs a
    # sandbox set-up, so inputs are batched into one visible and one hidden group.
    visible = [(7, 10, 25, 36, 100)]
    # every remainder mod a (an off-by-one bound or a wrong residue shows on one of them)
    edge = sorted({0, 1, 2, a - 1, a, a + 1, 10 * a + b, 60, *(5 * a + r for r in range(a))})
    hidden = [(*edge, 13, 97, 7919, 65537, 99991, 100000, 200000)]

    def with_answers(groups: list[tuple[int, ...]]):
        return tuple((g, tuple(solve(n) for n in g)) for g in groups)

    return with_answers(visible), with_answers(hidden)


def make_problem(family: str, params: tuple[int, ...]) -> CodeProblem:
    variants, solve, per_n = FAMILIES[family](*params)
    tests, hidden = _cases(params, solve)
    pid = family + "_" + "_".join(f"{k}{v}" for k, v in zip("ab", params))
    return CodeProblem(
        problem_id=pid,
        family=family,
        params=tuple(params),
        reference=variants["slow"][0],
        variants={k: tuple(v) for k, v in variants.items()},
        tests=tests,
        hidden_tests=hidden,
        bench_n=_bench_n(per_n),
    )


def all_code_problems() -> list[CodeProblem]:
    """Every problem of every family (109), in a fixed order."""
    return [make_problem(fam, p) for fam in FAMILIES for p in family_params(fam)]


def code_speedup_splits(
    seed: int = 0, n_count_mod: tuple[int, int] = (12, 8), n_affine: tuple[int, int] = (14, 8)
) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """(train, test) problems, fixed by `seed`.

    Train: every setting of the one-parameter families (count_mult, sum_mult, repeat_add: 8 each)
    plus `n_count_mod[0]` count_mod and `n_affine[0]` affine_sum settings drawn by `seed`; test:
    `n_count_mod[1]` and `n_affine[1]` further settings of the two-parameter families, never seen
    in training (the one-parameter families have no settings left to hold out).
    """
    rng = random.Random(seed)
    train: list[CodeProblem] = []
    test: list[CodeProblem] = []
    for family in FAMILIES:
        params = family_params(family)
        if family in ("count_mod", "affine_sum"):
            n_tr, n_te = n_count_mod if family == "count_mod" else n_affine
            if n_tr + n_te > len(params):
                raise ValueError(f"{family} has only {len(params)} settings, asked for {n_tr} + {n_te}")
            picked = rng.sample(params, n_tr + n_te)
            train += [make_problem(family, p) for p in sorted(picked[:n_tr])]
            test += [make_problem(family, p) for p in sorted(picked[n_tr:])]
        else:
            train += [make_problem(family, p) for p in params]
    return train, test


# Weights of the variant kinds in the SFT data. A model that learns this mix answers correctly
# ~2/3 of the time, mostly with a copy of the slow function, and is wrong (near misses: an
# off-by-one bound, a wrong constant) the rest: GRPO has both correctness and speed to improve.
DEFAULT_MIX: dict[str, float] = {"slow": 0.36, "medium": 0.2, "fast": 0.12, "wrong": 0.32}


def sft_examples(
    problems: Iterable[CodeProblem],
    seed: int = 0,
    per_problem: int = 40,
    mix: dict[str, float] | None = None,
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs for the SFT warm-up: `per_problem` per problem, split between
    the variant kinds by `mix` (largest remainder), each kind's sources drawn in turn from a
    seeded shuffle. The result is in problem order; `sft_train` shuffles it."""
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(mix) - set(KINDS)
    if unknown or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"mix must give non-negative weights to kinds among {KINDS}, got {mix}")
    total = sum(mix.values())
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for problem in problems:
        kinds = [k for k in KINDS if mix.get(k, 0) > 0 and problem.variants.get(k)]
        weight = sum(mix[k] for k in kinds) or total
        exact = {k: per_problem * mix[k] / weight for k in kinds}
        counts = {k: int(exact[k]) for k in kinds}
        by_remainder = sorted(kinds, key=lambda k: (counts[k] - exact[k], KINDS.index(k)))
        for k in by_remainder[: per_problem - sum(counts.values())]:
            counts[k] += 1
        for k in kinds:
            sources = list(problem.variants[k])
            rng.shuffle(sources)
            out += [(problem.prompt, sources[i % len(sources)]) for i in range(counts[k])]
    return out


def code_corpus(problems: Iterable[CodeProblem] | None = None) -> list[str]:
    """Texts holding every word the task uses (prompts and all variants): the tokenizer corpus."""
    problems = all_code_problems() if problems is None else problems
    return [text for p in problems for text in (p.prompt, *(s for k in KINDS for s in p.variants[k]))]


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl: one row per problem (`CodeProblem.to_row`)."""
    train, test = code_speedup_splits(seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", (p.to_row() for p in problems))
            for name, problems in (("train", train), ("test", test))]


# ---- the tiny code model ----------------------------------------------------------------------

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


def kinds_stop_fn(kinds: Callable[[], dict[str, float]], probes: list[dict[str, float]], recipe: Recipe,
                  target_correct: float, target_faster: float) -> Callable[[int], bool]:
    """The code tasks' warm-up stop test (`stop_fn(done_steps)`): every `recipe.probe_every`
    steps it records `kinds()` (the chance of each variant kind, and `correct`) in `probes` and
    stops once `correct` reaches `target_correct` and `medium` and `fast` each `target_faster`
    (target_correct 0 or above 1: never)."""

    def reached(done: int) -> bool:
        if not 0 < target_correct <= 1 or done % recipe.probe_every:
            return False
        probs = kinds()
        probes.append({"step": done, **{k: round(v, 4) for k, v in probs.items()}})
        if recipe.log_every:
            print(f"probe step {done}: " + " ".join(f"{k} {v:.3f}" for k, v in probs.items()), flush=True)
        return probs["correct"] >= target_correct and min(probs["medium"], probs["fast"]) >= target_faster

    return reached


RECIPE = Recipe(probe_every=25, batch_size=32)  # size and warm-up of the tiny code model (examples.tiny.Recipe)


def build(
    out_dir: str = DEFAULT_DIR,
    seed: int = 0,
    *,
    per_problem: int = 40,
    mix: dict[str, float] | None = None,
    target_correct: float = 0.5,
    target_faster: float = 0.07,
    n_samples: int = 8,
    **recipe: Any,
) -> dict[str, Any]:
    """Write the data, train tokenizer and model, warm up, evaluate, save; returns the summary.

    The warm-up runs at most `steps` SFT steps on `per_problem` (prompt, variant) pairs per
    training problem mixed by `mix` (kind -> weight, default `DEFAULT_MIX`) and stops
    once the teacher-forced chance that a T=1.0 sample is an exactly correct variant, averaged
    over the training problems and checked every `probe_every` steps, reaches `target_correct`
    and the chances that it is a medium and a fast variant each reach `target_faster`
    (target_correct 0 or above 1: never stop early). Stopping on the probe rather than a step
    count keeps the result similar across seeds, which learn to copy the prompt at different
    steps. The final model is then sampled `n_samples` times per problem at T=1.0 to report the
    share of each variant kind (0 skips it). `recipe`: any field of `Recipe` (steps, batch_size,
    lr, probe_every, hidden, layers, heads, threads, log_every).
    """
    with TaskBuild(out_dir, seed, RECIPE, recipe) as task:
        train, test = code_speedup_splits(seed)
        write_data(out_dir, seed)
        # The vocabulary covers every problem of every family, so it does not depend on the split.
        tokenizer = word_tokenizer(code_corpus(all_code_problems()), model_max_length=MAX_POSITIONS)
        model = task.model(tokenizer, max_positions=MAX_POSITIONS)
        examples = sft_examples(train, seed=seed, per_problem=per_problem, mix=mix)
        probes: list[dict[str, float]] = []
        reached_target = kinds_stop_fn(lambda: kind_probabilities(model, tokenizer, train), probes, task.recipe,
                                       target_correct, target_faster)
        _, sft_summary = warm_up(model, tokenizer, [p for p, _ in examples], [c for _, c in examples], task.recipe,
                                 seed, stop_fn=reached_target)
        figures: dict[str, Any] = {
            "families": dict(Counter(p.family for p in train + test)),
            "n_sft_examples": len(examples),
            "max_positions": MAX_POSITIONS,
            "sft_target_correct": target_correct,
            "sft_target_faster": target_faster,
            "sft_probes": probes,
            "expected_kinds_train": kind_probabilities(model, tokenizer, train),
            "expected_kinds_test": kind_probabilities(model, tokenizer, test),
            **sft_summary,
        }
        if n_samples:
            t_eval = time.perf_counter()
            for name, problems, offset in (("train", train, 1), ("test", test, 2)):
                res = sampled_kinds(model, tokenizer, problems, n=n_samples, seed=seed + offset)
                figures[f"sampled_{name}"] = {k: v for k, v in res.items() if k != "per_problem_correct"}
            figures["eval_s"] = round(time.perf_counter() - t_eval, 2)
        return task.finish(model, tokenizer, train, test, figures)


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
