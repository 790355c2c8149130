"""The LLM judge (reward/judge.py, reward=judge): templates and verdicts by hand, a template
naming a column the data lacks refused before Ray starts (naming the field), an unparsable reply
isolated to its own sample, and a real model (the tiny arithmetic one) judging through the reward
service's scorer."""

from __future__ import annotations

import pytest

from reward import judge
from reward.judge import DEFAULT_TEMPLATE, columns_needed, parse_verdict, template_fields
from reward.loader import RewardLoadError
from reward.scorer import RewardScorer
from rl.data.types import Sample


def test_template_fields_and_the_columns_they_need() -> None:
    assert template_fields(DEFAULT_TEMPLATE) == ["prompt", "answer", "completion"]
    assert columns_needed(DEFAULT_TEMPLATE) == ["answer"]
    assert columns_needed("{prompt} -> {completion}") == []
    assert columns_needed("{completion} vs {solution} ({solution})") == ["solution"]
    with pytest.raises(ValueError, match="not a format string"):
        template_fields("{prompt")
    with pytest.raises(ValueError, match="plain names"):
        template_fields("{row.answer}")
    assert columns_needed(DEFAULT_TEMPLATE, verdict="yes_prob") == ["answer"]
    with pytest.raises(ValueError, match="verdict='stars': choose one of yes_no, number, yes_prob"):
        columns_needed(DEFAULT_TEMPLATE, verdict="stars")


@pytest.mark.parametrize("reply,verdict,expected", [
    ("Yes, it is.", "yes_no", 1.0), ("no", "yes_no", 0.0), ("The answer: NO. (yes would be wrong)", "yes_no", 0.0),
    ("Score: 7/10", "number", 0.7), ("12", "number", 1.0), ("-3", "number", 0.0), ("7.5 points", "number", 0.75),
])
def test_verdicts_by_hand(reply, verdict, expected) -> None:
    assert parse_verdict(reply, verdict, max_score=10.0) == pytest.approx(expected)


@pytest.mark.parametrize("reply,verdict", [("maybe", "yes_no"), ("nobody knows", "yes_no"), ("ten", "number")])
def test_a_reply_without_a_verdict_raises_naming_it(reply, verdict) -> None:
    with pytest.raises(ValueError, match=repr(reply)):
        parse_verdict(reply, verdict)


def _sample(i: int, prompt: str, completion: str, **columns) -> Sample:
    return Sample([1], [2], [0.0], "stop", 0, prompt, completion, i, 0, metadata=columns)


def test_a_template_column_the_data_lacks_is_refused_before_ray(tiny_dir) -> None:
    from launch.checks import require_reward_columns
    from rl.config.schema import ConfigError

    spec = {"fn": "reward.judge:score", "kwargs": {"path": f"{tiny_dir}/model", "template": "{prompt} {solution}"}}
    scorer = RewardScorer([spec])
    assert scorer.missing_columns(["answer"]) == {0: ["solution"]}

    class Cfg:  # the fields require_reward_columns reads
        class task:
            prompt_key = "prompt"

        class reward:
            functions = [type("F", (), {"fn": "reward.judge:score"})]

    class Data:
        field, files = "task.train_files", ["rows.jsonl"]

        class table:
            column_names = ["prompt", "answer"]

    with pytest.raises(ConfigError, match=r"reward.functions\[0\].fn=reward.judge:score needs the dataset column\(s\) "
                                          r"solution, which task.train_files=\['rows.jsonl'\] lack"):
        require_reward_columns(Cfg, scorer, Data)
    bad = RewardScorer([{**spec, "kwargs": {**spec["kwargs"], "verdict": "stars"}}])
    with pytest.raises(RewardLoadError, match=r"reward.functions\[0\].kwargs: verdict='stars'"):
        bad.missing_columns(["answer", "solution"])


