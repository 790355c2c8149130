"""The math task for an instruct model: its splits, and the math-verify reward behind it."""

from __future__ import annotations

from collections import Counter

import pytest

from examples.math_chat import INSTRUCTION, MIX, math_splits
from reward.builtin import final_answer, last_boxed, math_answer, math_format


@pytest.mark.parametrize("text, found", [
    ("So 13 + 14 equals 27.", "27"),                      # the last number, not the question's
    ("13 + 14 = 26, no wait, 27", "27"),
    ("The total is 1,234 coins", "1234"),                 # thousands separator dropped
    ("It is -5 degrees", "-5"),
    ("half: 1/2", "1/2"),
    (r"\boxed{\frac{1}{2}} and then 7", r"\frac{1}{2}"),  # a boxed answer wins over a later number
    (r"first \boxed{3}, finally \boxed{ 4 }", "4"),      # the last box, stripped
    (r"\boxed{} so 9", "9"),                              # an empty box falls back to the number
    ("no number here", None),
])
def test_final_answer_is_the_last_box_else_the_last_number(text, found):
    assert final_answer(text) == found


def test_last_boxed_balances_braces():
    assert last_boxed(r"x \boxed{\frac{1}{2}} y") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None


def test_math_answer_compares_symbolically_and_leaves_rows_without_an_answer_unscored():
    completions = ["27", r"The answer is \boxed{0.5}", "13 + 14 = 26", "I do not know", "1/2", "anything"]
    answers = ["27", "1/2", "27", "3", "0.5", None]
    assert math_answer([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, None]


def test_math_format_pays_a_stopped_completion_that_ends_with_its_answer():
    completions = ["27", "It is 27.", r"So \boxed{27}", "27 apples", "27"]
    reasons = ["stop", "stop", "stop", "stop", "length"]
    assert math_format([""] * 5, completions, finish_reasons=reasons) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_splits_are_disjoint_in_the_level_mix_and_state_the_answer_format():
    train, test = math_splits(2000, 200, seed=0)
    assert len(train) == 2000 and len(test) == 200
    test_prompts = [r["prompt"] for r in test]
    assert len(set(test_prompts)) == 200  # distinct held-out questions
    assert not set(test_prompts) & {r["prompt"] for r in train}  # none seen in training
    for rows, n in ((train, 2000), (test, 200)):
        assert Counter(r["level"] for r in rows) == {level: round(n * share) for level, share in MIX.items()}
        assert all(r["prompt"].endswith(INSTRUCTION) and r["answer"].lstrip("-").isdigit() for r in rows)
    assert math_splits(2000, 200, seed=0) == (train, test) and math_splits(2000, 200, seed=1)[1] != test


def test_a_level_too_small_for_its_held_out_share_is_refused():
    with pytest.raises(ValueError, match="one_digit"):
        math_splits(100, 1000)  # 350 one-digit questions held out, 207 exist
