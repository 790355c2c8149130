"""The LLM judge on the real model (issue 35.3): SmolLM2-135M-Instruct as a reference-guided judge
(`reward=judge`, its default template: the question, the reference answer, the student's answer,
"yes or no") of SmolLM2's own greedy answers to `--rows` held-out `math_chat` problems, against
`math_answer` (math-verify) as the truth: agreement, the confusion counts and unparsable replies.
Then (`--steps` > 0) a short run of the recipe with the judge as the reward, and its held-out
greedy accuracy (`eval/greedy_pass_frac`, checked by math_answer) before and after.

    python -m bench.judge [--rows 200] [--steps 10] [--template default|few_shot] [--out bench/results/judge.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from bench.machine import machine_info, write_result


FEW_SHOT = ("Decide whether the student's final answer equals the reference answer.\n\n"
            "Reference answer: 12\nStudent's answer: 5 + 7 = 12. The answer is 12.\nSame answer? yes\n\n"
            "Reference answer: 9\nStudent's answer: 3 * 4 = 12, so the answer is 12.\nSame answer? no\n\n"
            "Reference answer: {answer}\nStudent's answer: {completion}\nSame answer?")
TEMPLATES = {"default": None, "few_shot": FEW_SHOT}  # None: reward/judge.py DEFAULT_TEMPLATE


def agreement(rows: int, batch: int = 32, template: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.models import real_model
    from reward.builtin import math_answer
    from reward.judge import parse_verdict, _replies_for, DEFAULT_TEMPLATE

    path = str(real_model("smollm2").resolve())
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    data = [json.loads(line) for line in open("artifacts/math_chat/data/test.jsonl")][:rows]
    answers = []
    for start in range(0, len(data), batch):
        chunk = data[start : start + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                         tokenize=False) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
        answers += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    truth = math_answer([r["prompt"] for r in data], answers, [r["answer"] for r in data])
    judge_inputs = [(template or DEFAULT_TEMPLATE).format(prompt=r["prompt"], answer=r["answer"], completion=a)
                    for r, a in zip(data, answers)]
    replies = _replies_for(path, "float32", judge_inputs, 4, batch)
    verdicts = []
    for reply in replies:
        try:
            verdicts.append(parse_verdict(reply, "yes_no"))
        except ValueError:
            verdicts.append(None)
    pairs = [(t, v) for t, v in zip(truth, verdicts) if v is not None]
    counts = {f"truth {int(t)} judge {int(v)}": sum(1 for p in pairs if p == (t, v)) for t in (0.0, 1.0) for v in (0.0, 1.0)}
    return {"rows": len(data), "truth_correct_frac": sum(truth) / len(truth), "unparsable": verdicts.count(None),
            "agreement": sum(t == v for t, v in pairs) / max(len(pairs), 1), "judge_yes_frac":
            sum(v for _, v in pairs) / max(len(pairs), 1), "counts": counts,
            "examples": [{"answer": a[:120], "truth": t, "reply": r} for a, t, r in list(zip(answers, truth, replies))[:5]]}


def short_run(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # task=math_chat sets reward.functions itself (a task comes last in the defaults), so the
        # judge is given as the functions of configs/reward/judge.yaml, explicitly
        judge = ("{fn: reward.judge:score, weight: 1.0, name: judge, kwargs: {path: artifacts/smollm2-135m-instruct, "
                 "verdict: yes_no, max_new_tokens: 4, batch_size: 32, dtype: float32, threads: 1}}")
        cmd = [sys.executable, "-m", "launch.train", "model=smollm2", "task=math_chat",
               f"reward.functions=[{judge}, {{fn: 'reward.builtin:math_answer', weight: 0.0}}]", "reward.timeout_s=600",
               f"run.steps={steps}", f"eval.every_steps={steps}", "run.save_every=0", "run.save_final_model=false",
               f"run.dir={tmp}/run"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    evals = [(r["step"], r["eval/greedy_pass_frac"]) for r in rows if "eval/greedy_pass_frac" in r]
    return {"held_out_greedy": evals, "judge_reward": [r.get("reward/judge_mean") for r in rows if "reward/mean" in r],
            "math_answer": [r.get("reward/math_answer_mean") for r in rows if "reward/mean" in r],
            "errors": [r.get("reward/errors_count") for r in rows if "reward/mean" in r]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--template", choices=list(TEMPLATES), default="default")
    parser.add_argument("--out", default="bench/results/judge.json")
    args = parser.parse_args(argv)
    info = machine_info()
    agree = agreement(args.rows, template=TEMPLATES[args.template])
    print(f"judge vs math_answer on {agree['rows']} held-out answers: agreement {agree['agreement']:.3f} "
          f"(unparsable {agree['unparsable']}; math_answer says {agree['truth_correct_frac']:.3f} right, the judge "
          f"says yes to {agree['judge_yes_frac']:.3f}); {agree['counts']}", flush=True)
    run = short_run(args.steps) if args.steps > 0 else None
    if run:
        print(f"short run with the judge as reward: held-out greedy {run['held_out_greedy']}; judge reward by step "
              f"{run['judge_reward']}; math_answer by step {run['math_answer']}", flush=True)
    write_result(args.out, {"machine": info, "settings": vars(args), "agreement": agree, "short_run": run})


if __name__ == "__main__":
    sys.exit(main())
