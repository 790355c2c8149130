"""How a micro-batch's right-padded rows enter the model: padded, packed end to end
(trainer/packing.py) or as shared-prefix trees (trainer/prefix_tree.py), and where each token's
hidden state comes out. Every forward of the learner (policy, reference, critic) goes through
one `Layout`, so the three give the same values in every layout.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

import torch

from trainer.packing import pack_rows
from trainer.prefix_tree import build_forest, layout_cost, longest_sliding_window

SHARE_MODES = ("auto", "on", "off")


@dataclass
class PlanCost:
    """CPU seconds of planning a shared-prefix layout on this host (`build_forest`): the trie
    (Python over each row's token list: per row and per node) and the masks (a scatter per row,
    then the [bins, length, length] bool mask, its copy to the device and, per forward, its
    additive copy: per element). The priors are this repo's 2-core Xeon (SmolLM2-shaped groups of
    8: 8 groups ~10-28 ms, 32 groups ~45 ms; 2 groups of 16 short rows ~1.2 ms); `observe` scales
    them by the builds this process timed, so a faster or slower host corrects them within a few
    micro-batches."""

    per_row: float = 3e-5
    per_node: float = 1.5e-6
    per_mask_element: float = 4e-9
    scale: float = 1.0
    observed: int = 0

    def unscaled(self, rows: int, nodes: int, bins: int, length: int) -> float:
        return self.per_row * rows + self.per_node * nodes + self.per_mask_element * bins * length * length

    def seconds(self, rows: int, nodes: int, bins: int, length: int) -> float:
        """The estimated planning time of a forest of `bins` x `length` holding `nodes` nodes of `rows` rows."""
        return self.scale * self.unscaled(rows, nodes, bins, length)

    def observe(self, rows: int, nodes: int, bins: int, length: int, measured_s: float) -> None:
        """Fold a timed build into the scale (the first sets it, later ones a moving average)."""
        ratio = measured_s / max(self.unscaled(rows, nodes, bins, length), 1e-12)
        self.scale = ratio if self.observed == 0 else 0.7 * self.scale + 0.3 * ratio
        self.observed += 1


PLAN_COST = PlanCost()  # this process's (one learner rank's) estimate, updated as it plans


@dataclass(frozen=True)
class Layout:
    """The model's inputs for a micro-batch and, per token (r, c) of the padded [rows, width]
    batch, its flat position in the model's [batch, slots] output (`index`; -1: padding)."""

    name: str  # "padded" | "packed" | "shared"
    input_ids: torch.Tensor  # [batch, slots]
    index: torch.Tensor  # [rows, width]
    attention_mask: torch.Tensor | None = None  # 2D (padded) or None
    position_ids: torch.Tensor | None = None  # packed and shared: restarting / depth
    visible: torch.Tensor | None = None  # shared: [batch, slots, slots] bool
    tokens: int = 0  # real tokens of the rows
    slots: int = 0  # positions the layers compute (batch x slots)

    def model_inputs(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward. The tree's mask is 4D and additive in the
        model's dtype, which transformers hands to the attention unchanged."""
        inputs = {"input_ids": self.input_ids}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.visible is not None:
            blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.visible.device)
            inputs["attention_mask"] = torch.where(self.visible, torch.zeros_like(blocked), blocked)[:, None]
        elif self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs

    def gather(self, output: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """`output` [batch, slots, ...] at the padded batch's tokens `at` ([rows, width'] bool,
        width' <= width, True only on real tokens outside the padded layout), in `at`'s
        row-major order: [N, ...]."""
        flat = output.flatten(0, 1)
        return flat[self.index[:, : at.shape[1]][at]]

    def per_token(self, output: torch.Tensor) -> torch.Tensor:
        """A per-position model output ([batch, slots], e.g. a value head's) at the padded
        batch's positions 0..width-2: [rows, width-1], 0 past a row's end outside the padded layout."""
        at = self.index[:, :-1]
        flat = output.flatten()
        return torch.where(at >= 0, flat[at.clamp(min=0)], torch.zeros((), dtype=flat.dtype, device=flat.device))



def padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Layout:
    rows, width = input_ids.shape
    index = torch.arange(rows * width, device=input_ids.device).view(rows, width)
    return Layout("padded", input_ids, index, attention_mask=attention_mask, tokens=int(attention_mask.sum()),
                  slots=rows * width)


def plan_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, pack: bool = False,
                group_ids: torch.Tensor | None = None, share: str = "off",
                config: Mapping[str, Any] | None = None, flops_per_s: float | None = None,
                passes: float = 3.0, plan_cost: PlanCost | None = None, hidden_s: float = 0.0,
                max_bin_slots: int | None = None) -> Layout:
    """The layout of one micro-batch. `pack`: rows packed end to end where that saves a row.
    `share` ("auto", "on", "off", `trainer.shared_prefix`) with the rows' `group_ids`: each
    group's rows as a prefix tree (bins sized by `layout_cost` of the model's `config`). "auto"
    keeps the trees only where they share something and (given the config) cost less than the
    other layout, decided before a mask is made: by net time when the learner gives its compute
    rate `flops_per_s` (the layers' FLOPs saved over `passes` forward passes at that rate must
    exceed the CPU time of planning the trees, `plan_cost`, trie and masks, less the `hidden_s`
    seconds of compute the planning runs beside: `PlanAhead`), else by the layers' FLOPs alone.
    `max_bin_slots`: no shared-prefix bin grows past it to hold more trees (`build_forest`'s
    `max_length`). Rows longer than a sliding window, rows that are not
    right-padded and trees longer than `MAX_TREE_SLOTS` are never shared (a tree's mask is a
    full-attention one, dense over its bin)."""
    base = padded(input_ids, attention_mask)
    packed = pack_rows(input_ids, attention_mask) if pack else None
    if packed is not None:
        base = Layout("packed", packed.input_ids, packed.index(len(input_ids)), position_ids=packed.position_ids,
                      tokens=base.tokens, slots=packed.input_ids.numel())
    if share == "off" or group_ids is None or len(input_ids) < 2:
        return base
    if share not in SHARE_MODES:
        raise ValueError(f"trainer.shared_prefix={share!r}: expected one of {', '.join(SHARE_MODES)}")
    config = config or {}
    window = longest_sliding_window(config)
    if window is not None and int(attention_mask.sum(dim=1).max()) > window:
        return base
    cost = partial(layout_cost, config) if config else None
    clock = plan_cost or PLAN_COST
    rows = len(input_ids)
    by_time = share == "auto" and cost is not None and flops_per_s is not None and flops_per_s > 0

    def seconds(flops: float) -> float:
        return flops * passes / flops_per_s

    def exposed(plan_s: float) -> float:  # the planning the compute beside it does not hide
        return max(plan_s - hidden_s, 0.0)

    base_cost = cost(*base.input_ids.shape) if cost is not None else 0.0
    if by_time and exposed(clock.seconds(rows, 0, 0, 0)) >= seconds(base_cost):
        return base  # planning the rows alone takes longer than computing all of them: no trie

    def cheaper(bins: int, length: int, nodes: int) -> bool:  # auto: something shared, at less cost
        if nodes >= base.tokens:
            return False
        if by_time:  # net time: the compute saved against planning the trees
            return seconds(base_cost - cost(bins, length)) > exposed(clock.seconds(rows, nodes, bins, length))
        return cost is None or cost(bins, length) < base_cost

    started = time.perf_counter()
    forest = build_forest(input_ids, attention_mask, group_ids, cost, keep=cheaper if share == "auto" else None,
                          max_length=max_bin_slots)
    if forest is None:
        return base
    clock.observe(rows, forest.nodes, *forest.input_ids.shape, time.perf_counter() - started)
    return Layout("shared", forest.input_ids, forest.node, position_ids=forest.position_ids, visible=forest.visible,
                  tokens=forest.tokens, slots=forest.input_ids.numel())


