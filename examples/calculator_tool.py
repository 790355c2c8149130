"""The calculator tool alone: an integer expression of digits and + - *, evaluated without eval().

Kept apart from examples/calculator.py (which builds the task's model and so imports torch and
transformers) so that an agent using the tool imports only this: an agent module's imports are
every episode's memory, and each episode's process is a fork of the process that loaded it
(reward/agents/episode.py), so a heavy import there costs every episode's fork and exit.
"""

from __future__ import annotations

import re

_EXPRESSION = re.compile(r"\d+(?:[+\-*]\d+)*")
MAX_EXPRESSION_CHARS = 64  # no huge products: at most a few hundred digits


def evaluate(expression: str) -> int:
    """The value of an integer expression of digits and + - * (the usual precedence; spaces
    ignored), without eval(): anything else (parentheses, unary minus, letters, /, **) is a
    ValueError."""
    expr = expression.replace(" ", "") if isinstance(expression, str) else None
    if not expr or len(expr) > MAX_EXPRESSION_CHARS or not _EXPRESSION.fullmatch(expr):
        raise ValueError(f"not an expression of digits and + - *: {expression!r}")
    total, sign = 0, 1
    for term in re.split(r"([+\-])", expr):  # "2*3-4" -> ["2*3", "-", "4"]
        if term in "+-":
            sign = 1 if term == "+" else -1
            continue
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return total
