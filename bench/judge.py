"""The LLM judge on the real model (issue 35.3): SmolLM2-135M-Instruct as a reference-guided judge
(`reward=judge`, its default template: the question, the reference answer, the student's answer,
"yes or no") of SmolLM2's own greedy answers to `--rows` held-out `math_chat` problems, against
`math_answer` (math-verify) as the truth.

- `--verdict yes_no` reads the judge's greedy reply: agreement, the confusion counts, unparsable
  replies; `--verdict yes_prob` its odds of "yes" over "no": the AUROC of that score against the
  truth, and the agreement of "yes_prob > 0.5".
- `--judge base` is SmolLM2-135M-Instruct as shipped. `--judge trained` first fine-tunes it into a
  verifier (generative-verifier style: Zhang et al. 2024): SmolLM2's sampled answers to the first
  `--judge-rows` *training* prompts (2 each, temperature 0.7), labelled by math_answer, balanced,
  each the judge's template as the user turn and "yes"/"no" as the reply, trained by
  `launch.train_sft` (kept in artifacts/judge/trained/final_model; a second run reuses it). The
  held-out rows it is measured on are never in its data.
- `--steps` > 0: a short run of the `math_chat` recipe with the judge as the only reward (math_answer
  logged at weight 0) and its held-out greedy accuracy (`eval/greedy_pass_frac`, checked by
  math_answer) before and after.

    python -m bench.judge [--rows 200] [--steps 10] [--template default|few_shot] [--verdict yes_no|yes_prob]
                          [--judge base|trained] [--judge-rows 1000] [--out bench/results/judge.json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import launch_train, machine_info, write_result

FEW_SHOT = ("Decide whether the student's final answer equals the reference answer.\n\n"
            "Reference answer: 12\nStudent's answer: 5 + 7 = 12. The answer is 12.\nSame answer? yes\n\n"
            "Reference answer: 9\nStudent's answer: 3 * 4 = 12, so the answer is 12.\nSame answer? no\n\n"
            "Reference answer: {answer}\nStudent's answer: {completion}\nSame answer?")
TEMPLATES = {"default": None, "few_shot": FEW_SHOT}  # None: reward/judge.py DEFAULT_TEMPLATE
TRAINED = Path("artifacts/judge/trained")
DATA = Path("artifacts/math_chat/data")


def auroc(truth: list[float], scores: list[float]) -> float:
    """The chance a right answer scores above a wrong one (ties count half): Mann-Whitney's U / (n1 n0)."""
    right = [s for t, s in zip(truth, scores) if t]
    wrong = [s for t, s in zip(truth, scores) if not t]
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / max(len(right) * len(wrong), 1)


