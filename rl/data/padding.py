"""The id that pads a batch of token rows, read off the tokenizer: one rule for every batch the
learner, the supervised trainers and a reward model build."""

from __future__ import annotations

from typing import Any


def pad_id_of(tokenizer: Any) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; give it a pad_token")
    return int(pad)
