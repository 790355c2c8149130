"""Evaluation figures people report (rl/run/evaluate.py): pass@k for more k, avg@n and maj@k with
the answer that reward.builtin:math_answer checks, by hand; eval.k beyond eval.n refused."""

from __future__ import annotations

import pytest

from rl.data.types import Sample, ScoredSample
from rl.run.evaluate import answer_extractor, eval_metrics, majority_passes


def _scored(group: int, index: int, text: str, reward: float) -> ScoredSample:
    return ScoredSample(Sample([1], [2], [0.0], "stop", 0, "p", text, group, index), reward)


def test_majority_vote_by_hand() -> None:
    assert majority_passes(["4", "5", "4"], [True, False, True])
    assert not majority_passes(["5", "4", "5"], [False, True, False])
    assert majority_passes(["4", "5"], [True, False])  # a tie: the answer seen first
    assert not majority_passes([None, None], [False, False])  # nobody answered: wrong
    assert majority_passes([None, None, "4"], [False, False, True])  # no answer does not vote


def test_pass_avg_and_maj_at_k_over_rows() -> None:
    # row 0 (answer 4): the samples say 4, 5, 4, 5 -> c = 2 of 4; row 1 (answer 7): 1, 1, 7, x
    texts = {0: ["so 4", "it is 5", "\\boxed{4}", "5"], 1: ["1", "1", "7", "no idea"]}
    right = {0: "4", 1: "7"}
    final = answer_extractor("final_answer")
    sampled = [_scored(g, i, t, float(final(t) == right[g])) for g, row in texts.items() for i, t in enumerate(row)]
    m = eval_metrics([], list(reversed(sampled)), n=4, threshold=1.0, ks=[2], answer=final)  # any order
    # pass@1 = c/n per row: (2/4 + 1/4) / 2; pass@2 = 1 - C(n-c, 2)/C(4, 2): row 0 1 - 1/6, row 1 1 - 3/6
    assert m["eval/pass_at_1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["eval/pass_at_2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert m["eval/pass_at_4"] == pytest.approx(1.0)
    assert m["eval/avg_at_4"] == pytest.approx(3 / 8)
    # maj@1: each row's first sample (4 right, 1 wrong); maj@2: [4, 5] -> 4 (first of a tie), [1, 1] -> 1;
    # maj@4: row 0 tie 4/5 -> 4 right; row 1: 1 twice -> wrong
    assert (m["eval/maj_at_1"], m["eval/maj_at_2"], m["eval/maj_at_4"]) == (0.5, 0.5, 0.5)
    assert "eval/maj_at_1" not in eval_metrics([], sampled, n=4, threshold=1.0)  # no extractor: no maj@k


def test_eval_k_beyond_eval_n_is_refused_naming_both(make_config) -> None:
    from rl.config.schema import ConfigError
    from rl.config.validation import validate

    with pytest.raises(ConfigError, match=r"eval.k=\[2, 8\]: pass@8 and maj@8 need 8 sampled completions per row, "
                                          r"and eval.n=4 samples 4: set eval.n >= 8"):
        validate(make_config("eval.n=4", "eval.k=[2,8]"))
    with pytest.raises(ConfigError, match="eval.answer='majority': choose one of"):
        validate(make_config("eval.answer=majority"))


def test_greedy_figures_per_group_by_hand() -> None:
    """eval.group_by: the greedy figures over the rows of each value of the column too."""
    rows = [("chain_sum", 1.0), ("chain_sum", 0.0), ("leg_counting", 0.5), ("basic_arithmetic", 1.0),
            ("leg_counting", 1.0), (None, 0.0)]
    greedy = [ScoredSample(Sample([1], [2], [0.0], "stop", 0, "p", "t", g, 0, {"dataset": d}), r)
              for g, (d, r) in enumerate(rows)]
    greedy.append(ScoredSample(Sample([1], [2], [0.0], "stop", 0, "p", "t", 9, 0, {"dataset": "chain_sum"}), None,
                               error="reward raised"))  # a failed reward: counted, never passing
    m = eval_metrics(greedy, [], n=0, threshold=1.0, group_by="dataset")
    assert m["eval/greedy_pass_frac/chain_sum"] == pytest.approx(1 / 3)
    assert m["eval/greedy_mean_reward/chain_sum"] == pytest.approx(1 / 3)
    assert m["eval/greedy_pass_frac/leg_counting"] == 0.5
    assert m["eval/greedy_mean_reward/leg_counting"] == 0.75
    assert m["eval/greedy_pass_frac/basic_arithmetic"] == 1.0
    assert m["eval/greedy_pass_frac/None"] == 0.0  # a row without the column: its own group
    assert m["eval/greedy_pass_frac"] == pytest.approx(3 / 7)
    assert not any("/" in k.removeprefix("eval/") for k in eval_metrics(greedy, [], n=0, threshold=1.0))
