"""Shared-prefix micro-batches (trainer/prefix_tree.py, trainer/layouts.py): a group's rows as one
prefix tree give every log-prob, entropy, value and gradient of the rows computed alone."""

from __future__ import annotations

import pytest
import torch

from rl.data.batch import group_order, plan_micro_batches
from tests.test_logprobs import CONFIG, Misreads, _model, assert_layouts_agree, head_path  # noqa: F401  (the fixture)
from trainer.layouts import plan_layout
from trainer.logprobs import prefix_sharing_matches, token_logprobs
from trainer.prefix_tree import build_forest, layout_cost, longest_sliding_window


def _rows(*seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    am = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, am


def test_a_group_becomes_one_tree_holding_each_prefix_once():
    """Rows 5 6 7 8 9 / 5 6 7 1 2 3 / 5 6 4 (one group) and 9 9 9 9 (another): the group's trie
    in depth-first order (sorted rows: 5 6 4 < 5 6 7 1 2 3 < 5 6 7 8 9) is 5 6 4 7 1 2 3 8 9 at
    depths 0 1 2 2 3 4 5 3 4, nine nodes for 14 tokens, filling its bin; the other group's four
    tokens take a second bin, whose free slots see only themselves."""
    ids, am = _rows([5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3], [5, 6, 4], [9, 9, 9, 9])
    f = build_forest(ids, am, torch.tensor([0, 0, 0, 1]))
    assert f.input_ids.tolist() == [[5, 6, 4, 7, 1, 2, 3, 8, 9], [9, 9, 9, 9, 0, 0, 0, 0, 0]]
    assert f.position_ids.tolist() == [[0, 1, 2, 2, 3, 4, 5, 3, 4], [0, 1, 2, 3, 0, 0, 0, 0, 0]]
    assert f.node.tolist() == [[0, 1, 3, 7, 8, -1], [0, 1, 3, 4, 5, 6], [0, 1, 2, -1, -1, -1],
                               [9, 10, 11, 12, -1, -1]]
    assert (f.nodes, f.tokens) == (13, 18)
    v = f.visible.int()
    assert v[0, 8].tolist() == [1, 1, 0, 1, 0, 0, 0, 1, 1]  # 9 sees 5 6 7 8 and itself, not its cousins
    assert v[0, 2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0]  # 4 sees 5 6
    assert v[1, :4, :4].tolist() == torch.ones(4, 4).tril().int().tolist()
    assert v[1, 4:, :].sum(dim=1).tolist() == [1] * 5 and all(v[1, i, i] for i in range(4, 9))  # fillers: themselves
    # two groups that fit one bin share it; rows equal to or inside another row add no node
    ids, am = _rows([1, 2, 3], [1, 2, 3], [1, 2], [4, 5])
    f = build_forest(ids, am, torch.tensor([0, 0, 0, 1]))
    assert f.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]] and f.nodes == 5
    assert f.node[0].tolist() == f.node[1].tolist() == [0, 1, 2] and f.node[2].tolist() == [0, 1, -1]
    assert build_forest(ids.flip(1), am.flip(1), torch.tensor([0, 0, 0, 1])) is None  # left padding


def _group_batch(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three groups: a 7-token prompt with completions of 5, 3, 1 and 4 tokens (two of them
    starting alike); a 3-token prompt with two equal rows; one episode whose second turn
    starts with the first (a 10-token common prefix) and a lone row."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(1, 300, (n,), generator=g).tolist()  # noqa: E731
    p1, p2, turn = r(7), r(3), r(10)
    c = r(2)
    seqs = [p1 + c + r(3), p1 + r(3), p1 + r(1), p1 + c + r(2), p2 + r(4), None, turn + r(6), turn, r(9)]
    seqs[5] = list(seqs[4])
    ids, am = _rows(*seqs)
    return ids, am, torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3])


