"""On-policy distillation against GRPO on the real model (issue 35.1).

1. The teacher: SmolLM2-135M-Instruct after the `math_chat` recipe (`python -m launch.train
   model=smollm2 task=math_chat`, `--teacher-steps` updates), its final model saved in
   `artifacts/opd/teacher/final_model` (kept: a second run of this benchmark reuses it).
2. The teacher's log-probs as the learner computes them (its own DeepSpeed engine, the micro-batch
   layouts the learner picks) against the teacher under plain transformers, fp32, on completions the
   student wrote for held-out prompts: max |diff| (target < 1e-3).
3. The student (the base model) trained `--steps` updates on the same prompts twice, by GRPO alone
   and by `algorithm=opd` with that teacher, held-out greedy accuracy (`eval/greedy_pass_frac`, the
   recipe's 200 test rows) every `--eval-every` steps: both curves, and whether OPD ends above GRPO.

    python -m bench.opd [--teacher-steps 40] [--steps 20] [--eval-every 5] [--distill-coef 1.0]
                        [--out bench/results/opd.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.machine import launch_train, machine_info, parse_flags, write_result

ROOT = Path("artifacts/opd")
RECIPE = ["model=smollm2", "task=math_chat", "run.save_every=0"]


def train(overrides: list[str], run_dir: Path) -> list[dict]:
    return launch_train([*RECIPE, *overrides], run_dir)


def curve(rows: list[dict]) -> list[tuple[int, float]]:
    return [(int(r["step"]), r["eval/greedy_pass_frac"]) for r in rows if "eval/greedy_pass_frac" in r]


def teacher_check(student: str, teacher: str, prompts: int = 8) -> dict:
    """The learner's teacher log-probs against plain transformers on the student's own greedy
    completions of held-out prompts (fp32)."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
    from rl.data.batch import build_train_batch
    from rl.data.types import Sample, ScoredSample
    from trainer.group import LearnerGroup
    from trainer.learner_setup import LearnerSpec
    from trainer.logprobs import token_logprobs

    tok = AutoTokenizer.from_pretrained(student)
    base = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    hf_teacher = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open("artifacts/math_chat/data/test.jsonl")][:prompts]
    scored = []
    for i, row in enumerate(rows):
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = base.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        scored.append(ScoredSample(Sample(ids, out, [0.0] * len(out), "length", 0, row["prompt"], "", i, 0), 0.0))
    batch = build_train_batch(scored, tok.pad_token_id, 0)
    algorithm = AlgorithmConfig(kl_coef=0.0, teacher_path=teacher, distill_coef=1.0)
    spec = LearnerSpec(ModelConfig(path=student, dtype="float32"), algorithm, TrainerConfig(micro_batch_size=len(batch)),
                       samples_per_step=len(batch), max_response_len=32, temperature=1.0, seed=0, threads=2)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        group = LearnerGroup(spec, 1, num_cpus=1)
        try:
            got = group.score(batch).teacher_logprobs
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
    mask = batch.loss_mask > 0
    worst = 0.0
    for i, s in enumerate(scored):
        ids = torch.tensor([s.sample.prompt_ids + s.sample.completion_ids])
        with torch.no_grad():
            want, _ = token_logprobs(hf_teacher, ids, torch.ones_like(ids))
        worst = max(worst, float((got[i][mask[i]] - want[0, len(s.sample.prompt_ids) - 1:]).abs().max()))
    return {"samples": len(scored), "tokens": int(mask.sum()), "max_abs_diff": worst}


def main(argv: list[str] | None = None) -> None:
    args = parse_flags(__doc__, argv, teacher_steps=40, steps=20, eval_every=5, distill_coef=1.0,
                       out="bench/results/opd.json")
    info = machine_info()
    teacher_dir = ROOT / "teacher"
    teacher = teacher_dir / "final_model"
    if not (teacher / "config.json").exists():
        rows = train([f"run.steps={args.teacher_steps}", f"eval.every_steps={args.teacher_steps}"], teacher_dir)
        print(f"teacher: held-out greedy {curve(rows)}", flush=True)
    teacher_curve = curve([json.loads(line) for line in open(teacher_dir / "metrics.jsonl")])
    from bench.models import real_model

    check = teacher_check(str(real_model("smollm2").resolve()), str(teacher.resolve()))
    print(f"teacher log-probs, learner vs transformers (fp32): max |diff| {check['max_abs_diff']:.2e} over "
          f"{check['tokens']} tokens", flush=True)
    common = [f"run.steps={args.steps}", f"eval.every_steps={args.eval_every}", "run.save_final_model=false"]
    curves = {}
    for name, extra in (("grpo", []), ("opd", ["algorithm=opd", f"algorithm.teacher_path={teacher.resolve()}",
                                               f"algorithm.distill_coef={args.distill_coef}"])):
        rows = train(common + extra, ROOT / f"student_{name}")
        curves[name] = curve(rows)
        kl = [round(r["distill/reverse_kl_nats"], 4) for r in rows if "distill/reverse_kl_nats" in r]
        print(f"{name}: held-out greedy {curves[name]}" + (f"; reverse KL to the teacher by step {kl}" if kl else ""),
              flush=True)
    beats = curves["opd"][-1][1] > curves["grpo"][-1][1]
    print(f"after {args.steps} updates: OPD {curves['opd'][-1][1]:.3f} vs GRPO {curves['grpo'][-1][1]:.3f} "
          f"({'OPD ahead' if beats else 'OPD NOT ahead'}); teacher {teacher_curve}")
    write_result(args.out, {"machine": info, "settings": vars(args), "teacher_curve": teacher_curve,
                            "teacher_logprob_check": check, "curves": curves, "opd_ahead": beats})


if __name__ == "__main__":
    sys.exit(main())
