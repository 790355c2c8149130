"""bench/models.py, bench/arith_reward.py, bench/vs_trl.py and bench/judge.py's pieces, without running either system."""

from __future__ import annotations

import os

import pytest
import torch

from bench import models, vs_trl
from bench.arith_reward import score

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(scope="module")
def bench_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("bench"))


def test_tiny_shape_builds_once_and_loads(bench_root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.build("tiny", bench_root)
    stamp = (path / "build.json").stat().st_mtime_ns
    assert models.build("tiny", bench_root) == path and (path / "build.json").stat().st_mtime_ns == stamp  # cached
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tok) == models.VOCAB == model.config.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("37+25=").input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "37+25="
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 1.3e6
    assert not model.config.tie_word_embeddings
    rows = (models.write_data(bench_root)).read_text().splitlines()
    assert len(rows) == 2000 and '"prompt"' in rows[0] and '"answer"' in rows[0]
    with pytest.raises(ValueError, match="unknown model shape"):
        models.build("huge", bench_root)


def test_varlen_edit_gives_geometric_lengths(bench_root):
    """The constant-channel EOS edit on the tiny shape: lengths spread around the target mean."""
    tok = models.tokenizer(bench_root)
    model = models.build_model(tok, models.SHAPES["tiny"])
    models.make_varlen(model, tok, mean_length=8.0)
    enc = tok(["12+34="] * 64, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = out[:, enc.input_ids.shape[1]:].tolist()
    lengths = [r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else len(r) for r in rows]
    s = models.length_summary(lengths, cap=64)
    assert 4 <= s["mean"] <= 16 and s["min"] < 4 and s["max"] > 16, s


def test_reward_takes_both_frameworks_arguments():
    ours = score(prompts=["1+2="] * 3, completions=["3", "x3", ""], answer=["3", "3", "3"],
                 finish_reasons=["stop"] * 3, completion_ids=[[1]] * 3)
    assert ours == [2.0, 0.5, 0.0]
    trl = score(prompts=["1+2="], completions=["12"], completion_ids=[[5, 6]], answer=["3"], trainer_state=None,
                log_extra=None, log_metric=None)
    assert trl == [1.0]


def test_ours_overrides_pass_validation(tmp_path):
    from hydra import compose, initialize_config_dir

    from rl.config.validation import validate

    case = vs_trl.cases(["27m"], ["bf16"])[0]
    overrides = vs_trl.ours_overrides(case, tmp_path / "m", tmp_path / "train.jsonl", tmp_path / "run", 6)
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base=None):
        cfg = compose("train", overrides=overrides)
    validate(cfg)
    assert cfg.reward.functions[0].fn == f"{vs_trl.REWARD_FILE}:score"
    assert (cfg.task.prompts_per_step, cfg.rollout.n, cfg.algorithm.kl_coef) == (8, 4, 0.0)
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.max_new_tokens == 128
    # bench.bounds' off-policy row: both modes run every completion to the same length
    from bench import bounds

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base=None):
        cfg = compose("train", overrides=[*overrides, *bounds.SAME_WORK, "algorithm.off_policy_steps=1"])
    validate(cfg)
    assert cfg.rollout.ignore_eos is True and cfg.rollout.max_new_tokens == 32


def test_summary_skips_warmup_steps():
    s = vs_trl.summarize([10.0, 2.0, 2.0], [100.0, 64.0, 32.0], samples_per_step=16, warmup=1)
    assert s["samples_per_s"] == pytest.approx(32 / 4) and s["tokens_per_s"] == pytest.approx(96 / 4)
    assert s["mean_completion_len"] == pytest.approx(3.0)
    assert vs_trl.parse_literals("bf16=True top_k=5 name=x") == {"bf16": True, "top_k": 5, "name": "x"}


def test_judge_bench_auroc_and_override_by_hand():
    """bench/judge.py: AUROC as pairwise wins (ties half), and a reward-function list written as a
    Hydra override that composes back to the same values (quotes, newlines, braces)."""
    from bench.judge import FEW_SHOT, auroc, hydra_value
    from rl.config.compose import compose

    # right [0.9, 0.5] vs wrong [0.1, 0.5]: 0.9 beats both, 0.5 beats 0.1 and ties 0.5 -> 3.5 / 4
    assert auroc([1, 0, 1, 0], [0.9, 0.1, 0.5, 0.5]) == 0.875
    assert auroc([1, 0], [0.2, 0.8]) == 0.0
    template = FEW_SHOT + " it's {answer}"
    functions = [{"fn": "reward.judge:score", "weight": 1.0, "kwargs": {"path": "/a/b", "template": template,
                                                                       "threads": 1}}]
    cfg = compose("train", ["model=smollm2", "task=math_chat", f"reward.functions={hydra_value(functions)}"])
    got = cfg.reward.functions[0]
    assert (got.fn, got.weight, got.kwargs.path, got.kwargs.template, got.kwargs.threads) == \
        ("reward.judge:score", 1.0, "/a/b", template, 1)


def test_offpolicy_overlap_takes_steady_steps_and_each_phase_beside_the_other():
    """Six steps one ahead: steps 0-1 warm up, step 5 trains with nothing made beside it, so the
    steady steps are 2-4; batch k's rollout ran beside step k-1's update (hand-computed)."""
    from bench.bounds import overlap

    ahead = {"time/step_s": [90.0, 60.0, 45.0, 44.0, 47.0, 25.0],
             "time/train_s": [60.0, 59.0, 44.0, 42.0, 46.0, 24.0],
             "time/rollout_s": [30.0, 36.0, 38.0, 36.0, 37.0, 27.0],
             "time/sync_s": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}
    row = overlap(ahead, {"time/rollout_s": 25.0, "time/train_s": 30.0}, warmup=2)
    assert row["steady_steps"] == [2, 3, 4]
    assert row["ratio"] == 45.0 / 30.0  # median of 45, 44, 47 over max(25, 30); the 25 s last step left out
    assert row["beside"] == {"train_s": 44.0, "rollout_s": 37.0, "sync_s": 1.0}
    assert row["slowdown_beside"] == {"train": 44.0 / 30.0, "rollout": 37.0 / 25.0}
    assert row["last_step_train_alone_s"] == 24.0
    assert row["step_over_overlap"] == 45.0 / 45.0  # max(44, 37) + 1: the overlap itself loses nothing
    with pytest.raises(SystemExit, match="no steady"):
        overlap({k: v[:3] for k, v in ahead.items()}, {"time/rollout_s": 25.0, "time/train_s": 30.0}, warmup=2)
