"""Built-in reward functions, written against the same public signature as user functions.

Name them in config like any other, e.g. ``fn: reward.builtin:exact_answer``. Completions are
the decoded text without the EOS token.
"""

from __future__ import annotations

import re
from typing import Any

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