Item = TypeVar("Item")
Planned = TypeVar("Planned")


class PlanAhead(Generic[Item, Planned]):
    """The planned layouts of a run of micro-batches, in order, each planned on a worker thread
    while the caller computes with the one before: `plan(item, hidden_s)` gets the seconds of
    compute it runs beside (`compute_s` of the previous result; 0 for the first), so `auto`
    counts only the planning left on the critical path. That pays where the compute runs on a
    device (a GPU computes while the host plans); where the compute itself runs on the host's
    cores, `ahead=False` plans each item in the caller's thread when it is asked for (a second
    thread of torch ops there slowed the SmolLM2 shared-prefix step by 14% on 2 cores: its
    OpenMP team competes with the compute's). `waited_s` is what the caller waited for plans
    (the planning not hidden), `planned_s` their whole time."""

    def __init__(self, items: Sequence[Item], plan: Callable[[Item, float], Planned],
                 compute_s: Callable[[Planned], float] | None = None, ahead: bool = True):
        self.items, self.plan, self.compute_s, self.ahead = list(items), plan, compute_s, ahead
        self.waited_s = self.planned_s = 0.0

    def _timed(self, item: Item, hidden_s: float) -> Planned:
        started = time.perf_counter()
        try:
            return self.plan(item, hidden_s)
        finally:
            self.planned_s += time.perf_counter() - started

    def __iter__(self) -> Iterator[Planned]:
        if not self.items:
            return
        if not self.ahead:
            for item in self.items:
                result = self._timed(item, 0.0)
                self.waited_s = self.planned_s
                yield result
            return
        with ThreadPoolExecutor(1, thread_name_prefix="layout-plan") as pool:
            pending = pool.submit(self._timed, self.items[0], 0.0)
            for k in range(len(self.items)):
                started = time.perf_counter()
                result = pending.result()
                self.waited_s += time.perf_counter() - started
                if k + 1 < len(self.items):
                    hidden = self.compute_s(result) if self.compute_s is not None else 0.0
                    pending = pool.submit(self._timed, self.items[k + 1], hidden)
                yield result
