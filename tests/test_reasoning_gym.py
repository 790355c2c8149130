"""reasoning-gym's datasets as a task (reward/reasoning_gym.py): the rows are its own entries,
mixed as its CompositeDataset mixes them; the reward is each dataset's own score_answer; bad
dataset names and config keys are refused before Ray starts; a scorer that raises, hangs or
returns garbage costs only its sample; every dataset scores its own gold answers as reasoning-gym
does (its entries kept exactly, tuples included); an answer extraction under which a perfect answer
cannot score, and a config reasoning-gym cannot generate from, are refused before Ray naming the
dataset and the fix."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest

rg = pytest.importorskip("reasoning_gym")  # the test extra installs it (pyproject.toml)

from reasoning_gym import composite, factory  # noqa: E402
from reasoning_gym.utils import extract_answer  # noqa: E402

from reward import reasoning_gym as ours  # noqa: E402
from reward.scorer import RewardScorer  # noqa: E402
from rl.data.types import Sample  # noqa: E402

SPECS = [
    {"name": "basic_arithmetic", "weight": 2, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}},
    {"name": "chain_sum", "weight": 1, "config": {"min_terms": 2, "max_terms": 3, "max_digits": 1}},
    {"name": "leg_counting", "weight": 1, "config": {"min_animals": 1, "max_animals": 2}},
]


@pytest.mark.parametrize("specs, needle", [
    ([], "task.datasets is empty"),
    ([{"name": "basic_arithmatic"}], "task.datasets[0].name='basic_arithmatic' is not a reasoning-gym dataset "
                                     "(e.g. basic_arithmetic"),
    ([{"name": "chain_sum", "config": {"min_term": 2}}], "task.datasets[0].config has min_term, which chain_sum's "
                                                         "config (ChainSumConfig) lacks; its keys: allow_negation"),
    ([{"name": "chain_sum", "weight": 0}], "task.datasets[0].weight=0: must be a number above 0"),
    ([{"name": "chain_sum", "weight": True}], "task.datasets[0].weight=True"),
    ([{"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}],
     "chain_sum refuses it (AssertionError: max_terms must be >= min_terms)"),
    ([{"name": "chain_sum"}, {"name": "chain_sum"}], "task.datasets[1].name='chain_sum' is named twice"),
    ([{"name": "chain_sum", "weights": 2}], "task.datasets[0] has the key(s) weights; a dataset entry takes name, "
                                            "weight, config"),
    (["chain_sum"], "task.datasets[0]='chain_sum': an entry is a mapping {name: ..., weight: ..., config: {...}}"),
    ([{"name": "chain_sum", "config": 3}], "task.datasets[0].config=3: must be a mapping of chain_sum's config keys"),
])
def test_bad_dataset_entries_are_named(specs: list[dict], needle: str) -> None:
    errors = ours.spec_errors(specs)
    assert any(needle in e for e in errors), errors


def test_good_entries_pass() -> None:
    assert ours.spec_errors(SPECS) == []


def test_rows_are_reasoning_gyms_own_composite_entries() -> None:
    """The held-out rows are the composite's first entries, exactly as reasoning-gym draws them
    (its weights pick the dataset of each index); training rows follow, no held-out question in them."""
    train, held = ours.splits(SPECS, 120, 30, seed=7)
    theirs = composite.CompositeDataset(composite.CompositeConfig(size=150, seed=7, datasets=[
        composite.DatasetSpec(s["name"], s["weight"], s["config"]) for s in SPECS]))
    assert [ours.decode_entry(r[ours.ENTRY]) for r in held] == [theirs[i] for i in range(30)]  # tuples kept
    assert [r["prompt"] for r in held] == [theirs[i]["question"] for i in range(30)]
    assert [r["answer"] for r in held] == [str(theirs[i]["answer"]) for i in range(30)]
    expected_train = [theirs[i] for i in range(30, 150) if theirs[i]["question"] not in {r["prompt"] for r in held}]
    assert [r["prompt"] for r in train] == [e["question"] for e in expected_train]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    counts = {s["name"]: sum(r["dataset"] == s["name"] for r in train + held) for s in SPECS}
    assert all(c > 0 for c in counts.values()), counts
    assert counts["basic_arithmetic"] > counts["chain_sum"]  # weight 2 against 1
    assert ours.splits(SPECS, 120, 30, seed=7) == (train, held)  # seeded
    assert ours.splits(SPECS, 120, 30, seed=8)[1] != held


def test_rows_written_once_per_setting(tmp_path) -> None:
    train_path, held_path = ours.write_splits(SPECS, 40, 10, 3, root=str(tmp_path))
    rows = [json.loads(line) for line in open(train_path)]
    assert rows == ours.splits(SPECS, 40, 10, 3)[0]
    assert len([json.loads(line) for line in open(held_path)]) == 10
    before = (tmp_path / train_path).stat().st_mtime_ns
    assert ours.write_splits(SPECS, 40, 10, 3, root=str(tmp_path)) == (train_path, held_path)
    assert (tmp_path / train_path).stat().st_mtime_ns == before  # not written again
    assert ours.write_splits(SPECS, 40, 10, 4, root=str(tmp_path))[0] != train_path  # another seed, other rows
    assert ours.write_splits(SPECS, 40, 0, 3, root=str(tmp_path))[1] is None


def test_score_is_each_datasets_own_score_answer() -> None:
    """Our reward for a completion equals what reasoning-gym computes for it: its extract_answer,
    then the entry's dataset's score_answer (partial credit included)."""
    _, held = ours.splits(SPECS, 10, 40, seed=1)
    completions = []
    for i, r in enumerate(held):
        completions.append([f"<answer>{r['answer']}</answer>", f"so <answer> {r['answer']}0 </answer>",
                            "no tags at all", f"<answer>1</answer> then <answer>{r['answer']}</answer>"][i % 4])
    got = ours.score([r["prompt"] for r in held], completions, [r[ours.ENTRY] for r in held], datasets=SPECS)
    mix = composite.CompositeDataset(composite.CompositeConfig(size=50, seed=1, datasets=[
        composite.DatasetSpec(s["name"], s["weight"], s["config"]) for s in SPECS]))
    expected = [mix.score_answer(extract_answer(c), mix[i]) for i, c in enumerate(completions)]
    assert got == pytest.approx(expected)
    assert got[0] == 1.0 and got[2] == 0.0 and got[3] == 1.0
    assert len(set(got)) >= 3  # right, wrong and partial credit all occur
    # extract_answer=final_answer: the last number (for a model that does not write the tags)
    plain = [f"It is {r['answer']}." if i % 2 else "It is 0.5, no: 1000" for i, r in enumerate(held)]
    got = ours.score([], plain, [r[ours.ENTRY] for r in held], datasets=SPECS, extract_answer="final_answer")
    from rl.data.answers import final_answer
    assert got == pytest.approx([mix.score_answer(final_answer(c), mix[i]) for i, c in enumerate(plain)])
    assert got[1::2] == [1.0] * len(got[1::2]) and 0.0 in got[0::2]
    with pytest.raises(ValueError, match="extract_answer='xml': choose one of tags, final_answer"):
        ours.score([], plain, [r[ours.ENTRY] for r in held], datasets=SPECS, extract_answer="xml")


def test_the_instruction_follows_each_question() -> None:
    train, held = ours.splits(SPECS, 5, 5, seed=2, instruction="Reply with just the number.")
    bare = ours.splits(SPECS, 5, 5, seed=2)
    assert [r["prompt"] for r in held] == [f"{r['prompt']} Reply with just the number." for r in bare[1]]
    assert [json.loads(r[ours.ENTRY]) for r in held] == [json.loads(r[ours.ENTRY]) for r in bare[1]]


@dataclasses.dataclass
class _BrokenConfig:
    seed: int | None = None
    size: int = 8

    def validate(self) -> None:
        pass


class _Broken(rg.dataset.ProceduralDataset):
    """A dataset whose score_answer raises, hangs or returns garbage for some entries."""

    def __init__(self, config: _BrokenConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return {"question": f"q{idx}", "answer": str(idx), "metadata": {"source_dataset": "hostile_rg", "idx": idx}}

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        kind = entry["metadata"]["idx"] % 4
        if kind == 1:
            raise RuntimeError("scorer bug")
        if kind == 2:
            time.sleep(30)
        if kind == 3:
            return "high"  # type: ignore[return-value]
        return float(answer == entry["answer"])


def test_a_broken_scorer_costs_only_its_sample(monkeypatch) -> None:
    """Through the real RewardScorer: the entry whose scorer raises, hangs (past the per-sample
    deadline) or returns a non-number is an error sample; the others are scored."""
    monkeypatch.setitem(factory.DATASETS, "hostile_rg", (_Broken, _BrokenConfig))
    specs = [{"name": "hostile_rg", "weight": 1, "config": {}}]
    entries = [_Broken(_BrokenConfig())[i] for i in range(8)]
    samples = [Sample(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], finish_reason="stop", policy_version=0,
                      prompt_text=e["question"], completion_text=f"<answer>{e['answer']}</answer>", group_id=i,
                      sample_index=0, metadata={ours.ENTRY: json.dumps(e)}) for i, e in enumerate(entries)]
    scorer = RewardScorer([{"fn": "reward.reasoning_gym:score", "weight": 1.0,
                            "kwargs": {"datasets": specs, "sample_timeout_s": 0.5}}], timeout_s=20)
    t0 = time.perf_counter()
    scored = scorer.score(samples)
    assert time.perf_counter() - t0 < 5  # two hangs of 0.5 s each, not 30 s
    for i, s in enumerate(scored):
        kind = i % 4
        if kind == 0:
            assert s.reward == 1.0 and s.error is None
        else:
            assert s.reward is None
            assert {1: "RuntimeError: scorer bug", 2: "no verdict within 0.5 s",
                    3: "could not convert string to float"}[kind] in s.error, s.error


@pytest.mark.slow
@pytest.mark.full  # the real model
def test_two_steps_on_smollm2_score_as_reasoning_gym_does(smollm2, tmp_path, monkeypatch) -> None:
    """task=reasoning_gym on SmolLM2 (fp32, 2 steps of 2 prompts x 4 samples): the rows were
    written from task.datasets before the run, every logged sample's reward is reasoning-gym's own
    verdict on its completion, the held-out figures come per dataset, learner and engine agree
    on the sampled tokens' log-probs after each sync."""
    from omegaconf import OmegaConf

    from launch.checks import check_inputs
    from rl.data.answers import final_answer
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config

    monkeypatch.chdir(tmp_path)  # the rows go to ./artifacts/reasoning_gym/
    cfg = compose_config(["model=smollm2", "task=reasoning_gym", f"model.path={smollm2}", "model.dtype=float32",
                          "task.size=40", "task.eval_size=6", "task.prompts_per_step=2", "rollout.n=4",
                          "rollout.max_new_tokens=24", "rollout.enforce_eager=true", "eval.every_steps=2", "run.log_samples_per_step=8",
                          "eval.max_rows=6", "run.steps=2", "run.save_every=0", "run.save_final_model=false",
                          "run.progress=false", f"run.dir={tmp_path / 'run'}"])
    inputs, _ = check_inputs(cfg, [])  # as the command line does: the rows are written here
    train(cfg, inputs)
    [train_file] = cfg.task.train_files
    assert train_file.startswith(str(tmp_path / "artifacts" / "reasoning_gym"))
    mix = composite.CompositeDataset(composite.CompositeConfig(size=46, seed=0, datasets=[
        composite.DatasetSpec(s["name"], s["weight"], s["config"]) for s in OmegaConf.to_container(cfg.task.datasets)]))
    with open(tmp_path / "run" / "samples.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) >= 8
    for s in logged:
        entry = ours.decode_entry(s["data"][ours.ENTRY])
        expected = mix.score_answer(final_answer(s["completion_text"]), entry)  # the config's extract_answer
        assert s["error"] is None and s["reward"] == pytest.approx(expected), s
    metrics = read_metrics(str(tmp_path / "run"))
    names = {s["name"] for s in cfg.task.datasets}
    evals = [m for m in metrics if "eval/greedy_pass_frac" in m]
    assert evals and {k.rpartition("/")[2] for k in evals[0] if k.startswith("eval/greedy_pass_frac/")} <= names
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics if "sync/logprob_abs_diff" in m)


