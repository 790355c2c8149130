"""Shared-prefix micro-batches: the rows of a GRPO group computed as one prefix tree.

The n completions of a group share their prompt; with chat templates the prompt is often as
long as the completion, and episodes share their first turns. Computing every row separately
runs the shared tokens through every layer n times. Here the rows of each group become a trie
(one node per distinct prefix), laid out depth-first in one model row; a token attends to its
ancestors and itself only (a 4D attention mask), and its position id is its depth. Every node's
hidden state is then exactly the one each row sharing that prefix would compute alone, so
log-probs gathered per row are the unshared values, and the gradient reaching a shared node is
the sum of its rows' gradients: the unshared gradient, summed in another order.

Trees of several groups are packed into bins (first fit, longest first) as long as the largest
tree; a bin's trees cannot see each other. The attention over a bin is dense (masked, not
skipped), so a bin costs its length squared in attention: `layout_cost` weighs that against the
tokens saved, and the learner's `auto` mode keeps the layout that takes less time, the CPU time
of this plan included (`trainer/layouts.py` `PlanCost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from rl.plan.flops import layers_forward_flops
from trainer.packing import first_fit, right_padded_lengths


@dataclass(frozen=True)
class PrefixForest:
    """Rows as prefix trees packed into bins. `node[r, c]` is the flat index `bin * capacity +
    slot` of the node holding token c of row r (-1 past the row); rows that share a prefix hold
    the same nodes for it."""

    input_ids: torch.Tensor  # [bins, capacity]
    position_ids: torch.Tensor  # [bins, capacity]: each node's depth (a filler slot: 0)
    visible: torch.Tensor  # [bins, capacity, capacity] bool: query slot sees key slot
    node: torch.Tensor  # [rows, width]
    tokens: int  # real tokens of the rows
    nodes: int  # distinct nodes (tokens the layers compute)

    @property
    def capacity(self) -> int:
        return int(self.input_ids.shape[1])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _group_tree(seqs: dict[int, list[int]]) -> tuple[list[int], list[int], dict[int, list[int]], dict[int, int]]:
    """One group's trie: node tokens and depths in depth-first order, each row's path (its nodes,
    root first) and how many of its leading nodes it shares with the row before it. Sorted rows
    make it one pass: a row shares with any earlier row at most what it shares with the one just
    before it, and those nodes are that row's first ones."""
    tokens: list[int] = []
    depth: list[int] = []
    paths: dict[int, list[int]] = {}
    shared: dict[int, int] = {}
    prev_seq: list[int] = []
    prev_path: list[int] = []
    for r in sorted(seqs, key=lambda r: seqs[r]):
        seq = seqs[r]
        keep = _common_prefix(prev_seq, seq)
        path = prev_path[:keep] + list(range(len(tokens), len(tokens) + len(seq) - keep))
        tokens.extend(seq[keep:])
        depth.extend(range(keep, len(seq)))
        paths[r], shared[r] = path, keep
        prev_seq, prev_path = seq, path
    return tokens, depth, paths, shared


# The longest bin a tree layout makes: its masks hold bins x length^2 elements (a bool one and an
# additive one in the model's dtype: 8192 slots are 200 MB in bf16), so longer trees stay rows.
MAX_TREE_SLOTS = 8192


def build_forest(input_ids: torch.Tensor, attention_mask: torch.Tensor, group_ids: torch.Tensor,
                 cost: Callable[[int, int], float] | None = None,
                 keep: Callable[[int, int, int], bool] | None = None,
                 max_length: int | None = None) -> PrefixForest | None:
    """The rows of each group (`group_ids`) as a prefix tree, trees packed into bins of the
    largest tree's size, or (`cost(bins, length)`, e.g. `layout_cost`'s) of the multiple of it, or
    of `max_length`, that costs least, trimmed to its fullest bin; with `max_length` no bin grows
    past it to hold more trees (a CPU bf16 learner's plain attention stops there:
    trainer/cpu_attention.py). None when the rows are not right-padded, when a
    bin would pass `MAX_TREE_SLOTS`, or when `keep(bins, length, nodes)` says no: both decided
    from the trie's sizes, before any mask exists. Planned on the host from the token lists; the
    tensors are made on the batch's device."""
    lengths = right_padded_lengths(attention_mask)
    if lengths is None:
        return None
    rows, width = input_ids.shape
    host = input_ids.cpu()
    groups: dict[int, dict[int, list[int]]] = {}
    for r, (g, n) in enumerate(zip(group_ids.tolist(), lengths)):
        if n > 0:
            groups.setdefault(int(g), {})[r] = host[r, :n].tolist()
    trees = [_group_tree(seqs) for seqs in groups.values()]
    if not trees:
        return None
    sizes = [len(t[0]) for t in trees]
    capacity = max(sizes)
    bins = first_fit(sizes, capacity)
    if cost is not None:  # longer bins hold small trees with less filler, at a quadratic attention cost
        stop = sum(sizes) + capacity if max_length is None else min(sum(sizes) + capacity, max_length + 1)
        candidates = list(range(2 * capacity, stop, capacity))
        if max_length is not None and capacity < max_length and max_length not in candidates:
            candidates.append(max_length)
        for longer in candidates:
            packed = first_fit(sizes, longer)
            fullest = max(sum(sizes[t] for t in b) for b in packed)
            if cost(len(packed), fullest) < cost(len(bins), capacity):
                capacity, bins = fullest, packed
    if capacity > MAX_TREE_SLOTS or (keep is not None and not keep(len(bins), capacity, sum(sizes))):
        return None
    ids = torch.zeros((len(bins), capacity), dtype=input_ids.dtype)
    pos = torch.zeros((len(bins), capacity), dtype=torch.long)
    visible = torch.zeros((len(bins), capacity, capacity), dtype=torch.bool)
    node = torch.full((rows, width), -1, dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for t in members:
            tokens, depth, paths, shared = trees[t]
            ids[b, at:at + len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
            pos[b, at:at + len(tokens)] = torch.tensor(depth)
            for r, path in paths.items():
                slots = torch.tensor(path) + at
                node[r, :len(path)] = slots + b * capacity
                keep = shared[r]
                if keep < len(path):  # the row's new nodes see their ancestors and themselves
                    sees = torch.ones(len(path) - keep, len(path), dtype=torch.bool).tril(diagonal=keep)
                    visible[b, slots[keep:, None], slots[None, :]] = sees
            at += len(tokens)
        filler = torch.arange(at, capacity)
        visible[b, filler, filler] = True  # unfilled slots see themselves (no all-masked row)
    device = input_ids.device
    return PrefixForest(ids.to(device), pos.to(device), visible.to(device), node.to(device),
                        tokens=int(sum(lengths)), nodes=sum(len(t[0]) for t in trees))


def layout_cost(config: Mapping[str, Any], rows: int, length: int) -> float:
    """Forward FLOPs of the model's layers over `rows` rows of `length` slots each, attention
    dense over the row (a masked-out pair costs as much as a kept one;
    `rl.plan.flops.layers_forward_flops`). The LM head is left out: every layout applies it to
    the same selected tokens."""
    return layers_forward_flops(config, rows, length)


def longest_sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window of a model whose layers (some or all) attend within a sliding window; None when
    none does. A tree mask is a full-attention mask: such a model shares only rows no longer
    than its window, where both masks agree."""
    window = config.get("sliding_window")
    if not window:
        return None
    types = config.get("layer_types")
    if types is not None and "sliding_attention" not in types:
        return None
    if config.get("use_sliding_window") is False:  # Qwen2/3 configs carry a window they do not use
        return None
    return int(window)