def test_shared_prefix_gives_the_unshared_values_and_gradients(head_path):
    """fp32: log-probs, entropies and every parameter's gradient within 1e-5 of the padded batch,
    with the tree saving a third of the tokens here; the model passes `prefix_sharing_matches`."""
    ids, am, groups = _group_batch()
    where = am[:, 1:].bool().clone()
    where[:, :2] = False
    weights = torch.randn(where.shape, generator=torch.Generator().manual_seed(6)) * where
    layout = plan_layout(ids, am, pack=True, group_ids=groups, share="on", config=CONFIG)
    assert layout.name == "shared" and layout.tokens == int(am.sum()) and layout.slots < 0.75 * layout.tokens
    assert_layouts_agree(ids, am, where, weights, layout)
    assert prefix_sharing_matches(_model(), 300)


def test_a_model_that_ignores_the_tree_mask_is_caught():
    """The learner's check before sharing: a model that builds its own causal mask (ignoring the
    4D one) lets a row see its siblings' tokens, and fails it."""

    unmasked = Misreads(_model(), lambda ids, am, pos: {"input_ids": ids, "position_ids": pos})
    assert prefix_sharing_matches(_model(), 300) and not prefix_sharing_matches(unmasked, 300)


def test_lora_adapters_and_a_value_head_get_the_unshared_gradients_and_values():
    """Through peft (the adapters' gradients) and a token-classification value head (the
    critic's values at every position, `Layout.per_token`), shared equals padded."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForTokenClassification

    ids, am, groups = _group_batch(seed=9)
    layout = plan_layout(ids, am, group_ids=groups, share="on", config=CONFIG)
    grads = []
    for chosen in (None, layout):
        model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(3))
        lp, _ = token_logprobs(model, ids, am, layout=chosen)
        lp.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0] and all(torch.allclose(grads[0][n], grads[1][n], atol=1e-5) for n in grads[0])
    torch.manual_seed(0)
    critic = LlamaForTokenClassification(LlamaConfig(**CONFIG, num_labels=1)).float().eval()  # no dropout
    padded = critic(input_ids=ids, attention_mask=am).logits[:, :-1, 0]
    shared = layout.per_token(critic(**layout.model_inputs(torch.float32)).logits[..., 0])
    real = am[:, :-1].bool()  # a value at every token of the row but the last position
    assert torch.allclose(padded[real], shared[real], atol=1e-5) and (shared[~real] == 0).all()


def test_auto_shares_where_the_flops_say_so_and_never_past_a_sliding_window():
    """`auto` keeps the tree when `layout_cost` says it is cheaper: a 60-token prompt with eight
    20-token completions (240 tree tokens against 8 rows of 80: 640 packed); rows with nothing
    in common stay packed; so does any batch with rows longer than a sliding window."""
    config = dict(CONFIG, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 300, (60,), generator=g).tolist()
    ids, am = _rows(*[prompt + torch.randint(1, 300, (20,), generator=g).tolist() for _ in range(8)])
    groups = torch.zeros(8, dtype=torch.long)
    auto = plan_layout(ids, am, pack=True, group_ids=groups, share="auto", config=config)
    assert auto.name == "shared" and auto.slots == 60 + 8 * 20
    assert layout_cost(config, 1, 220) < layout_cost(config, 8, 80)
    lone = torch.arange(8)  # every row its own group: nothing shared
    assert plan_layout(ids, am, pack=True, group_ids=lone, share="auto", config=config).name == "padded"
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="off", config=config).name == "padded"
    windowed = dict(config, sliding_window=64, layer_types=["sliding_attention"] * 30)
    assert longest_sliding_window(windowed) == 64
    assert plan_layout(ids, am, group_ids=groups, share="on", config=windowed).name == "padded"
    assert longest_sliding_window(dict(config, sliding_window=64, use_sliding_window=False)) is None
    with pytest.raises(ValueError, match="trainer.shared_prefix='yes'"):
        plan_layout(ids, am, group_ids=groups, share="yes", config=config)


def test_groups_stay_together_in_the_order_and_the_token_budget():
    """`group_order` keeps a group's rows adjacent (groups shuffled, rows in place); the token
    budget adds a group whole where it fits, else cuts it by rows."""
    groups = torch.tensor([3, 1, 3, 2, 1, 2])
    assert group_order(groups).tolist() == [0, 2, 1, 4, 3, 5]
    order = group_order(groups, torch.Generator().manual_seed(1)).tolist()
    assert sorted(order) == list(range(6)) and all(
        {groups[order[i]].item() for i in (k, k + 1)} == {groups[order[k]].item()} for k in (0, 2, 4))
    # lengths 9 8 7 6 5 4 in groups a a b b c c; budget 30 tokens, 4 rows
    lengths, g = [9, 8, 7, 6, 5, 4], [0, 0, 1, 1, 2, 2]
    assert plan_micro_batches(lengths, 4, 30, g) == [[0, 1], [2, 3, 4, 5]]  # b does not fit after a: 4 x 9 > 30
    assert plan_micro_batches(lengths, 4, 30) == [[0, 1, 2], [3, 4, 5]]
    assert plan_micro_batches([9, 1, 8, 1], 4, 20, [0, 1, 0, 1]) == [[0, 2], [1, 3]]
    assert plan_micro_batches([9, 1, 8, 1], 4, 20) == [[0, 2], [1, 3]]
    assert plan_micro_batches([9, 9, 9], 4, 20, [0, 0, 0]) == [[0, 1], [2]]  # a group too big: cut by rows


def test_a_tree_too_long_or_not_worth_it_is_decided_before_any_mask(monkeypatch):
    """`auto` compares costs from the trie's sizes alone, and no layout makes a bin longer than
    `MAX_TREE_SLOTS` (its masks grow with its length squared): such rows stay packed, even `on`."""
    import trainer.prefix_tree as prefix_tree

    ids, am, groups = _group_batch()
    made = []
    real_zeros = torch.zeros
    monkeypatch.setattr(prefix_tree.torch, "zeros", lambda *a, **k: made.append(a) or real_zeros(*a, **k))
    assert prefix_tree.build_forest(ids, am, groups, keep=lambda bins, length, nodes: False) is None
    assert made == []  # refused from the sizes: no tensor was made
    assert prefix_tree.build_forest(ids, am, groups) is not None
    monkeypatch.setattr(prefix_tree, "MAX_TREE_SLOTS", 8)
    assert plan_layout(ids, am, pack=True, group_ids=groups, share="on", config=CONFIG).name == "packed"


def test_bins_grow_to_hold_more_trees_only_up_to_the_limit():
    """Five one-row groups of 10, 6, 6, 6, 6 tokens and a cost of slots alone (bins x length):
    bins of the largest tree (5 x 10 = 50 slots) lose to longer ones, and with no limit all five
    trees share one bin of 34; `max_length=16` (a CPU bf16 learner's plain-attention limit) keeps
    every bin within it: 10+6, 6+6, 6 -> 3 x 16 = 48. Each row's tokens are where the bins say."""
    ids, am = _rows(list(range(1, 11)), *[list(range(20 + 6 * k, 26 + 6 * k)) for k in range(4)])
    groups = torch.arange(5)
    slots = lambda bins, length: float(bins * length)  # noqa: E731
    free = build_forest(ids, am, groups, slots)
    capped = build_forest(ids, am, groups, slots, max_length=16)
    assert tuple(free.input_ids.shape) == (1, 34) and tuple(capped.input_ids.shape) == (3, 16)
    for forest in (free, capped):
        flat = forest.input_ids.flatten()
        assert all(flat[forest.node[r][am[r].bool()]].tolist() == ids[r][am[r].bool()].tolist() for r in range(5))
    # a limit below the largest tree leaves it its own bin; plan_layout passes the limit on
    assert tuple(build_forest(ids, am, groups, slots, max_length=8).input_ids.shape) == (5, 10)
    capped_layout = plan_layout(ids, am, group_ids=groups, share="on", config=CONFIG, max_bin_slots=16)
    assert capped_layout.name == "shared" and capped_layout.input_ids.shape[1] <= 16
