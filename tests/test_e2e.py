"""End-to-end runs of `launch.train` on the real stack: local Ray, vLLM (CPU), DeepSpeed, gloo sync."""

from __future__ import annotations

import json
import math
import os
import statistics

import pytest
import torch

from launch.train import train
from rl.run_log import read_metrics

pytestmark = pytest.mark.slow


def _window_noise(values: list[float]) -> float:
    return statistics.pstdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def test_default_run_improves_reward_and_saves_a_loadable_model(make_config):
    """The default job at reduced length: reward rises by more than its step-to-step noise."""
    cfg = make_config("run.steps=40")
    summary = train(cfg)
    metrics = read_metrics(cfg.run.dir)
    rewards = [m["reward/mean"] for m in metrics]
    first, last = rewards[:8], rewards[-8:]
    noise = math.sqrt(_window_noise(first) ** 2 + _window_noise(last) ** 2)
    gain = statistics.fmean(last) - statistics.fmean(first)
    print(f"reward first 8 steps {statistics.fmean(first):.3f} -> last 8 steps {statistics.fmean(last):.3f}, "
          f"gain {gain:.3f}, noise {noise:.3f}")
    assert gain > 2 * noise and gain > 0.03, rewards
    # after the first sync, learner and vLLM agree on the log-probs of the sampled tokens
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics[1:])
    assert all(m["policy/version_count"] == i + 1 for i, m in enumerate(metrics))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    tok = AutoTokenizer.from_pretrained(summary["final_model"])
    out = model.generate(**tok("12+34=", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(tok("12+34=").input_ids)
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json"):
        assert os.path.getsize(os.path.join(cfg.run.dir, name)) > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(cfg.run.dir, "tb")))


FLAKY_REWARD = '''
def flaky(prompts, completions, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        if c.strip().endswith("7"):
            raise ValueError(f"refusing {c!r}")
        out.append(float(c.strip() == a))
    return out
'''


def test_zero3_two_ranks_sync_and_a_failing_user_reward(make_config, tmp_path):
    """ZeRO-3 over 2 DeepSpeed ranks with gradient accumulation, 2 epochs x 2 mini-batches, weights
    gathered and broadcast to 2 vLLM workers over one gloo group; a user reward file outside the repo raises for some
    samples: they are recorded, the run goes on."""
    reward_file = tmp_path / "outside" / "my_reward.py"
    reward_file.parent.mkdir()
    reward_file.write_text(FLAKY_REWARD)
    cfg = make_config(
        "run.steps=3", "trainer.zero_stage=3", "trainer.num_workers=2", "task.prompts_per_step=16",
        "rollout.num_workers=2",
        "algorithm.kl_coef=0.01", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
        "trainer.micro_batch_size=16", f'reward.functions=[{{fn: "{reward_file}:flaky"}}]',
    )
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 3
    assert all(m["actor/updates_count"] == 4 for m in metrics)  # 2 epochs x 2 mini-batches
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics)
    assert metrics[-1]["actor/kl_nats"] > 0  # the policy moved away from the reference...
    assert metrics[1]["sync/weights_mb"] > 0  # ...and vLLM sampled from the moved policy
    assert sum(m["reward/errors_count"] for m in metrics) > 0
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "samples.jsonl"))]
    errors = [r for r in rows if r["error"]]
    assert errors and all("ValueError: refusing" in r["error"] and r["reward"] is None for r in errors)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(os.path.join(cfg.run.dir, "final_model"))
    assert all(torch.isfinite(p).all() for p in saved.parameters())


def test_hf_backend_zero1_two_ranks_object_store_sync(make_config):
    """The transformers backend behind the same protocol, ZeRO-1, weights through the Ray object store."""
    cfg = make_config(
        "rollout=hf", "run.steps=2", "trainer.num_workers=2", "trainer.zero_stage=1",
        "trainer.weight_sync=object_store",
        "task.prompts_per_step=8", "run.save_final_model=false",
    )
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2
    assert metrics[1]["sync/logprob_abs_diff"] < 1e-3
    assert 0 <= metrics[1]["reward/mean"] <= 1.1


def test_any_local_hf_folder_works_as_model_path(make_config, tiny_dir, tmp_path):
    """Not only the built-in model: a Qwen2-architecture folder (random init, its own config) trains
    through vLLM and DeepSpeed the same way when named by model.path."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(f"{tiny_dir}/model")
    folder = tmp_path / "qwen2-tiny"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = make_config(f"model.path={folder}", "run.steps=2", "task.prompts_per_step=8")
    summary = train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert metrics[1]["sync/logprob_abs_diff"] < 1e-3  # tied embeddings survive the sync too
    from transformers import AutoModelForCausalLM

    assert isinstance(AutoModelForCausalLM.from_pretrained(summary["final_model"]), Qwen2ForCausalLM)