def answers(rows: list[dict], samples: int = 1, temperature: float = 0.0, batch: int = 32,
            path: str | None = None) -> list[list[str]]:
    """The answers of SmolLM2 (or the model at `path`) to each row's prompt through its chat
    template, fp32: greedy, or `samples` sampled."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.models import real_model

    path = path or str(real_model("smollm2").resolve())
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    out_texts: list[list[str]] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                         tokenize=False) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else \
            {"do_sample": False}
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=48, num_return_sequences=samples, pad_token_id=tok.pad_token_id,
                                 **sampling)
        decoded = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out_texts += [decoded[i * samples : (i + 1) * samples] for i in range(len(chunk))]
    return out_texts


def judge_data(rows: int, template: str) -> dict:
    """SmolLM2's sampled answers to the first `rows` training prompts, labelled by math_answer and
    balanced, as chat rows for launch.train_sft (see the module doc). Kept: reused when present."""
    from reward.builtin import math_answer

    summary = TRAINED / "judge_data_summary.json"
    if summary.exists():
        return json.loads(summary.read_text())
    data = [json.loads(line) for line in open(DATA / "train.jsonl")][:rows]
    sampled = answers(data, samples=2, temperature=0.7)
    pairs = [(r, a) for r, group in zip(data, sampled) for a in group]
    truth = math_answer([r["prompt"] for r, _ in pairs], [a for _, a in pairs], [r["answer"] for r, _ in pairs])
    examples = [({"messages": [{"role": "user", "content": template.format(prompt=r["prompt"], answer=r["answer"],
                                                                             completion=a)},
                               {"role": "assistant", "content": "yes" if t else "no"}]}, t)
                for (r, a), t in zip(pairs, truth)]
    yes = [e for e, t in examples if t]
    no = [e for e, t in examples if not t]
    keep = min(len(yes), len(no))
    rng = random.Random(0)
    balanced = rng.sample(yes, keep) + rng.sample(no, keep)
    rng.shuffle(balanced)
    TRAINED.mkdir(parents=True, exist_ok=True)
    with open(TRAINED / "judge_train.jsonl", "w") as f:
        for e in balanced:
            f.write(json.dumps(e) + "\n")
    info = {"train_prompts": rows, "sampled_answers": len(pairs), "right_frac": sum(truth) / len(truth),
            "examples_balanced": len(balanced)}
    summary.write_text(json.dumps(info))
    return info


def train_judge(rows: int, template: str) -> dict:
    """Fine-tune SmolLM2 into a verifier on `judge_data` (bf16: 7x the fp32 matmul rate on these
    CPUs), 3 epochs, 5% of the rows held out for the loss. Kept: reused when present."""
    from bench.models import real_model

    info = judge_data(rows, template)
    if not (TRAINED / "final_model" / "config.json").exists():
        cmd = [sys.executable, "-m", "launch.train_sft", f"model.path={real_model('smollm2').resolve()}",
               "model.dtype=bfloat16", "data.format=chat", f"data.train_files=[{TRAINED / 'judge_train.jsonl'}]",
               "data.test_files=[]", "data.test_fraction=0.05", "data.max_length=256", "algorithm.epochs=3",
               "algorithm.batch_size=32", "algorithm.lr=3.0e-5", "algorithm.lr_warmup_steps=5",
               "trainer.micro_batch_size=16", "trainer.threads=2", f"run.dir={TRAINED / 'sft'}"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        (TRAINED / "sft" / "final_model").rename(TRAINED / "final_model")
    losses = [json.loads(line) for line in open(TRAINED / "sft" / "metrics.jsonl")]
    evals = [(r["step"], round(r["eval/loss"], 4)) for r in losses if "eval/loss" in r]
    return info | {"sft_eval_loss": evals}


def held_out(rows: int, path: str | None = None) -> tuple[list[dict], list[str], list[float]]:
    """The first `rows` held-out rows, SmolLM2's (or the model at `path`'s) greedy answers to them,
    and whether each is right by math_answer: what the judge stands in for."""
    from reward.builtin import math_answer

    data = [json.loads(line) for line in open(DATA / "test.jsonl")][:rows]
    said = [group[0] for group in answers(data, path=path)]
    return data, said, math_answer([r["prompt"] for r in data], said, [r["answer"] for r in data])


def agreement(judge_path: str, rows: int, template: str, verdict: str = "yes_no", batch: int = 32) -> dict:
    """The judge against math_answer on SmolLM2's greedy answers to the first `rows` held-out prompts."""
    from reward.judge import _replies_for, _yes_probs_for, parse_verdict

    data, said, truth = held_out(rows)
    judge_inputs = [template.format(prompt=r["prompt"], answer=r["answer"], completion=a) for r, a in zip(data, said)]
    result: dict = {"rows": len(data), "truth_correct_frac": sum(truth) / len(truth)}
    if verdict == "yes_prob":
        probs = _yes_probs_for(judge_path, "float32", judge_inputs, batch)
        verdicts: list[float | None] = [float(p > 0.5) for p in probs]
        result |= {"auroc": auroc(truth, probs), "mean_yes_prob": {
            "right": sum(p for t, p in zip(truth, probs) if t) / max(sum(truth), 1),
            "wrong": sum(p for t, p in zip(truth, probs) if not t) / max(len(truth) - sum(truth), 1)}}
        shown = [round(p, 4) for p in probs]
    else:
        shown = _replies_for(judge_path, "float32", judge_inputs, 4, batch)
        verdicts = []
        for reply in shown:
            try:
                verdicts.append(parse_verdict(reply, "yes_no"))
            except ValueError:
                verdicts.append(None)
    pairs = [(t, v) for t, v in zip(truth, verdicts) if v is not None]
    result |= {"unparsable": verdicts.count(None), "agreement": sum(t == v for t, v in pairs) / max(len(pairs), 1),
               "judge_yes_frac": sum(v for _, v in pairs) / max(len(pairs), 1),
               "counts": {f"truth {int(t)} judge {int(v)}": sum(1 for p in pairs if p == (t, v))
                          for t in (0.0, 1.0) for v in (0.0, 1.0)},
               "examples": [{"answer": a[:120], "truth": t, "judge": j} for a, t, j in list(zip(said, truth, shown))[:5]]}
    return result


