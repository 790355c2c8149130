"""Reward-model training (`launch.train_rm`) and serving (`reward.model_reward`) on the tiny task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(scope="module")
def built_rm(tiny_trained, tmp_path_factory):
    """The built-in tiny RM, built from the tiny policy by the real builder (2 epochs, ZeRO-2)."""
    from examples.preference import build as build_tiny_rm

    out = tmp_path_factory.mktemp("tiny_rm")
    t0 = time.perf_counter()
    summary = build_tiny_rm(str(out), seed=0, policy_path=f"{tiny_trained}/model",
                            overrides=["algorithm.epochs=2", "trainer.zero_stage=2"])
    summary["wall_s"] = time.perf_counter() - t0
    return out, summary


def _held_out(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.full  # a learning curve
def test_tiny_rm_learns_the_preference_on_held_out_pairs(built_rm) -> None:
    out, summary = built_rm
    assert summary["eval/pairwise_accuracy"] > 0.8, summary
    assert summary["eval/pairwise_accuracy_before_training"] < 0.65  # it was learned, not given
    assert summary["eval/loss"] < summary["eval/loss_before_training"]
    assert summary["test_pairs"] == 1000 and summary["dropped_pairs"] == 0
    run = out / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/pairwise_accuracy" in r]
    assert [r["epoch"] for r in evals] == [0.0, 1.0, 2.0]  # before training and after each epoch
    assert all("train/loss" in r for r in rows if "eval/pairwise_accuracy" not in r)
    assert list((run / "tb").iterdir()) and (run / "config.yaml").exists() and (run / "summary.json").exists()
    model_dir = out / "model"
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    assert not (run / "final_model").exists()  # moved into OUT/model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.num_labels == 1 and config.architectures == ["LlamaForSequenceClassification"]
    assert config.pad_token_id is not None


@pytest.mark.slow
@pytest.mark.full  # builds and serves the RM: the full lane
def test_served_reward_prefers_chosen_on_held_out_pairs(built_rm) -> None:
    from reward import model_reward

    out, summary = built_rm
    pairs = _held_out(out)
    prompts = [p["prompt"] for p in pairs]
    chosen = model_reward.score(prompts, [p["chosen"] for p in pairs], path=str(out / "model"), batch_size=128)
    rejected = model_reward.score(prompts, [p["rejected"] for p in pairs], path=str(out / "model"), batch_size=37)
    assert all(isinstance(x, float) for x in chosen)
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)
    assert accuracy > 0.8
    # same tokenisation and pooling as in training: the served model reproduces the eval exactly
    assert accuracy == pytest.approx(summary["eval/pairwise_accuracy"], abs=0.002)
    # the RM ranks a correct answer above near misses and far-off ones (the signal GRPO climbs)
    scores = model_reward.score(["37+25="] * 4, ["62", "72", "95", "6+2"], path=str(out / "model"))
    assert scores[0] > scores[2] and scores[0] > scores[3] and scores[1] > scores[3]


@pytest.mark.slow
@pytest.mark.full  # builds and serves the RM: the full lane
def test_served_reward_through_the_scorer_and_the_cache(built_rm) -> None:
    from reward import model_reward
    from reward.scorer import RewardScorer
    from rl.data.types import Sample

    out, _ = built_rm
    path = str(out / "model")
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_reward.load(path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r[0] is results[0][0] for r in results)  # one load per process, even when concurrent
    assert model_reward.load(path)[0] is results[0][0]

    scorer = RewardScorer([{"fn": "reward.model_reward:score", "name": "rm", "kwargs": {"path": path, "batch_size": 2}}])
    samples = [Sample([1], [2], [0.0], "stop", 0, "37+25=", text, 0, i) for i, text in enumerate(["62", "", "900"])]
    scored = scorer.score(samples)
    assert all(s.error is None for s in scored), [s.error for s in scored]
    direct = model_reward.score(["37+25="] * 3, ["62", "", "900"], path=path)
    assert [s.reward for s in scored] == pytest.approx(direct, abs=1e-5)
    assert scored[0].reward > scored[1].reward and scored[0].reward > scored[2].reward


def test_reward_model_config_composes_for_grpo() -> None:
    from hydra import compose, initialize_config_dir

    from rl.data.builtins import builtin_dir
    from rl.config.validation import validate

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base=None):
        cfg = compose("train", overrides=["reward=model"])
    validate(cfg)
    rm, check = cfg.reward.functions
    assert rm.fn == "reward.model_reward:score" and rm.kwargs.path == "artifacts/tiny_rm/model" and rm.weight == 1
    assert builtin_dir(rm.kwargs.path) == os.path.normpath("artifacts/tiny_rm")  # launch.train builds it when missing
    assert check.fn == "reward.builtin:exact_answer" and check.weight == 0  # logged, not trained on


def test_pooling_reads_the_last_real_token_with_right_padding() -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainer.reward_model import collate, sequence_scores

    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    rows = [[1, 5, 6, 7, 2], [1, 5, 2], [1, 9, 9, 9, 9, 9, 2]]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"][1].tolist() == [1, 5, 2, 0, 0, 0, 0]  # right padding
    with torch.no_grad():
        batched = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
        alone = [float(sequence_scores(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))) for r in rows]
        hf = model(**batch).logits[:, 0]  # transformers' own pooling (last non-pad id) agrees when pad != EOS
    assert batched.tolist() == pytest.approx(alone, abs=1e-5)
    assert batched.tolist() == pytest.approx(hf.tolist(), abs=1e-6)
    # a tokenizer that pads with EOS (id 2 here): transformers would skip the final EOS, we do not
    eos_padded = collate(rows, pad_id=2)
    model.config.pad_token_id = 2
    with torch.no_grad():
        assert sequence_scores(model, eos_padded["input_ids"], eos_padded["attention_mask"]).tolist() == pytest.approx(
            alone, abs=1e-5)
    with pytest.raises(ValueError, match="right-padded"):
        sequence_scores(model, batch["input_ids"], batch["attention_mask"].flip(-1))


def test_missing_chosen_column_fails_naming_it(tiny_dir, tmp_path) -> None:
    from launch.train_rm import run
    from rl.data.dataset import DataError

    bad = tmp_path / "prefs.jsonl"
    bad.write_text("".join(json.dumps({"prompt": "1+2=", "better": "3", "rejected": "4"}) + "\n" for _ in range(4)))
    with pytest.raises(DataError) as err:
        run([f"model.path={tiny_dir}/model", f"data.train_files=[{bad}]", "data.test_files=[]",
             f"run.dir={tmp_path}/run", "data.group_key=null"])
    text = str(err.value)
    assert "data.chosen_key='chosen'" in text and "better" in text  # names the column, the key and what exists
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before any training


@pytest.mark.parametrize("override,expected", [("algorithm.lrr=1", "algorithm.lrr"), ("+nonsense=1", "nonsense"),
                                               ("trainer.zero_stage=5", "trainer.zero_stage=5"),
                                               ("trainer.micro_batch_size=1", "trainer.micro_batch_size=1: must be >= 2"),
                                               ("optim.lrr=1", "optim.lrr")])
def test_cli_rejects_bad_config_fast_naming_the_field(override, expected, tmp_path) -> None:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launch.train_rm", override, f"run.dir={tmp_path}/run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.perf_counter() - start < 15


@pytest.mark.slow
@pytest.mark.full  # a learning curve
def test_ppo_against_the_reward_model_raises_its_score(built_rm, make_config) -> None:
    """PPO with the critic initialised from the RM (its `score` head becomes the value head)."""
    import statistics

    from launch.train import train
    from rl.log.run_log import read_metrics

    out, _ = built_rm
    cfg = make_config("algorithm=ppo", "reward=model", f"reward.functions.0.kwargs.path={out}/model",
                      f"algorithm.critic_init={out}/model", "run.steps=30",
                      "run.save_every=0", "run.save_final_model=false")
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    rm = [m["reward/rm_mean"] for m in metrics]
    first, last = statistics.fmean(rm[:8]), statistics.fmean(rm[-8:])
    print(f"RM score under PPO: first 8 steps {first:.3f} -> last 8 steps {last:.3f}")
    assert last > first, rm
    assert all(m["reward/errors_count"] == 0 for m in metrics)