def _same(a: Any, b: Any) -> bool:
    """Equal with the same container types all the way down (a tuple is not a list here); a numpy
    scalar (codeio's floats, knights_knaves' strings) is the Python value it equals."""
    a, b = (x.item() if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0 else x for x in (a, b))
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


GOLD_ENTRIES = 2  # per dataset: enough to catch a lossy row, cheap enough for the default lane


@pytest.mark.slow  # ~5-15 s: two entries of each of ~105 datasets
def test_every_dataset_scores_its_gold_answers_as_reasoning_gym_does() -> None:
    """For every dataset of the installed reasoning-gym: its rows keep the entry exactly (tuples,
    int keys and all), and our reward on a completion giving the entry's own answer equals the
    dataset's score_answer of that answer on the original entry. (Rows kept as plain JSON lost
    arc_agi's and rearc's tuples: a correct answer scored 0.05 there.)"""
    names = sorted(n for n in factory.DATASETS if n != "composite")  # composite is the mixer, not a dataset
    assert len(names) >= 100
    wrong, agreed = [], 0
    for name in names:
        specs = [{"name": name, "weight": 1}]
        rows, _ = ours.splits(specs, GOLD_ENTRIES, 0, seed=5)
        mix = composite.CompositeDataset(composite.CompositeConfig(size=GOLD_ENTRIES, seed=5, datasets=[
            composite.DatasetSpec(name, 1.0, {})]))
        originals = [mix[i] for i in range(GOLD_ENTRIES)]
        for r, entry in zip(rows, originals, strict=True):
            assert _same(ours.decode_entry(r[ours.ENTRY]), entry), (name, r[ours.ENTRY][:300])
        completions = [f"<answer>{e['answer']}</answer>" if e["answer"] is not None else "no answer here"
                       for e in originals]  # rubiks_cube, rush_hour: no gold answer (played out)
        got = ours.score([], completions, [r[ours.ENTRY] for r in rows], datasets=specs)
        theirs = [mix.score_answer(extract_answer(c), e) for c, e in zip(completions, originals)]
        for i, (g, t) in enumerate(zip(got, theirs)):
            if isinstance(g, BaseException) or g != pytest.approx(t):
                wrong.append((name, i, g, t))
            else:
                agreed += 1
    assert not wrong, wrong
    assert agreed == len(names) * GOLD_ENTRIES


