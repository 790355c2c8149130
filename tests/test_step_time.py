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
    1 TFLOP/s and 10 GB/s, 1 MB of weights (500k bf16 parameters), bf16, no KL (the training
    forward is the old policy)."""
    s = Settings(dtype="bfloat16", prompts_per_step=2, n=4, kl_coef=0.0, rollout_workers=1, learners=1)
    lengths, host = Lengths(10, 6, 8, "test"), Host(1.0, 10.0, "test")
    t = predict_step(CONFIG, 1e6, s, lengths, host)
    f = lambda seq: forward_flops_per_token(CONFIG, seq)  # noqa: E731
    prefill = 8 * 10 * f(10) / (1e12 * step_time.PREFILL_EFFICIENCY)  # every sample's prompt
    decode = 8 * 6 * f(13) / (1e12 * step_time.DECODE_FLOP_EFFICIENCY)  # mid-completion context
    steps = 8 * (1e6 / 10e9 + step_time.DECODE_STEP_OVERHEAD_S)  # the longest completion's steps
    assert t.rollout_s == pytest.approx(prefill + decode + 8 * step_time.REQUEST_OVERHEAD_S + steps)
    head = 2 * 64 * 100  # the LM head over the 8 x 6 completion tokens only
    forward = 8 * 16 * (f(16) - head) + 8 * 6 * head
    optimizer = 5e5 * step_time.OPTIMIZER_BYTES_PER_PARAM / 10e9 + step_time.LEARNER_STEP_OVERHEAD_S
    learner = forward * 3 / (1e12 * step_time.LEARNER_EFFICIENCY["bfloat16"])  # forward + backward
    assert t.learner_s == pytest.approx(learner + optimizer)
    assert t.sync_s == pytest.approx(1e6 / step_time.SYNC_BYTES_PER_S)
    assert t.other_s == pytest.approx(8 * step_time.STEP_OVERHEAD_PER_SAMPLE_S)
    assert t.step_s == pytest.approx(t.rollout_s + t.learner_s + t.sync_s + t.other_s)
    # shared prefixes: each prompt once (2 x 10 + 8 x 6 tokens instead of 8 x 16)
    shared = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "shared_prefix": True}), lengths, host)
    assert shared.learner_s == pytest.approx(learner * ((2 * 10 + 8 * 6) * (f(16) - head) + 8 * 6 * head)
                                             / forward + optimizer)
    # asynchronous: rollout and learner overlap
    overlapped = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "off_policy_steps": 1}), lengths, host)
    assert overlapped.step_s == pytest.approx(max(t.rollout_s, t.learner_s) + t.sync_s + t.other_s)
    # a scoring pass per reference model and recomputed old policy: 3 + 2 forwards
    scored = predict_step(CONFIG, 1e6, Settings(**{**vars(s), "kl_coef": 0.1, "recompute_old_logprobs": True}),
                          lengths, host)
    assert scored.learner_s == pytest.approx(learner * 5 / 3 + optimizer)


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


def test_enforce_eager_auto_compiles_only_past_the_break_even():
    """CPU: compiled decoding is 1.26x eager after 53 s more start-up, so it pays past
    53 / (1 - 1/1.26) = 256.8 s of eager generation; GPU: 30 s and 1.5x, 90 s. Without a
    prediction each kind keeps its usual choice."""
    from rl.plan.engine_mode import break_even_s, choose_eager

    assert break_even_s(False) == pytest.approx(53 / (1 - 1 / 1.26)) and break_even_s(True) == pytest.approx(90)
    assert choose_eager(2.0, 100, False)[0] is True  # 200 s: eager
    eager, why = choose_eager(3.0, 100, False)  # 300 s: compiled
    assert eager is False and "300 s" in why and "257 s" in why
    assert choose_eager(1.0, 100, True)[0] is False and choose_eager(0.5, 100, True)[0] is True
    assert choose_eager(None, 100, False)[0] is True and choose_eager(None, 100, True)[0] is False


def test_launch_decides_auto_and_keeps_an_explicit_choice():
    """launch.plan.resolve_enforce_eager writes the decision into the config (the engines read a
    bool); true/false given by the user stay; no plan (cluster.preflight=false): eager on CPU."""
    from launch.plan import resolve_enforce_eager
    from rl.config.compose import compose

    cfg = compose("train", [])
    assert cfg.rollout.enforce_eager == "auto"
    note = resolve_enforce_eager(cfg, None)
    assert cfg.rollout.enforce_eager is True and "no step prediction" in note
    cfg = compose("train", ["rollout.enforce_eager=false"])
    assert resolve_enforce_eager(cfg, None) is None and cfg.rollout.enforce_eager is False


def test_peers_published_gpu_runs_through_the_planner():
    """bench.peer_predictions: NeMo-RL's published runs (lengths published) predicted within
    0.6-1.4x of their published steps, and the 8B model's colocated step below the 32B one's."""
    from bench.peer_predictions import ROWS, predict

    nemo = [(row, predict(row)) for row in ROWS if row.length_published]
    assert len(nemo) == 6
    ratios = [t.step_s / row.step_s for row, t in nemo]
    assert all(0.6 <= r <= 1.4 for r in ratios), ratios
    assert sum(0.7 <= r <= 1.3 for r in ratios) >= 4, ratios
    assert nemo[0][1].step_s < nemo[3][1].step_s
