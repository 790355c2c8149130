"""reasoning-gym's datasets as a task (reward/reasoning_gym.py): the rows are its own entries,
mixed as its CompositeDataset mixes them; the reward is each dataset's own score_answer; bad
dataset names and config keys are refused before Ray starts; a scorer that raises, hangs or
returns garbage costs only its sample."""

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
    assert [json.loads(r[ours.ENTRY]) for r in held] == [json.loads(json.dumps(theirs[i])) for i in range(30)]
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
    from rl.run.run_log import read_metrics
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
        entry = json.loads(s["data"][ours.ENTRY])
        expected = mix.score_answer(final_answer(s["completion_text"]), entry)  # the config's extract_answer
        assert s["error"] is None and s["reward"] == pytest.approx(expected), s
    metrics = read_metrics(str(tmp_path / "run"))
    names = {s["name"] for s in cfg.task.datasets}
    evals = [m for m in metrics if "eval/greedy_pass_frac" in m]
    assert evals and {k.rpartition("/")[2] for k in evals[0] if k.startswith("eval/greedy_pass_frac/")} <= names
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics if "sync/logprob_abs_diff" in m)