def test_entries_keep_tuples_sets_and_keys() -> None:
    import numpy as np

    value = {"question": "q", "answer": "a", "metadata": {
        "output": ((1, 2), (3, 4)), "grid": [(0, 1), [2, (3,)]], "colors": {0: "red", 1: "blue"},
        "edges": {(0, 1): 2.5}, "seen": {1, 2}, "frozen": frozenset({"x"}), "names": [np.str_("Ann")],
        "n": np.int64(7), "looks_tagged": {"__tuple__": [1, 2]}, "empty": (), "none": None, "flag": True}}
    text = ours.encode_entry(value)
    json.loads(text)  # JSON still
    back = ours.decode_entry(text)
    assert _same(back, value), back
    assert type(back["metadata"]["n"]) is int and back["metadata"]["looks_tagged"] == {"__tuple__": [1, 2]}
    assert ours.decode_entry(json.dumps({"a": [1, 2]})) == {"a": [1, 2]}  # rows of the old format still read
    from fractions import Fraction

    with pytest.raises(TypeError, match=r"entry\['metadata'\]\['ratio'\] is a fractions.Fraction \('1/3'\)"):
        ours.encode_entry({"metadata": {"ratio": Fraction(1, 3)}})


@dataclasses.dataclass
class _FaultyConfig:
    seed: int | None = None
    size: int = 8
    fail_at: int = 6  # the entry whose generation raises; -1: the constructor raises
    min_depth: int = 1

    def validate(self) -> None:
        pass


