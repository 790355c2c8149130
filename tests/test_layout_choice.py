"""Issue 62.3: `trainer.shared_prefix=auto` picks the layout by net time, the CPU time of planning
the prefix trees (trie and masks) included: on a fast device, short shared prefixes of many
samples save less compute than their plan costs, and the rows stay packed."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.layouts import PlanAhead, PlanCost, plan_layout
from trainer.prefix_tree import layout_cost

# one layer, 4 heads of 16, a wide MLP (1024): the linear layers dominate, so the FLOPs alone favour
# any sharing
CONFIG = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 16,
          "num_key_value_heads": 4, "intermediate_size": 1024, "vocab_size": 100}
PRIORS = dict(per_row=3e-5, per_node=1.5e-6, per_mask_element=4e-9)


def _short_prefix_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16 samples of one 4-token prompt: 8 completions of 8 tokens, 8 of 2, all different."""
    rows = []
    for r in range(16):
        completion = [100 + 10 * r + j for j in range(8 if r % 2 == 0 else 2)]
        rows.append([1, 2, 3, 4] + completion)
    ids = torch.zeros(16, 12, dtype=torch.long)
    am = torch.zeros(16, 12, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)], am[r, :len(row)] = torch.tensor(row), 1
    return ids, am, torch.zeros(16, dtype=torch.long)


def test_the_hand_computed_costs():
    # per token: 2 * (64*16*(4+8) + 4*16*64 + 3*64*1024) = 425984; attention 4*4*16 = 256 per slot pair
    # packed: 8 rows of 12 and 8 of 6 two to a bin: 12 bins of 12 slots
    assert layout_cost(CONFIG, 12, 12) == 144 * (425984 + 256 * 12) == 61_784_064
    # the tree: 4 + 8*8 + 8*2 = 84 nodes in one bin
    assert layout_cost(CONFIG, 1, 84) == 84 * (425984 + 256 * 84) == 37_588_992
    # planning it: 16 rows, 84 nodes, an 84 x 84 mask
    assert PlanCost(**PRIORS).seconds(16, 84, 1, 84) == pytest.approx(16 * 3e-5 + 84 * 1.5e-6 + 4e-9 * 84**2)
    assert PlanCost(**PRIORS).seconds(16, 84, 1, 84) == pytest.approx(6.34224e-4)


def test_auto_keeps_rows_packed_where_the_plan_costs_more_than_sharing_saves():
    """Forward + backward (3 passes) save (61,784,064 - 37,588,992) * 3 = 72,585,216 FLOPs: 0.36 ms
    at 2e11 FLOP/s (a GPU at a fraction of its peak), less than the 0.63 ms the plan takes, so
    `auto` keeps the rows packed; at 5e10 FLOP/s they save 1.45 ms and the tree is kept. The FLOPs
    alone (no rate: the old rule) always said share."""
    ids, am, groups = _short_prefix_batch()
    fast = plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=2e11,
                       plan_cost=PlanCost(**PRIORS))
    assert fast.name == "packed" and tuple(fast.input_ids.shape) == (12, 12)
    slow = plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=5e10,
                       plan_cost=PlanCost(**PRIORS))
    assert slow.name == "shared" and tuple(slow.input_ids.shape) == (1, 84)
    # where the two meet: 72,585,216 / 6.34224e-4 s = 1.1445e11 FLOP/s
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=1.16e11,
                       plan_cost=PlanCost(**PRIORS)).name == "packed"
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=1.13e11,
                       plan_cost=PlanCost(**PRIORS)).name == "shared"
    # one forward only (a scoring pass) saves a third as much: packed at 5e10 too (0.48 < 0.63 ms)
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=5e10,
                       passes=1, plan_cost=PlanCost(**PRIORS)).name == "packed"
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG).name == "shared"
    # `on` is a request, not a choice: shared at any rate
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="on", config=CONFIG, flops_per_s=1e15,
                       plan_cost=PlanCost(**PRIORS)).name == "shared"


def test_a_long_shared_prompt_still_pays_on_a_fast_device():
    """8 samples of a 200-token prompt with 4-token completions: the tree (232 nodes) saves
    (8*204*(425984+256*204) - 232*(425984+256*232)) * 3 = 2,003,484,672 FLOPs, 2.0 ms at 1e12
    FLOP/s, against a plan of 8*3e-5 + 232*1.5e-6 + 4e-9*232^2 = 0.80 ms."""
    prompt = list(range(1, 201))
    ids = torch.tensor([prompt + [300 + 4 * r + j for j in range(4)] for r in range(8)])
    am = torch.ones_like(ids)
    base, tree = layout_cost(CONFIG, 8, 204), layout_cost(CONFIG, 1, 232)
    assert (base - tree) * 3 == 2_003_484_672
    assert PlanCost(**PRIORS).seconds(8, 232, 1, 232) == pytest.approx(8.0329e-4, rel=1e-4)
    layout = plan_layout(ids, am, pack=True, group_ids=torch.zeros(8, dtype=torch.long), share="auto",
                         config=CONFIG, flops_per_s=1e12, plan_cost=PlanCost(**PRIORS))
    assert layout.name == "shared"
    # at 5e12 FLOP/s the saving is 0.40 ms: less than the plan, padded rows (equal lengths: nothing to pack)
    assert plan_layout(ids, am, pack=True, group_ids=torch.zeros(8, dtype=torch.long), share="auto",
                       config=CONFIG, flops_per_s=5e12, plan_cost=PlanCost(**PRIORS)).name == "padded"


