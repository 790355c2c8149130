"""Behaviour-policy correction and token-budget micro-batches: hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rl.data.batch import plan_micro_batches, split_to_count
from rl.plan.flops import forward_flops_per_token, train_flops
from rl.algo.importance import effective_sample_size, importance_weights


def _lps():
    # learner - behaviour log-ratios: row 0: [log 3, log 0.5, (off-mask)], row 1: [log 1.2, log 1.2, log 1.2]
    learner = torch.tensor([[math.log(3.0), math.log(0.5), 5.0], [math.log(1.2)] * 3])
    behaviour = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return learner, behaviour, mask


def test_token_tis_caps_each_token_ratio():
    w, sums = importance_weights(*_lps(), mode="token_tis", tis_cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5, 0.0, 1.2, 1.2, 1.2])
    assert sums["is/capped_frac"] == 1.0  # one token of five (summed; the group divides by tokens)
    ratios = [3.0, 0.5, 1.2, 1.2, 1.2]
    assert sums["_is/w_sum"] == pytest.approx(sum(ratios))
    assert sums["_is/w_sq_sum"] == pytest.approx(sum(r * r for r in ratios))
    ess = effective_sample_size(sums["_is/w_sum"], sums["_is/w_sq_sum"], 5)
    assert ess == pytest.approx(7.1 ** 2 / (5 * 13.57))


def test_seq_mask_drops_sequences_with_an_extreme_geometric_mean_ratio():
    learner, behaviour, mask = _lps()
    # geometric-mean ratios: row 0 sqrt(3 * 0.5) = 1.225, row 1 1.2
    w, sums = importance_weights(learner, behaviour, mask, mode="seq_mask", seq_mask_low=0.5, seq_mask_high=1.21)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert sums["is/masked_frac"] == 2.0
    w, _ = importance_weights(learner, behaviour, mask, mode="seq_mask", seq_mask_low=0.5, seq_mask_high=1.3)
    assert w.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_token_mis_drops_tokens_above_the_cap_instead_of_capping_them():
    # ratios: row 0 [3, 0.5], row 1 [1.2] x 3; cap 2: the 3 gets no weight at all (TIS would give 2)
    w, sums = importance_weights(*_lps(), mode="token_mis", mis_cap=2.0)
    assert w.flatten().tolist() == pytest.approx([0.0, 0.5, 0.0, 1.2, 1.2, 1.2])
    assert sums["is/masked_frac"] == 1.0
    w, sums = importance_weights(*_lps(), mode="token_mis", mis_cap=1.1)  # 1.2 > 1.1 too
    assert w.flatten().tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert sums["is/masked_frac"] == 4.0


def test_icepop_masks_ratios_outside_both_bounds():
    # [0.6, 2.5]: 3 above, 0.5 below, the 1.2s kept with their ratio as weight
    w, sums = importance_weights(*_lps(), mode="icepop", icepop_low=0.6, icepop_high=2.5)
    assert w.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 1.2, 1.2, 1.2])
    assert sums["is/masked_frac"] == 2.0
    # its defaults [0.5, 5]: every token kept (0.5 sits on the bound)
    w, sums = importance_weights(*_lps(), mode="icepop", icepop_low=0.5, icepop_high=5.0)
    assert w.flatten().tolist() == pytest.approx([3.0, 0.5, 0.0, 1.2, 1.2, 1.2])
    assert sums["is/masked_frac"] == 0.0


def test_each_correction_reads_its_own_config_fields():
    from rl.algo.importance import IMPORTANCE_CORRECTIONS
    from rl.config.schema import AlgorithmConfig

    algo = AlgorithmConfig(tis_cap=3.0, mis_cap=4.0, icepop_low=0.25, icepop_high=8.0)
    assert IMPORTANCE_CORRECTIONS.settings("token_tis", algo) == {"tis_cap": 3.0}
    assert IMPORTANCE_CORRECTIONS.settings("token_mis", algo) == {"mis_cap": 4.0}
    assert IMPORTANCE_CORRECTIONS.settings("icepop", algo) == {"icepop_low": 0.25, "icepop_high": 8.0}


def test_none_is_the_mask_and_on_policy_ess_is_one():
    learner, _, mask = _lps()
    w, sums = importance_weights(learner, learner, mask, mode="none")
    assert torch.equal(w, mask)
    assert effective_sample_size(sums["_is/w_sum"], sums["_is/w_sq_sum"], 5) == pytest.approx(1.0)


def test_token_budget_micro_batches_sort_by_length_and_respect_the_budget():
    lengths = [5, 20, 7, 19, 3, 30]
    plan = plan_micro_batches(lengths, max_rows=8, max_tokens=40)
    # longest first: 30 alone (2 x 30 > 40); 20 + 19 (2 x 20 = 40); 7, 5, 3 (3 x 7 = 21)
    assert plan == [[5], [1, 3], [2, 0, 4]]
    assert plan_micro_batches(lengths, max_rows=2, max_tokens=1000) == [[5, 1], [3, 2], [0, 4]]
    with pytest.raises(ValueError, match="row cuts: rl.plan.geometry"):  # rows alone: BatchGeometry's cut
        plan_micro_batches(lengths, max_rows=4, max_tokens=0)
    assert split_to_count(plan, 5) == [[5], [1], [3], [2], [0, 4]]
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], 3)


def test_model_flops_per_token():
    config = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 16, "vocab_size": 10}
    # per layer: q 8x8 + k,v 8x4 each + o 8x8 = 192; mlp 3 x 8 x 16 = 384; head 80
    weights = 2 * (192 + 384) + 80
    assert forward_flops_per_token(config, seq_len=6) == 2 * weights + 2 * 2 * 2 * 4 * 6
    assert train_flops(config, [6, 6]) == 3 * 2 * 6 * forward_flops_per_token(config, 6)


def test_ess_is_at_most_one_when_on_policy_ratios_round():
    # three ratios of 1 summed as the learner sums them (fp32 rounding): (3 + 1e-7)^2 / (3 * 3) > 1
    # before the clamp; a full lane's async and streaming runs failed `ess_frac <= 1` at step 0
    assert effective_sample_size(3.0000001, 3.0, 3) == 1.0
    assert effective_sample_size(2.0, 4.0, 2) == pytest.approx(0.5)  # weights 0 and 2: Kish's 4 / (2 * 4)
