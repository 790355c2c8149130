"""The DeepSpeed learner on its own: an update raises the log-prob of positively-advantaged
completions and lowers the negative ones, for every ZeRO stage, at world size 1 and 2."""

from __future__ import annotations

import pytest
import torch

from rl.batch import build_train_batch
from rl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from rl.types import Sample, ScoredSample
from trainer.group import LearnerGroup
from trainer.learner import LearnerSpec
from trainer.logprobs import token_logprobs

pytestmark = pytest.mark.slow


def _spec(model_path: str, stage: int, rows: int) -> LearnerSpec:
    algorithm = AlgorithmConfig(mini_batches=1, ppo_epochs=1, lr=1e-3, lr_warmup_steps=1, weight_decay=0.0,
                                max_grad_norm=1.0, policy_loss="ppo_clip", loss_agg="token_mean", clip_eps_low=0.2,
                                clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3")
    return LearnerSpec(ModelConfig(path=model_path, dtype="float32"), algorithm,
                       TrainerConfig(zero_stage=stage, micro_batch_size=2), samples_per_step=rows,
                       max_response_len=8, temperature=1.0, seed=0, threads=1)


def _batch(tok, model):
    prompts = ["12+34=", "56+7=", "8+80=", "40+40="]
    completions = ["46", "63", "99", "11"]
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    scored = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        p_ids = tok(p).input_ids
        c_ids = tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        s = Sample(p_ids, c_ids, lp[0, len(p_ids) - 1 :].tolist(), "stop", 0, p, c, i, 0)
        scored.append(ScoredSample(s, float(advantages[i]), {}))
    batch = build_train_batch(scored, tok.pad_token_id, 0)
    batch.advantages = advantages[:, None] * batch.loss_mask
    return batch, scored


def _seq_logprob(model, s: Sample) -> float:
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return float(lp[0, len(s.prompt_ids) - 1 :].sum())


@pytest.mark.parametrize("stage,world", [(2, 1), (3, 2), (1, 2)])
def test_update_follows_the_advantages(ray_local, tiny_dir, tmp_path, stage, world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = f"{tiny_dir}/model"
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    batch, scored = _batch(tok, model)
    group = LearnerGroup(_spec(path, stage, len(batch)), world, num_cpus=1, weight_sync_method="object_store")
    try:
        metrics = group.train_step(batch, step=0)
        group.save_pretrained(str(tmp_path / "after"))
    finally:
        group.shutdown()
    assert metrics["sync/logprob_abs_diff"] < 1e-4  # learner and reference computation agree
    assert metrics["actor/updates_count"] == 1 and metrics["actor/grad_norm"] > 0
    after = AutoModelForCausalLM.from_pretrained(str(tmp_path / "after")).eval()
    deltas = [_seq_logprob(after, s.sample) - _seq_logprob(model, s.sample) for s in scored]
    # Adam's first update is a sign step per weight, so one sample of a group may move against its
    # advantage; what the update must do is raise the advantage-weighted log-likelihood, i.e. move
    # the positive group up and the negative group down on average.
    assert deltas[0] + deltas[1] > 0, deltas
    assert deltas[2] + deltas[3] < 0, deltas
