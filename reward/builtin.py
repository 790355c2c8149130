"""Built-in reward functions, written against the same public signature as user functions.

Name them in config like any other, e.g. ``fn: reward.builtin:exact_answer``. Completions are
the decoded text without the EOS token.
"""

from __future__ import annotations

import re
from typing import Any

from rl.data.answers import final_answer, last_boxed  # noqa: F401 - reward.builtin:final_answer, as before

_INTEGER = re.compile(r"-?[0-9]+")


def exact_answer(
    prompts: list[str], completions: list[str], answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 if the stripped completion equals the stripped `answer` column, else 0.0.

    None (does not apply) when the dataset has no `answer` column, or for a sample without one.
    """
    if answer is None:
        return [None] * len(completions)
    return [
        None if ans is None else float(text.strip() == str(ans).strip())
        for text, ans in zip(completions, answer, strict=True)
    ]


def format_number(
    prompts: list[str], completions: list[str], *, finish_reasons: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 if the completion is just an integer (``-?[0-9]+``) and generation stopped by itself.

    A completion cut off at max_tokens ("length") gets 0.0 even if it happens to look right.
    """
    return [
        float(reason == "stop" and _INTEGER.fullmatch(text.strip()) is not None)
        for text, reason in zip(completions, finish_reasons, strict=True)
    ]


# ---- math answers (math-verify) -----------------------------------------------------------------

# the final answer of a completion (last \boxed{}, else last number): rl/data/answers.py, shared with
# evaluation's majority vote


def _quiet_math_verify() -> None:
    """math-verify warns once per process that its timeout is off: we bound the call ourselves."""
    import logging

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _math_value(text: str) -> list:
    """math-verify's parse of an answer (LaTeX or a plain expression). Its signal-based timeout
    only works in the main thread and reward functions run in worker threads: the reward's
    `timeout_s` bounds the call instead."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    _quiet_math_verify()
    return parse(f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


def math_answer(prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer (`final_answer`: the last `\\boxed{}`, else the last
    number) equals the `answer` column symbolically (math-verify: `1/2`, `0.5` and
    `\\frac{1}{2}` are equal), else 0.0; None for a row whose answer is None. The dataset must
    have an `answer` column (checked before the run starts)."""
    from math_verify import verify

    out: list[float | None] = []
    for text, gold in zip(completions, answer, strict=True):
        if gold is None:
            out.append(None)
            continue
        found = final_answer(text)
        if found is None:
            out.append(0.0)
            continue
        target, given = _math_value(str(gold)), _math_value(found)
        out.append(float(bool(target) and bool(given) and verify(target, given, timeout_seconds=None)))
    return out


def math_format(prompts: list[str], completions: list[str], *, finish_reasons: list[str],
                **kwargs: Any) -> list[float | None]:
    """1.0 when generation stopped by itself and the completion ends with its final answer (a
    `\\boxed{}` or a number as the last thing written, a closing period allowed), else 0.0."""
    out: list[float | None] = []
    for text, reason in zip(completions, finish_reasons, strict=True):
        tail = text.strip().rstrip(".").rstrip()
        ends_with_answer = tail.endswith("}") and last_boxed(tail) is not None or \
            bool(re.search(r"-?\d+(?:\.\d+)?(?:/\d+)?$", tail.replace(",", "")))
        out.append(float(reason == "stop" and ends_with_answer))
    return out
