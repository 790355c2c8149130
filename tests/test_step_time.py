"""The planner's step-time model (rl/plan/step_time.py) and its inputs (launch/plan.py): each
phase by hand from the lengths and the host's speeds, and the lengths a run logged."""

from __future__ import annotations

import json

import pytest

from rl.plan import step_time
from rl.plan.flops import forward_flops_per_token
from rl.plan.memory_plan import Settings
from rl.plan.step_time import Host, Lengths, predict_step

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "intermediate_size": 128, "vocab_size": 100}


def test_each_phase_is_its_work_at_the_hosts_speed():
    """2 prompts x 4 samples, prompts of 10 tokens, completions of 6 on average and 8 at most,
    1 TFLOP/s and 10 GB/s, 1 MB of weights, bf16, no KL (the training forward is the old policy)."""
    s = Settings(dtype="bfloat16", prompts_per_step=2, n=4, kl_coef=0.0, rollout_workers=1, learners=1)
    lengths, host = Lengths(10, 6, 8, "test"), Host(1.0, 10.0, "test")
    t = predict_step(CONFIG, 1e6, s, lengths, host)
    f = lambda seq: forward_flops_per_token(CONFIG, seq)  # noqa: E731
    prefill = 2 * 10 * f(10) / (1e12 * step_time.PREFILL_EFFICIENCY)
    decode = 8 * 6 * f(13) / (1e12 * step_time.DECODE_FLOP_EFFICIENCY)
    steps = 8 * (1e6 / 10e9 + step_time.DECODE_STEP_OVERHEAD_S)
    assert t.rollout_s == pytest.approx(prefill + decode + steps)
    learner = 8 * 16 * f(16) * 3 / (1e12 * step_time.LEARNER_EFFICIENCY["bfloat16"])  # 8 rows of 16, fwd + bwd
    assert t.learner_s == pytest.approx(learner)
    assert t.sync_s == pytest.approx(1e6 / step_time.SYNC_BYTES_PER_S)
    assert t.other_s == pytest.approx(8 * step_time.STEP_OVERHEAD_PER_SAMPLE_S)
    assert t.step_s == pytest.approx(t.rollout_s + t.learner_s + t.sync_s + t.other_s)
    # shared prefixes: each prompt once (2 x 10 + 8 x 6 tokens instead of 8 x 16)
    shared = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "shared_prefix": True}), lengths, host)
    assert shared.learner_s == pytest.approx(learner * (2 * 10 + 8 * 6) / (8 * 16))
    # asynchronous: rollout and learner overlap
    overlapped = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "off_policy_steps": 1}), lengths, host)
    assert overlapped.step_s == pytest.approx(max(t.rollout_s, t.learner_s) + t.sync_s + t.other_s)
    # a scoring pass per reference model and recomputed old policy: 3 + 2 forwards
    scored = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "kl_coef": 0.1, "recompute_old_logprobs": True}),
                          lengths, host)
    assert scored.learner_s == pytest.approx(learner * 5 / 3)


def test_the_planner_reads_the_lengths_a_run_logged(tmp_path):
    """launch.plan's `last_run_lengths`: medians over the steps of run.dir's metrics.jsonl (rows
    without the lengths, e.g. evaluations, are skipped); None where there is no run."""
    from launch.plan import last_run_lengths

    assert last_run_lengths(str(tmp_path)) is None
    rows = [{"rollout/prompt_len_tokens": p, "rollout/completion_len_tokens": c, "rollout/completion_len_max_tokens": m}
            for p, c, m in ((50, 20, 40), (52, 30, 48), (51, 25, 44))] + [{"eval/greedy_pass_frac": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = last_run_lengths(str(tmp_path))
    assert (got.prompt, got.completion, got.longest) == (51, 25, 44) and "3 steps" in got.source