class _Faulty(rg.dataset.ProceduralDataset):
    """A dataset reasoning-gym accepts (its validate passes) but cannot always generate from."""

    def __init__(self, config: _FaultyConfig):
        if config.fail_at == -1:
            raise ValueError("no puzzles of that depth")
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if idx == self.config.fail_at:
            raise IndexError("Cannot choose from an empty sequence")
        return {"question": f"f{idx}", "answer": str(idx), "metadata": {"source_dataset": "faulty_rg", "ratio": 0.5}}


def test_a_generation_error_names_the_dataset_and_entry(monkeypatch) -> None:
    """A config the dataset accepts but cannot generate from is a RowsError naming the
    task.datasets entry, its config, the composite index and the fix; a constructor that raises too;
    a value no row can keep names its entry."""
    monkeypatch.setitem(factory.DATASETS, "faulty_rg", (_Faulty, _FaultyConfig))
    specs = [{"name": "chain_sum", "weight": 1}, {"name": "faulty_rg", "weight": 3, "config": {"min_depth": 9}}]
    with pytest.raises(ours.RowsError) as caught:
        ours.splits(specs, 20, 4, seed=0)
    assert str(caught.value) == ("task.datasets[1] faulty_rg (min_depth=9): reasoning-gym could not generate entry 6: "
                                 "IndexError: Cannot choose from an empty sequence; its config asks for entries "
                                 "faulty_rg cannot make: lower min_depth (or drop faulty_rg from task.datasets)")
    specs[1]["config"] = {"min_depth": 9, "fail_at": -1}
    with pytest.raises(ours.RowsError, match=r"task.datasets\[1\] faulty_rg \(min_depth=9, fail_at=-1\): reasoning-gym "
                                             r"could not build the dataset: ValueError: no puzzles of that depth"):
        ours.splits(specs, 20, 4, seed=0)
    # the real package: spell_backward with no word that long
    real = [{"name": "spell_backward", "weight": 1, "config": {"min_word_len": 25, "max_word_len": 30}}]
    assert ours.spec_errors(real) == []  # reasoning-gym accepts the config...
    with pytest.raises(ours.RowsError, match=r"^task.datasets\[0\] spell_backward \(min_word_len=25, "
                                             r"max_word_len=30\): reasoning-gym could not generate entry 0: "
                                             r"IndexError: .*; .*lower min_word_len or raise max_word_len"):
        ours.splits(real, 5, 0, seed=0)