def hydra_value(value) -> str:
    """`value` (str, number, bool, list, dict) as a Hydra override's value: strings quoted."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return json.dumps(value)


def short_run(steps: int, verdict: str, judge_path: str, template: str | None, rows: int, before: float) -> dict:
    """The recipe with the judge as its only reward. The run's own evaluation scores held-out
    answers with the training reward (the judge), so the accuracy after is measured here instead:
    the final model's greedy answers checked by math_answer (`before`: the base model's, measured
    the same way by `agreement`)."""
    with tempfile.TemporaryDirectory() as tmp:
        # task=math_chat sets reward.functions itself (a task comes last in the defaults), so the
        # judge is given as the functions of configs/reward/judge.yaml, explicitly
        kwargs = {"path": judge_path, "verdict": verdict, "max_new_tokens": 4, "batch_size": 32, "dtype": "bfloat16",
                  "threads": 1}
        if template is not None:
            kwargs["template"] = template
        functions = [{"fn": "reward.judge:score", "weight": 1.0, "name": "judge", "kwargs": kwargs},
                     {"fn": "reward.builtin:math_answer", "weight": 0.0}]
        metrics = launch_train(["model=smollm2", "task=math_chat", f"reward.functions={hydra_value(functions)}",
                                "reward.timeout_s=600", f"run.steps={steps}", f"eval.every_steps={steps}",
                                "run.save_every=0"], f"{tmp}/run")
        _, _, truth = held_out(rows, f"{tmp}/run/final_model")
    judged = [(r["step"], r["eval/greedy_mean_reward"]) for r in metrics if "eval/greedy_mean_reward" in r]
    return {"held_out_greedy": [(0, before), (steps, sum(truth) / len(truth))], "held_out_judge_mean": judged,
            "judge_reward": [r.get("reward/judge_mean") for r in metrics if "reward/mean" in r],
            "math_answer": [r.get("reward/math_answer_mean") for r in metrics if "reward/mean" in r],
            "errors": [r.get("reward/errors_count") for r in metrics if "reward/mean" in r]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--template", choices=list(TEMPLATES), default="default")
    parser.add_argument("--verdict", choices=["yes_no", "yes_prob"], default="yes_no")
    parser.add_argument("--judge", choices=["base", "trained"], default="base")
    parser.add_argument("--judge-rows", type=int, default=1000)
    parser.add_argument("--out", default="bench/results/judge.json")
    args = parser.parse_args(argv)
    from bench.models import real_model
    from reward.judge import DEFAULT_TEMPLATE

    info = machine_info()
    template = TEMPLATES[args.template] or DEFAULT_TEMPLATE
    trained = train_judge(args.judge_rows, template) if args.judge == "trained" else None
    judge_path = str((TRAINED / "final_model").resolve()) if trained else str(real_model("smollm2").resolve())
    agree = agreement(judge_path, args.rows, template, args.verdict)
    print(f"judge ({args.judge}) vs math_answer on {agree['rows']} held-out answers: agreement {agree['agreement']:.3f} "
          f"(unparsable {agree['unparsable']}; math_answer says {agree['truth_correct_frac']:.3f} right, the judge "
          f"says yes to {agree['judge_yes_frac']:.3f}); {agree['counts']}"
          + (f"; AUROC {agree['auroc']:.3f}, mean yes_prob right {agree['mean_yes_prob']['right']:.3f} vs wrong "
             f"{agree['mean_yes_prob']['wrong']:.3f}" if "auroc" in agree else ""), flush=True)
    run = short_run(args.steps, args.verdict, judge_path, TEMPLATES[args.template], args.rows,
                    agree["truth_correct_frac"]) if args.steps > 0 else None
    if run:
        print(f"short run with the judge as reward: held-out greedy accuracy by math_answer {run['held_out_greedy']}; "
              f"the judge's mean held-out reward {run['held_out_judge_mean']}; judge reward by step "
              f"{run['judge_reward']}; math_answer by step {run['math_answer']}", flush=True)
    write_result(args.out, {"machine": info, "settings": vars(args), "judge_training": trained, "agreement": agree,
                            "short_run": run})


if __name__ == "__main__":
    sys.exit(main())