def test_an_unparsable_reply_fails_its_own_sample_only(monkeypatch) -> None:
    replies = {"q0 a0": "yes", "q1 a1": "hmm, hard to say", "q2 a2": "No."}
    calls = []

    def fake_replies(path, dtype, texts, max_new_tokens, batch_size):  # the model's part, scripted
        calls.append(len(texts))
        return [replies[t] for t in texts]

    monkeypatch.setattr(judge, "_replies_for", fake_replies)
    scorer = RewardScorer([{"fn": "reward.judge:score", "kwargs": {"path": "unused", "template": "{prompt} {completion}"}}])
    scored = scorer.score([_sample(i, f"q{i}", f"a{i}") for i in range(3)])
    assert [s.reward for s in scored] == [1.0, None, 0.0]
    assert "'hmm, hard to say' says neither yes nor no" in scored[1].error
    assert calls[0] == 3  # one batched call first, then the samples one by one


def _word_judge(tmp_path, monkeypatch, words: str):
    """A random 2-layer Llama over a word-level vocabulary (examples/tiny.py), loaded as the judge."""
    from examples.tiny import build_model, word_tokenizer

    tok = word_tokenizer([words])
    model = build_model(tok, seed=3).eval()
    monkeypatch.setattr(judge, "load", lambda path, dtype="float32": (model, tok))
    monkeypatch.setattr(judge, "_replies", {})
    return model, tok


def test_yes_prob_is_the_judges_first_token_odds_of_yes_with_left_padding(tmp_path, monkeypatch) -> None:
    """verdict=yes_prob: P(yes) / (P(yes) + P(no)) over the first reply token, every spelling the
    vocabulary has summed; a batch of texts of different lengths (left padded) gives what each
    text alone gives, computed here from the model's logits by hand."""
    import torch

    model, tok = _word_judge(tmp_path, monkeypatch, "yes Yes no NO is 3 plus 4 7 8 right ? answer")
    ids = judge.answer_token_ids(tok)
    assert ids == {"yes": sorted(tok.convert_tokens_to_ids(["yes", "Yes"])),
                   "no": sorted(tok.convert_tokens_to_ids(["no", "NO"]))}
    texts = ["3 plus 4 is 7 right ?", "answer 8 ?", "3 plus 4 is 8 right ? answer"]
    got = judge.score(texts, [""] * 3, path="unused", template="{prompt}", verdict="yes_prob", batch_size=3)
    for text, p in zip(texts, got):
        enc = tok(text, return_tensors="pt", add_special_tokens=True)
        with torch.no_grad():
            probs = model(**enc).logits[0, -1].float().softmax(-1)
        yes, no = probs[ids["yes"]].sum(), probs[ids["no"]].sum()
        assert p == pytest.approx(float(yes / (yes + no)), abs=1e-5), text
    assert len(set(round(p, 6) for p in got)) == 3 and all(0.0 < p < 1.0 for p in got)


def test_yes_prob_needs_single_token_yes_and_no(tmp_path, monkeypatch) -> None:
    _word_judge(tmp_path, monkeypatch, "yes Yes right ?")
    with pytest.raises(ValueError, match="no single token for 'no'; use verdict=yes_no"):
        judge.score(["right ?"], [""], path="unused", template="{prompt}", verdict="yes_prob")


@pytest.mark.slow
@pytest.mark.full  # a judge model in the scorer: the full lane
def test_a_real_model_judges_through_the_scorer(tiny_dir) -> None:
    """The tiny arithmetic model as a judge with verdict=number: its greedy continuation of
    "12+34=" is a number, read as a score out of max_score=100; the same reply under plain
    transformers gives the same reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = f"{tiny_dir}/model"
    kwargs = {"path": path, "template": "{prompt}", "verdict": "number", "max_score": 100.0, "max_new_tokens": 4}
    scorer = RewardScorer([{"fn": "reward.judge:score", "kwargs": kwargs}], timeout_s=120)
    prompts = ["12+34=", "40+40=", "7+8="]
    scored = scorer.score([_sample(i, p, "") for i, p in enumerate(prompts)])
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    for p, s in zip(prompts, scored):
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert s.error is None and s.reward == pytest.approx(parse_verdict(reply, "number", 100.0)), (p, reply)
