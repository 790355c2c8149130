"""On-policy distillation (algorithm=opd; Agarwal et al. 2024 "On-policy distillation of language
models"; Thinking Machines' "On-policy distillation" 2025; verl docs/algo/opd.md; slime; NeMo-RL
MOPD): the student samples, a frozen teacher scores every sampled token, and the per-token
advantage is the negative reverse KL estimate on that token, log pi_teacher(y_t) - log
pi_student(y_t): positive where the teacher likes the student's choice more than the student did.
No discounting (each token is its own step). Mixed with the task's advantage by `coef`. Pure tensors.
"""

from __future__ import annotations

import torch


def distill_advantages(task: torch.Tensor, teacher_lp: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor,
                       coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T-1] advantages (1 - coef) x `task` + coef x (teacher_lp - student_lp), zero off `mask`,
    and the reverse KL (nats per token, the student's log-probs minus the teacher's) as a metric."""
    mask = mask.to(torch.float32)
    reverse_kl = (student_lp.float() - teacher_lp.float()) * mask
    tokens = mask.sum().clamp(min=1.0)
    advantages = ((1.0 - coef) * task.float() - coef * reverse_kl) * mask
    return advantages, {"distill/reverse_kl_nats": float(reverse_kl.sum() / tokens),
                        "distill/teacher_logprob_nats": float((teacher_lp.float() * mask).sum() / tokens)}
