"""On-policy distillation (rl/algo/distill.py, algorithm=opd): per-token advantages by hand, mixed
with the task's; the config refused before Ray without a teacher, with an unused one, and with a
teacher whose tokenizer differs (naming both paths)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from rl.algo.distill import distill_advantages
from rl.algo.estimate import estimate_advantages
from rl.config.schema import AlgorithmConfig


def test_the_advantage_is_the_teacher_minus_the_student_per_token() -> None:
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    student = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    task = torch.tensor([[2.0, 2.0, 0.0], [-2.0, -2.0, 0.0]])
    adv, metrics = distill_advantages(task, teacher, student, mask, coef=1.0)
    assert adv.tolist() == [[0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]
    # reverse KL estimate: student - teacher over the 4 tokens: (-0.5 + 1 + 2 + 0) / 4
    assert metrics["distill/reverse_kl_nats"] == pytest.approx(2.5 / 4)
    assert metrics["distill/teacher_logprob_nats"] == pytest.approx(-7.0 / 4)
    half, _ = distill_advantages(task, teacher, student, mask, coef=0.5)
    assert half.tolist() == [[1.25, 0.5, 0.0], [-2.0, -1.0, 0.0]]  # 0.5 x task + 0.5 x distillation


def test_estimate_mixes_the_task_advantage_with_the_teachers() -> None:
    rewards, valid, groups = torch.tensor([1.0, 0.0]), torch.tensor([True, True]), torch.tensor([0, 0])
    mask = torch.ones(2, 2)
    teacher, student = torch.full((2, 2), -1.0), torch.full((2, 2), -1.5)
    plain = estimate_advantages(AlgorithmConfig(), rewards, valid, groups, mask)
    mixed = estimate_advantages(AlgorithmConfig(distill_coef=0.25, teacher_path="t"), rewards, valid, groups, mask,
                                teacher_logprobs=teacher, student_logprobs=student)
    assert torch.allclose(mixed.advantages, 0.75 * plain.advantages + 0.25 * 0.5)
    assert mixed.metrics["distill/reverse_kl_nats"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="teacher's and the student's log-probs"):
        estimate_advantages(AlgorithmConfig(distill_coef=1.0, teacher_path="t"), rewards, valid, groups, mask)


@pytest.mark.parametrize("overrides,expected", [
    (["algorithm=opd"], "algorithm.distill_coef=1.0 distils from a teacher: set algorithm.teacher_path="),
    (["algorithm.teacher_path=/x"], "algorithm.teacher_path='/x' loads a teacher that algorithm.distill_coef=0"),
])
def test_a_teacher_without_weight_or_a_weight_without_teacher_is_refused(make_config, overrides, expected) -> None:
    from rl.config.schema import ConfigError
    from rl.config.validation import validate

    with pytest.raises(ConfigError, match=expected):
        validate(make_config(*overrides))


def test_a_teacher_with_another_tokenizer_is_refused_before_ray_naming_both(tiny_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    from launch.checks import require_same_tokenizer
    from rl.config.schema import ConfigError

    student = f"{tiny_dir}/model"
    same = tmp_path / "same"
    shutil.copytree(student, same)
    require_same_tokenizer(student, str(same))  # a copy: accepted
    other = tmp_path / "other"
    shutil.copytree(student, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tool_call>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match=rf"algorithm.teacher_path='{other}' has another tokenizer than "
                                          rf"model.path='{student}' \(\d+ tokens against \d+; e.g. '<tool_call>'="):
        require_same_tokenizer(student, str(other))


@pytest.mark.slow
@pytest.mark.full  # a learning curve
def test_a_student_distilled_on_policy_moves_towards_its_teacher(make_config, tiny_dir, tmp_path) -> None:
    """algorithm=opd on the tiny model with a teacher of the same tokenizer (the tiny model with its
    weights perturbed): the teacher's log-probs reach the advantages and the reverse KL falls."""
    import statistics

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launch.train import train
    from rl.log.run_log import read_metrics

    teacher = AutoModelForCausalLM.from_pretrained(f"{tiny_dir}/model")
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(f"{tiny_dir}/model").save_pretrained(tmp_path / "teacher")
    cfg = make_config("algorithm=opd", f"algorithm.teacher_path={tmp_path / 'teacher'}", "run.steps=8",
                      "task.prompts_per_step=16", "run.save_every=0", "run.save_final_model=false")
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    kl = [m["distill/reverse_kl_nats"] for m in metrics]
    assert len(kl) == 8 and all(math.isfinite(k) for k in kl), kl  # finite (not NaN, not inf), logged every step
    assert statistics.fmean(kl[-3:]) < statistics.fmean(kl[:3]), kl