def _refused(tiny_dir: str, tmp_path, monkeypatch, capsys, *overrides: str) -> str:
    """The command line's checks on these overrides: refused (exit 2) before Ray, with one error line."""
    import ray

    from launch.checks import check_inputs
    from launch.cli import INPUT_ERRORS, fail
    from rl.config.compose import compose

    def no_ray(*args, **kwargs):
        raise AssertionError("the checks started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.chdir(tmp_path)
    args = [f"model.path={tiny_dir}/model", f"run.dir={tmp_path}/run", "run.progress=false", *overrides]
    with pytest.raises(SystemExit) as exited:
        try:
            check_inputs(compose("train", args), args)
        except INPUT_ERRORS as err:
            fail(err)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "artifacts").exists()  # refused before any row is written
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    return line


TEXT = "task.datasets=[{name: chain_sum, config: {max_digits: 1}}, {name: spell_backward}, {name: word_sorting}]"
TAGS = ["reward.functions.0.kwargs.extract_answer=tags", "task.instruction=''",
        "task.system_prompt='Reply between <answer> and </answer>.'"]
REFUSED = {  # task=reasoning_gym (the last number, 'Reply with just the number.') and ...: the error line's parts
    "text_datasets_with_the_last_number": (
        [TEXT],
        ["task.datasets[1] spell_backward: reward.functions[0].kwargs.extract_answer=final_answer reads a "
         "completion's last number", "scores 0 where reasoning-gym gives it 1",
         "task.instruction='Reply with just the number.' asks spell_backward's questions for a number",
         "set reward.functions[0].kwargs.extract_answer=tags", "task=reasoning_gym_tags",
         "task.datasets[2] word_sorting:"], "chain_sum"),
    "tags_the_prompt_does_not_ask_for": (
        [TEXT, "reward.functions.0.kwargs.extract_answer=tags"],
        ["reward.functions[0].kwargs.extract_answer=tags reads the answer between <answer> and </answer>, but neither "
         "task.instruction ('Reply with just the number.') nor task.system_prompt asks for those tags",
         "set task.system_prompt to reasoning-gym's default prompt"], None),
    "no_gold_answer_with_the_last_number": (
        ["task.datasets=[{name: rubiks_cube}]"],
        ["task.datasets[0] rubiks_cube: reward.functions[0].kwargs.extract_answer=final_answer", "no gold answer"],
        None),
    "a_config_reasoning_gym_cannot_generate_from": (
        ["task.datasets=[{name: spell_backward, config: {min_word_len: 25, max_word_len: 30}}]", *TAGS],
        ["task.datasets[0] spell_backward (min_word_len=25, max_word_len=30): reasoning-gym could not generate "
         "entry 0: IndexError", "lower min_word_len or raise max_word_len"], None),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_extraction_that_cannot_score_is_refused(case, tiny_dir, tmp_path, monkeypatch, capsys) -> None:
    """Through the command line's checks, before Ray and before any row is written: a text dataset
    under the last-number extraction (naming each dataset that cannot score, not the number one),
    tags nothing asks for, a dataset without a gold answer under the last number, and a config
    reasoning-gym accepts but cannot generate from."""
    overrides, needles, absent = REFUSED[case]
    line = _refused(tiny_dir, tmp_path, monkeypatch, capsys, "task=reasoning_gym", *overrides)
    for needle in needles:
        assert needle in line, line
    assert absent is None or absent not in line, line
    print(f"{case}: {line}")


def test_text_datasets_with_tags_score_a_perfect_answer_1(tiny_dir, tmp_path, monkeypatch) -> None:
    """task=reasoning_gym_tags (reasoning-gym's own prompt and tags) passes the checks, and a
    perfect answer between the tags, after any reasoning, scores 1 on every held-out row; the last
    number on the same rows would score 0, which is why task=reasoning_gym refuses them."""
    from omegaconf import OmegaConf

    from launch.checks import write_task_rows
    from rl.config.compose import compose
    from reasoning_gym.utils import SYSTEM_PROMPTS

    monkeypatch.chdir(tmp_path)
    cfg = compose("train", [f"model.path={tiny_dir}/model", "task=reasoning_gym_tags", "task.size=10",
                            "task.eval_size=30"])
    assert cfg.task.system_prompt == SYSTEM_PROMPTS["default"] and cfg.task.instruction == ""
    write_task_rows(cfg)
    with open(cfg.eval.files[0]) as f:
        held = [json.loads(line) for line in f]
    assert {r["dataset"] for r in held} == {"spell_backward", "letter_jumble", "word_sorting"}
    assert all(r["prompt"] == ours.decode_entry(r[ours.ENTRY])["question"] for r in held)  # no number instruction
    specs = OmegaConf.to_container(cfg.task.datasets, resolve=True)  # the reward's kwargs, as the run passes them
    entries = [r[ours.ENTRY] for r in held]
    perfect = [f"Let me think it through.\n<answer>{r['answer']}</answer>" for r in held]
    assert ours.score([], perfect, entries, datasets=specs, extract_answer="tags") == [1.0] * len(held)
    plain = [r["answer"] for r in held]
    last_number = ours.score([], plain, entries, datasets=specs, extract_answer="final_answer")
    assert max(last_number) < 1 and sum(last_number) / len(held) < 0.1, last_number  # (word_sorting: partial credit)
