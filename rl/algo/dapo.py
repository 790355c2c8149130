"""DAPO's sample-level tricks (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"), as pure functions the driver loop applies.

- Dynamic sampling: a group whose rewards are all equal has zero group-relative advantage and
  only dilutes the batch; drop such groups and sample more prompts (up to a bound).
- Overlong reward shaping: a soft, length-aware penalty in the last `buffer` tokens before the
  generation budget, -1 at or beyond it.
- Truncated-completion masking ("overlong filtering") lives in `rl.data.batch.build_train_batch`.
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """Group ids, in first-seen order, whose valid rewards are not all equal (at least two valid)."""
    out: list[int] = []
    for gid in dict.fromkeys(group_ids.tolist()):
        r = rewards[(group_ids == gid) & valid.bool()]
        if r.numel() >= 2 and bool((r != r[0]).any()):
            out.append(int(gid))
    return out


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13: 0 while L <= max_len - buffer, then ((max_len - buffer) - L) / buffer down to
    -1 at L = max_len, and -1 beyond; scaled by `factor`. `buffer` = 0 disables it."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} is longer than the generation budget {max_len}")
    start = max_len - buffer
    penalty = ((start - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return factor * penalty
