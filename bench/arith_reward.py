"""The reward both sides of `bench.vs_trl` call: one plain function, one file, two frameworks.

Our stack names it `bench/arith_reward.py:score` (`reward.functions`); TRL gets the same function
object as a `reward_funcs` entry. Both call it with keyword arguments: `prompts`, `completions`
(decoded text, EOS stripped; TRL: a list with one assistant message where the prompts are chat
messages) and the dataset's other columns (`answer`), plus framework extras
(ours: `finish_reasons`, ...; TRL: `completion_ids`, `trainer_state`, ...) that `**kwargs` takes.

A random-init model is never right, so an exact-match reward alone would be 0 for every sample:
every group would have zero advantage and either side could skip work. The reward is dense
instead: the share of the completion's characters that are digits, plus 1 for the exact answer.
"""

from __future__ import annotations

from typing import Any


def score(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None,
          **kwargs: Any) -> list[float]:
    """Digit share of each completion (0..1), plus 1.0 when it equals the `answer` column."""
    answers = answer if answer is not None else [None] * len(completions)
    out = []
    for completion, ans in zip(completions, answers, strict=True):
        if isinstance(completion, list):  # TRL, conversational prompts: [{"role": "assistant", "content": ...}]
            completion = completion[-1]["content"] if completion else ""
        text = str(completion).strip()
        digits = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
        exact = float(ans is not None and text == str(ans).strip())
        out.append(digits + exact)
    return out
