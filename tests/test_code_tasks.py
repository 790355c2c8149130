"""Tests of the built-in code speed-up task and its tiny model (`examples.code_speedup`).

The fast tests compile every variant of every train/test problem with the real gcc, harness and
flags (trusted code: plain subprocesses in a temp dir) and run the visible and hidden tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from examples.code_speedup import (
    COMPILE_FLAGS,
    CORRECT_KINDS,
    DEFAULT_MIX,
    HARNESS,
    KINDS,
    SEPARATOR,
    all_code_problems,
    code_corpus,
    code_speedup_splits,
    sft_examples,
)

ROW_KEYS = {
    "prompt", "problem_id", "family", "language", "reference", "harness", "compile_flags",
    "tests", "hidden_tests", "bench_stdin",
}
SENTINEL = "END_OF_OUTPUT_7f3a"
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture(scope="module")
def splits():
    return code_speedup_splits(seed=0)


def test_problem_rows_have_the_contract_keys(splits) -> None:
    train, test = splits
    assert len({p.problem_id for p in train}) == len(train) >= 30
    assert len(test) >= 8
    assert not {p.problem_id for p in train} & {p.problem_id for p in test}
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert {p.family for p in train} == {"count_mult", "count_mod", "sum_mult", "affine_sum", "repeat_add"}
    assert [p.problem_id for p in code_speedup_splits(seed=0)[0]] == [p.problem_id for p in train]
    assert [p.problem_id for p in code_speedup_splits(seed=1)[0]] != [p.problem_id for p in train]
    for p in train + test:
        row = json.loads(json.dumps(p.to_row()))
        assert set(row) == ROW_KEYS
        assert row["language"] == "c" and row["compile_flags"] == list(COMPILE_FLAGS)
        assert row["prompt"] == f"{row['reference']} {SEPARATOR}"
        assert row["reference"] == p.variants["slow"][0]
        assert int(row["bench_stdin"]) > 10_000 and row["bench_stdin"].endswith("\n")
        for case in row["tests"] + row["hidden_tests"]:
            assert set(case) == {"stdin", "expected_stdout"}
            assert len(case["stdin"].split()) == len(case["expected_stdout"].split()) <= 64
        hidden_inputs = {int(x) for case in row["hidden_tests"] for x in case["stdin"].split()}
        assert {0, 1, 97, 200000} <= hidden_inputs
        # one-digit constants and short sequences, so a tiny word-level model can write them
        words = [w for src in p.variants.values() for s in src for w in s.split()]
        assert all(len(w) == 1 for w in words if w.isdigit())
        assert len(row["prompt"].split()) <= 63
        assert max(len(s.split()) for src in p.variants.values() for s in src) <= 47  # + EOS: 48
        assert len(set(p.variants["wrong"]) & set(p.correct_variants())) == 0


def test_sft_examples_follow_the_mix_and_seed(splits) -> None:
    train, _ = splits
    examples = sft_examples(train, seed=3, per_problem=40)
    assert examples == sft_examples(train, seed=3, per_problem=40)
    assert len(examples) == 40 * len(train)
    by_id = {p.prompt: p for p in train}
    kinds = [by_id[prompt].kind_of(completion) for prompt, completion in examples]
    for kind in KINDS:
        assert kinds.count(kind) / len(kinds) == pytest.approx(DEFAULT_MIX[kind], abs=0.02)
    only_fast = sft_examples(train[:3], per_problem=5, mix={"fast": 1.0})
    assert [by_id[p].kind_of(c) for p, c in only_fast] == ["fast"] * 15
    with pytest.raises(ValueError):
        sft_examples(train, mix={"slow": 1.0, "bogus": 1.0})
    assert train[0].kind_of("  " + train[0].reference.replace(" ", "  ")) == "slow"
    assert train[0].kind_of("long f ( long n ) { return 0 ; }") == "other"


def test_tokenizer_covers_the_corpus_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from examples.tiny import word_tokenizer

    tok = word_tokenizer(code_corpus())
    assert len(tok) < 60
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in code_corpus():
        ids = loaded(text).input_ids
        assert ids[0] == loaded.bos_token_id and loaded.unk_token_id not in ids
        assert len(ids) == len(text.split()) + 1 and loaded.eos_token_id not in ids
        assert loaded.decode(ids, skip_special_tokens=True) == text


# ------------------------------------------------------------------------------- gcc checks

def _run(exe: Path, stdin: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=20, env=env)


def _passes(exe: Path, case: dict[str, str], env: dict[str, str] | None = None) -> bool:
    proc = _run(exe, case["stdin"] + SENTINEL + "\n", env)
    return proc.returncode == 0 and proc.stdout == case["expected_stdout"] + SENTINEL + "\n"


@pytest.fixture(scope="module")
def harness_obj(tmp_path_factory) -> Path:
    """The harness compiled once with the task's flags (linking solution.c to it is what
    `gcc FLAGS -o prog harness.c solution.c` does, in two steps)."""
    d = tmp_path_factory.mktemp("harness")
    (d / "harness.c").write_text(HARNESS)
    subprocess.run(["gcc", *COMPILE_FLAGS, "-c", "-o", str(d / "harness.o"), str(d / "harness.c")], check=True)
    return d / "harness.o"


def _build(harness_obj: Path, src: str, d: Path, name: str) -> Path:
    (d / f"{name}.c").write_text(src + "\n")
    exe = d / name
    proc = subprocess.run(["gcc", *COMPILE_FLAGS, "-o", str(exe), str(harness_obj), str(d / f"{name}.c")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{src}\n{proc.stderr}"
    return exe


@needs_gcc
def test_harness_contract(harness_obj: Path, tmp_path: Path) -> None:
    exe = _build(harness_obj, "long f ( long n ) { return n + 1 ; }", tmp_path, "plus1")
    proc = _run(exe, "1\n-5\n  41 \n" + SENTINEL + "\n")
    assert proc.returncode == 0 and proc.stdout == f"2\n-4\n42\n{SENTINEL}\n"
    assert _run(exe, "1 2 3").returncode == 3  # no sentinel: exit 3, f never called
    assert _run(exe, "1 2 3").stdout == ""
    # the candidate runs only after all input is read: one that exits prints no sentinel
    dies = _build(harness_obj, "void exit ( int ) ; long f ( long n ) { exit ( 0 ) ; return n ; }", tmp_path, "dies")
    assert SENTINEL not in _run(dies, "1\n" + SENTINEL + "\n").stdout


def _all_variants_source(sources: list[str]) -> str:
    """One solution.c holding every variant, each renamed by a macro (its text is untouched), and
    a `f` that runs the one named by $VARIANT: one build per problem instead of one per variant."""
    parts = ["#include <stdlib.h>"]
    for k, src in enumerate(sources):
        parts += [f"#define f variant_{k}", src, "#undef f"]
    cases = " ".join(f"case {k}: return variant_{k}(n);" for k in range(len(sources)))
    parts.append(f"long f(long n) {{ switch (atoi(getenv(\"VARIANT\"))) {{ {cases} }} abort(); }}")
    return "\n".join(parts)


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@needs_gcc
def test_every_variant_compiles_and_is_judged_right(harness_obj: Path, tmp_path: Path) -> None:
    """Slow, medium and fast variants pass every visible and hidden test; wrong ones fail one
    (every parameter setting of every family, not only those in the splits)."""
    problems = all_code_problems()

    def check(p) -> list[str]:
        variants = [(kind, src) for kind in KINDS for src in p.variants[kind]]
        exe = _build(harness_obj, _all_variants_source([src for _, src in variants]), tmp_path, p.problem_id)
        row = p.to_row()
        errors = []
        for k, (kind, src) in enumerate(variants):
            env = {"VARIANT": str(k)}
            if kind in CORRECT_KINDS:
                bad = [c for c in row["tests"] + row["hidden_tests"] if not _passes(exe, c, env)]
                if bad:
                    errors.append(f"{p.problem_id} {kind} fails {bad[0]['stdin']!r}: {src}")
            elif all(_passes(exe, c, env) for c in row["hidden_tests"]):
                errors.append(f"{p.problem_id}: a wrong variant passes every hidden test: {src}")
        return errors

    with ThreadPoolExecutor(max_workers=4) as pool:
        errors = [e for errs in pool.map(check, problems) for e in errs]
    assert not errors, "\n".join(errors[:10])
    assert len(problems) > 100 and sum(len(v) for p in problems for v in p.variants.values()) > 700


@needs_gcc
def test_references_and_rewrites_build_alone(splits, harness_obj: Path, tmp_path: Path) -> None:
    """The plain build (harness + solution.c as the reward does it) for one problem per family."""
    seen: set[str] = set()
    for p in splits[0]:
        if p.family in seen:
            continue
        seen.add(p.family)
        for kind in CORRECT_KINDS:
            exe = _build(harness_obj, p.variants[kind][0], tmp_path, f"{p.problem_id}_{kind}")
            assert all(_passes(exe, c) for c in p.to_row()["tests"] + p.to_row()["hidden_tests"])
    assert len(seen) == 5


@needs_gcc
def test_decoded_token_ids_compile(splits, harness_obj: Path, tmp_path: Path) -> None:
    from examples.tiny import word_tokenizer

    tok = word_tokenizer(code_corpus())
    problem = splits[0][7]
    for kind in ("fast", "medium"):
        ids = tok(problem.variants[kind][0], add_special_tokens=False).input_ids + [tok.eos_token_id]
        text = " ".join(tok.convert_ids_to_tokens(ids[:-1]))
        assert tok.decode(ids, skip_special_tokens=True) == text == problem.variants[kind][0]
        exe = _build(harness_obj, text, tmp_path, f"decoded_{kind}")
        assert all(_passes(exe, c) for c in problem.to_row()["hidden_tests"])


# ------------------------------------------------------------------------------- the tiny model

@pytest.mark.slow
@pytest.mark.full  # the full lane; test_code_e2e runs the task
def test_build_tiny_code_samples_correct_and_fast_programs(tiny_code) -> None:
    """The default build (~1-2 min on one CPU thread): some correct samples, of several speeds."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.code_speedup import sampled_kinds

    out, summary = tiny_code
    tmp_path = Path(out)
    shares = summary["sampled_train"]["shares"]
    assert 0.3 <= shares["correct"] <= 0.85, shares
    assert shares["fast"] > 0.02 and shares["medium"] > 0.02 and shares["slow"] > shares["fast"], shares
    assert summary["sampled_test"]["shares"]["correct"] > 0.2
    assert json.loads((tmp_path / "prepare_summary.json").read_text()) == summary

    ds = load_dataset("json", data_files={"train": str(tmp_path / "data" / "train.jsonl"),
                                          "test": str(tmp_path / "data" / "test.jsonl")})
    assert set(ds["train"].column_names) == ROW_KEYS
    train, test = code_speedup_splits(seed=0)
    assert ds["train"].num_rows == len(train) and ds["test"].num_rows == len(test)
    assert ds["train"][0] == json.loads(json.dumps(train[0].to_row()))

    model_dir = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.head_dim == 32 and model.config.max_position_embeddings >= 256
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    again = sampled_kinds(model, tok, train, n=4, seed=11)["shares"]
    assert again["correct"] > 0.2 and again["fast"] + again["medium"] > 0
