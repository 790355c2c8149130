"""Padding-free forward passes: right-padded rows packed end to end into fewer, full rows.

A GRPO batch pads every row to its longest one; with completions of 3-96 tokens a third of a
SmolLM2 micro-batch is padding that every linear layer still multiplies. Here the rows of a
micro-batch are placed, longest first, into bins as long as the longest row (first fit), and
each bin's rows restart their position ids at 0. Hugging Face models read restarting
`position_ids` with no attention mask as packed sequences and build a block-causal mask
(`transformers.masking_utils.find_packed_sequence_indices`), so no token attends across rows and
every value is the one the padded layout gives. Bins no longer than the longest row keep the
attention cost of the padded layout while the linear layers see only real tokens (plus the
unfilled tail of each bin).

`packing_matches` checks that promise on the model itself (a model whose attention ignored packed
positions would silently mix rows): the learner packs only when it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Rows packed into bins. `source[i, j]` is the flat index `row * width + column` in the
    padded [rows, width] batch of the token at bin i, column j; -1 where a bin is unfilled."""

    input_ids: torch.Tensor  # [bins, capacity]
    position_ids: torch.Tensor  # [bins, capacity], restarting at 0 at each row (and at each bin's filler)
    source: torch.Tensor  # [bins, capacity]
    width: int  # of the padded batch

    def index(self, rows: int) -> torch.Tensor:
        """[rows, width]: the flat index `bin * capacity + column` of each token of the padded
        batch in the bins, -1 where the padded batch holds padding."""
        flat = self.source.flatten()
        held = flat >= 0
        out = torch.full((rows * self.width,), -1, dtype=torch.long, device=flat.device)
        out[flat[held]] = held.nonzero().squeeze(1)
        return out.view(rows, self.width)


def right_padded_lengths(attention_mask: torch.Tensor) -> list[int] | None:
    """Each row's length, or None when a row's mask is not a prefix of ones (not right-padded)."""
    lengths = attention_mask.sum(dim=1)
    prefix = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    return lengths.tolist() if torch.equal(prefix, attention_mask.bool()) else None


def first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """First fit decreasing: the indices of `sizes` in bins of `capacity`, largest first, each
    into the first bin with room (a size past the capacity gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        slot = next((b for b, free in enumerate(room) if free >= sizes[i]), None)
        if slot is None:
            bins.append([i])
            room.append(capacity - sizes[i])
        else:
            bins[slot].append(i)
            room[slot] -= sizes[i]
    return bins


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows | None:
    """First-fit-decreasing packing of right-padded rows into bins of the longest row's length;
    None when it would not save a bin (or the rows are not right-padded: a mask that is not a
    prefix of ones is left to the padded layout). The layout is planned on the host from the row
    lengths (one transfer), then the tokens are gathered on the batch's device in one op."""
    width = input_ids.shape[1]
    sizes = right_padded_lengths(attention_mask)
    if sizes is None:
        return None
    capacity = max(sizes, default=0)
    real = [i for i, n in enumerate(sizes) if n > 0]
    bins = [[real[k] for k in b] for b in first_fit([sizes[i] for i in real], capacity)]
    if len(bins) >= len(real):
        return None
    source = torch.full((len(bins), capacity), -1, dtype=torch.long)
    pos = torch.zeros((len(bins), capacity), dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            source[b, at:at + sizes[i]] = torch.arange(i * width, i * width + sizes[i])
            pos[b, at:at + sizes[i]] = torch.arange(sizes[i])
            at += sizes[i]
        pos[b, at:] = torch.arange(capacity - at)  # the filler: a sequence of its own
    source, pos = source.to(input_ids.device), pos.to(input_ids.device)
    ids = torch.where(source >= 0, input_ids.flatten()[source.clamp(min=0)], torch.zeros_like(source))
    return PackedRows(ids.to(input_ids.dtype), pos, source, width)