def test_the_plan_estimate_follows_the_builds_this_process_timed():
    clock = PlanCost(**PRIORS)
    estimate = clock.seconds(16, 84, 1, 84)
    clock.observe(16, 84, 1, 84, measured_s=2 * estimate)
    assert clock.scale == pytest.approx(2.0) and clock.seconds(16, 84, 1, 84) == pytest.approx(2 * estimate)
    clock.observe(16, 84, 1, 84, measured_s=4 * estimate)
    assert clock.scale == pytest.approx(0.7 * 2.0 + 0.3 * 4.0)
    # a real build is timed and folded in
    ids, am, groups = _short_prefix_batch()
    fresh = PlanCost(**PRIORS)
    plan_layout(ids, am, pack=True, group_ids=groups, share="on", config=CONFIG, plan_cost=fresh)
    assert fresh.observed == 1 and fresh.scale > 0


def test_a_plan_hidden_behind_the_compute_before_it_no_longer_counts_against_the_tree():
    """With the plan (0.63 ms) planned while the micro-batch before computes, only what that
    compute does not hide is counted: at 2e11 FLOP/s the tree saves 0.363 ms, so 0.2 ms of
    compute beside it (0.434 ms exposed) keeps the rows packed and 0.3 ms (0.334 ms) shares."""
    ids, am, groups = _short_prefix_batch()

    def layout(hidden_s: float) -> str:
        return plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=CONFIG, flops_per_s=2e11,
                           plan_cost=PlanCost(**PRIORS), hidden_s=hidden_s).name

    assert [layout(h) for h in (0.0, 2e-4, 3e-4, 1.0)] == ["packed", "packed", "shared", "shared"]


def test_plan_ahead_plans_the_next_micro_batch_while_the_caller_computes_with_this_one():
    """Four plans of 0.15 s each, each consumed by 0.15 s of 'compute': planned one ahead, the
    caller waits only for the first (not 0.6 s), each later plan is told the compute it hides,
    and the results come in order."""
    hidden: list[float] = []

    def plan(item: int, hidden_s: float) -> int:
        hidden.append(hidden_s)
        time.sleep(0.15)
        return item * 10

    ahead = PlanAhead([1, 2, 3, 4], plan, compute_s=lambda result: result / 1000)
    seen = []
    for result in ahead:
        seen.append(result)
        time.sleep(0.15)
    assert seen == [10, 20, 30, 40]
    assert hidden == [0.0, 0.01, 0.02, 0.03]
    assert ahead.planned_s >= 0.6 - 1e-3
    assert 0.14 <= ahead.waited_s < 0.35


def test_plan_ahead_raises_a_failed_plan_in_the_caller():
    def plan(item: int, hidden_s: float) -> int:
        if item == 2:
            raise ValueError("bad rows")
        return item

    seen = []
    with pytest.raises(ValueError, match="bad rows"):
        for result in PlanAhead([1, 2, 3], plan):
            seen.append(result)
    assert seen == [1]


def test_plan_ahead_off_plans_each_item_in_the_callers_thread_when_asked():
    """`ahead=False` (a learner computing on the host's cores): no worker thread, each plan made
    when its item is asked for, all of it waited for, nothing credited as hidden."""
    import threading

    made: list[tuple[int, float, str]] = []

    def plan(item: int, hidden_s: float) -> int:
        made.append((item, hidden_s, threading.current_thread().name))
        time.sleep(0.05)
        return item

    ahead = PlanAhead([1, 2, 3], plan, compute_s=lambda result: 1.0, ahead=False)
    for result in ahead:
        assert made[-1][0] == result  # not planned before it was asked for
    assert made == [(i, 0.0, threading.current_thread().name) for i in (1, 2, 3)]
    assert ahead.waited_s == ahead.planned_s >= 0.15 - 1e-3


def test_the_learner_plans_ahead_only_where_a_device_computes():
    """A rank on a GPU plans its layouts ahead, credited with the compute they hide; a rank on
    the host's CPU plans them in turn (nothing credited)."""
    from trainer.learner import LearnerWorker

    worker = LearnerWorker.__new__(LearnerWorker)  # only what `_plan_ahead` reads
    worker.peak_tflops, worker._dtype, worker._model_config = 100.0, torch.bfloat16, CONFIG
    rows = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    for device, ahead in (("cuda", True), ("cpu", False)):
        worker.device = torch.device(device)
        planned = worker._plan_ahead(None, rows, passes=3.0)
        assert planned.ahead is ahead and (planned.compute_s is not None) is ahead and planned.items == rows
