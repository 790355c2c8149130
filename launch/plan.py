"""`python -m launch.plan [same overrides as launch.train]`: what the run will hold in memory per role,
whether it fits the machine (or the declared GPUs), and what a step costs, before anything starts.

The config is composed from `configs/train.yaml` with the overrides, exactly as `launch.train`
composes it, and validated the same way (`rl.config.schema.validate`); of the model only `config.json`
is read. The arithmetic is `rl/plan/memory_plan.py`; this module detects the hardware and prints.
Exit code 0 when the run fits, 2 (with one `error:` line naming the fix) when it does not.
`launch.train` runs the same check (`preflight`) before Ray starts; `cluster.preflight=false` skips it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import statistics
import shutil
import subprocess
import sys
from typing import Any

from launch.cli import INPUT_ERRORS, fail
from launch.model_files import require_model
from rl.config.schema import ConfigError
from rl.plan.memory_plan import GIB, ModelShape, Plan, Settings, find_fix, make_plan, refusal
from rl.plan.step_time import Host, Lengths, predict_step


def host_memory_bytes() -> float:
    """RAM of this machine (psutil, else sysconf)."""
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except ImportError:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def gpu_memory_bytes() -> float:
    """Memory of this machine's first GPU by nvidia-smi (no torch import), 0 when there is none."""
    if not shutil.which("nvidia-smi"):
        return 0.0
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return float(out[0]) * 2**20 if out else 0.0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0.0


def capacities(cfg: Any, s: Settings) -> tuple[float, float]:
    """(host RAM, one GPU's memory) in bytes: the config's, else detected here; 0 = unknown. On a
    Ray cluster (`cluster.address`) this machine's RAM says nothing about the nodes'."""
    host = s.memory_gib * GIB or (0.0 if cfg.cluster.address else host_memory_bytes())
    gpu = s.gpu_memory_gib * GIB or (gpu_memory_bytes() if s.on_gpu else 0.0)
    return host, gpu


def gpu_name() -> str:
    """The first GPU's name by nvidia-smi (no torch import), "" when there is none."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.splitlines()
        return out[0].strip() if out else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_matmul_tflops(dtype) -> float:
    """The best of eight short probes of 1024-square matmuls in `dtype` (~0.5 s, at most 1 s): on a
    shared host (oneDNN bf16 most of all) the speed varies by second and by size, and this size
    varies least (docs/benchmarks.md); a probe that shares the cores with another process (a run
    still shutting down) reads low, the best one does not."""
    from rl.plan.flops import measure_matmul_tflops

    return measure_matmul_tflops(dtype, size=1024, seconds=0.06, windows=8, budget_s=1.0)


def host_speeds(cfg: Any, s: Settings) -> tuple[Host | None, str]:
    """The speeds the step prediction uses: GPU roles, the card's datasheet peak and bandwidth
    (`cluster.peak_tflops` overrides the peak); CPU roles, measured in this process (a ~0.5 s
    probe of matmuls in the run's dtype and of memory copies). Also says why there is none."""
    from rl.plan.flops import DATASHEET_GBPS, DATASHEET_TFLOPS, datasheet_card, memory_bandwidth_gbs

    if s.on_gpu:
        name = gpu_name()
        card = datasheet_card(name) if name else None
        if card is None:
            return None, (f"no step prediction: the GPU ({name or 'not on this machine'}) is not in the datasheet "
                          "table (rl/plan/flops.py)")
        bf16, _, fp32 = DATASHEET_TFLOPS[card]
        peak = s.peak_tflops or (bf16 if s.dtype == "bfloat16" else fp32)
        return Host(peak, DATASHEET_GBPS[card], f"{card} datasheet"
                    + (", cluster.peak_tflops" if s.peak_tflops else "")), ""
    import torch

    peak = s.peak_tflops or cpu_matmul_tflops(getattr(torch, s.dtype))
    where = "on this machine, not the cluster's nodes, " if cfg.cluster.address else ""
    return Host(peak, memory_bandwidth_gbs(repeats=3), f"measured {where}in this process"
                + (" (peak: cluster.peak_tflops)" if s.peak_tflops else "")), ""


def last_run_lengths(run_dir: str) -> Lengths | None:
    """The lengths a run in `run_dir` logged (metrics.jsonl, medians over its steps), if any."""
    import json

    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    try:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if "rollout/prompt_len_tokens" in row:
                    rows.append(row)
    except (OSError, ValueError):
        return None
    if not rows:
        return None
    med = lambda k: float(statistics.median(r[k] for r in rows))  # noqa: E731
    return Lengths(med("rollout/prompt_len_tokens"), med("rollout/completion_len_tokens"),
                   med("rollout/completion_len_max_tokens"), f"the {len(rows)} steps logged in {path}")


def prompt_tokens_mean(cfg: Any, rows: int = 256) -> float | None:
    """The mean length in tokens of the first `rows` prompts of task.train_files, as the run
    renders them (chat template), or None when they cannot be read here."""
    try:
        from transformers import AutoTokenizer

        from rl.data.dataset import PromptDataset

        budget = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
        data = PromptDataset(cfg.task.train_files, cfg.task.prompt_key, AutoTokenizer.from_pretrained(cfg.model.path),
                             cfg.run.seed, budget, chat_template=cfg.task.chat_template,
                             system_prompt=cfg.task.system_prompt)
        ids = data.encode(data.table[:rows][cfg.task.prompt_key])
        return sum(map(len, ids)) / max(len(ids), 1)
    except Exception:  # noqa: BLE001 - a prediction is a hint; load_inputs reports bad data properly
        return None


def run_lengths(cfg: Any, s: Settings) -> Lengths:
    """The last run's lengths (run.dir), else the data's prompts and a prior on completions:
    half of rollout.max_new_tokens per model turn on average, the longest at the cap."""
    last = last_run_lengths(cfg.run.dir)
    if last is not None:
        return last
    cap = float(s.max_new_tokens * s.max_turns)
    prompt = prompt_tokens_mean(cfg)
    source = "completions: half of rollout.max_new_tokens on average, the longest at it (no earlier run in run.dir)"
    if prompt is None:
        return Lengths((s.max_model_len - cap) / 2, cap / 2, cap, "prompts: half their budget (data not read); " + source)
    return Lengths(prompt, cap / 2, cap, "prompts: task.train_files; " + source)


def plan_run(cfg: Any) -> tuple[Plan, tuple[list[str], Plan] | None]:
    """The plan of a validated config whose model folder exists, and a fix when it does not fit;
    a run that fits gets its step time predicted (`rl.plan.step_time.predict_step`)."""
    shape = ModelShape.from_config(require_model(cfg.model.path))
    s = Settings.from_config(cfg)
    if cfg.algorithm.get("teacher_path"):  # on-policy distillation: the teacher's weights beside the policy's
        teacher = ModelShape.from_config(require_model(cfg.algorithm.teacher_path, "algorithm.teacher_path"))
        s = dataclasses.replace(s, teacher_params=teacher.params())
    host, gpu = capacities(cfg, s)
    plan = make_plan(shape, s, host, gpu)
    if not plan.fits:
        return plan, find_fix(shape, s, host, gpu)
    speeds, plan.step_note = host_speeds(cfg, s)
    if speeds is not None:
        plan.host, plan.lengths = speeds, run_lengths(cfg, s)
        plan.step = predict_step(shape.flops_config(), shape.params() * s.dtype_bytes, s, plan.lengths, speeds,
                                 trainable=plan.trainable)
    return plan, None


def _g(x: float) -> str:
    return f"{x / GIB:,.2f}"


def render(plan: Plan, fix: tuple[list[str], Plan] | None = None, width: int = 110) -> str:
    """The table: every part of every role in GiB, the budgets, the step estimate and a verdict."""
    from rich.console import Console
    from rich.table import Table

    s = plan.settings
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    lora = f", LoRA rank {s.lora_rank}: {plan.trainable:,} trainable" if s.lora_rank else ""
    console.print(f"Model: {plan.params:,} parameters ({s.dtype}{lora}); sequences of {plan.seq_len} tokens "
                  f"(rollout.max_model_len), training micro-batches of {plan.micro_batch_rows} rows; "
                  f"ZeRO-{s.zero_stage} over {s.learners} learner rank(s)"
                  + (", optimizer offloaded" if s.offload_optimizer else "")
                  + (", gradient checkpointing" if s.gradient_checkpointing else ""))
    table = Table(title="Memory per role (GiB)", title_justify="left")
    for name, justify in (("role", "left"), ("part", "left"), ("where", "left"), ("per process", "right"),
                          ("x", "right"), ("total", "right")):
        table.add_column(name, justify=justify)
    for role in plan.roles:
        first = True
        for where, parts in ((role.device, role.parts), ("host", role.host_parts), ("page cache", role.cache_parts)):
            for part, size in parts.items():
                table.add_row(role.name if first else "", part, where, _g(size), str(role.count) if first else "",
                              _g(size * role.count))
                first = False
        size = role.per_process + role.host_per_process + role.cache_per_process
        table.add_row("", f"[b]{role.name} total[/b]", "", _g(size), "", _g(size * role.count), end_section=True)
    console.print(table)
    for role in plan.roles:
        for note in role.notes:
            console.print(f"note ({role.name}): {note}")
    for c in plan.checks:
        mark = {True: "fits", False: "DOES NOT FIT", None: "not checked (capacity unknown)"}[c.fits]
        have = f"{_g(c.capacity)} GiB" if c.capacity > 0 else "?"
        console.print(f"{c.what}: needs {_g(c.need)} of {have}: {mark}")
    for problem in plan.problems:
        console.print(f"problem: {problem}")
    for line in step_lines(plan):
        console.print(line)
    if plan.fits:
        console.print("Verdict: fits.")
    else:
        fixed = f"; with {' '.join(fix[0])} it fits" if fix else "; no change of up to 4 settings makes it fit"
        console.print(f"Verdict: does not fit{fixed}.")
    return out.getvalue()


def step_lines(plan: Plan) -> list[str]:
    """The predicted step and run: phases, the lengths and speeds behind them, device-hours and
    (with cluster.price_per_device_hour) money."""
    if plan.step is None:
        return [f"Step time: {plan.step_note or 'not predicted'}"]
    t, n, h, s = plan.step, plan.lengths, plan.host, plan.settings
    lines = [f"Step time: ~{t.step_s:,.1f} s (rollout {t.rollout_s:,.1f}, learner {t.learner_s:,.1f}, sync "
             f"{t.sync_s:,.1f}, other {t.other_s:,.1f}{', rollout and learner overlapped' if s.off_policy_steps else ''})",
             f"  for prompts of {n.prompt:,.0f} tokens and completions of {n.completion:,.0f} on average, the longest "
             f"{n.longest:,.0f} ({n.source})",
             f"  at {h.peak_tflops:,.3g} TFLOP/s ({s.dtype} matmuls) and {h.memory_gbps:,.0f} GB/s ({h.source})"]
    hours = plan.device_hours()
    money = f", ${hours * s.price_per_device_hour:,.2f} at cluster.price_per_device_hour=" \
        f"{s.price_per_device_hour:g}" if s.price_per_device_hour else " (set cluster.price_per_device_hour for money)"
    unit = "GPU" if s.on_gpu else "machine"
    lines.append(f"Run: {s.steps} steps ~{t.step_s * s.steps / 3600:,.2f} h on {plan.devices} {unit}(s): "
                 f"{hours:,.3g} {unit}-hours{money}")
    return lines


def summary_line(plan: Plan) -> str:
    """One line for launch.train's log when the run fits."""
    parts = [f"{r.name} {_g(r.per_process + r.host_per_process)} GiB" + (f" x{r.count}" if r.count > 1 else "")
             for r in plan.roles]
    budget = "; ".join(f"{c.what} {_g(c.need)}/{_g(c.capacity) if c.capacity else '?'} GiB" for c in plan.checks)
    step = f"; step ~{plan.step.step_s:,.1f} s, {plan.device_hours():,.3g} device-hours for run.steps" \
        if plan.step is not None else ""
    return f"Plan: {', '.join(parts)} ({budget}){step} (python -m launch.plan for the table)"


def resolve_enforce_eager(cfg: Any, plan: Plan | None) -> str | None:
    """`rollout.enforce_eager=auto` made true or false by the run's predicted generation time
    (`rl.plan.engine_mode.choose_eager`); returns the line saying which and why (None: not auto)."""
    from rl.plan.engine_mode import choose_eager

    if cfg.rollout.enforce_eager != "auto":
        return None
    rollout_s = plan.step.rollout_s if plan is not None and plan.step is not None else None
    eager, why = choose_eager(rollout_s, int(cfg.run.steps), Settings.from_config(cfg).on_gpu)
    cfg.rollout.enforce_eager = eager
    return f"rollout.enforce_eager=auto -> {str(eager).lower()}: {why}"


SLOW_BF16_RATIO = 3.0  # bf16 matmuls this many times slower than fp32: the CPU lacks bf16 instructions


def slow_bf16_note(bf16_tflops: float, fp32_tflops: float) -> str | None:
    """A warning when this CPU's bf16 matmuls are SLOW_BF16_RATIO or more times slower than its fp32
    ones (a CPU without AVX512-BF16 or AMX emulates bf16), else None."""
    if bf16_tflops <= 0 or fp32_tflops / bf16_tflops < SLOW_BF16_RATIO:
        return None
    return (f"warning: model.dtype=bfloat16 on this CPU: its bf16 matmuls ran at {bf16_tflops:.3f} TFLOP/s, "
            f"{fp32_tflops / bf16_tflops:.0f}x slower than float32's {fp32_tflops:.3f} (no bf16 instructions: "
            "AVX512-BF16 or AMX); model.dtype=float32 runs faster here (its weights take twice the memory)")


def cpu_bf16_warning(plan: Plan | None) -> str | None:
    """slow_bf16_note for a bf16 run on CPUs whose speed was measured (a ~0.5 s fp32 probe more)."""
    if plan is None or plan.host is None or plan.settings.on_gpu or plan.settings.dtype != "bfloat16" \
            or plan.settings.peak_tflops:
        return None
    import torch

    return slow_bf16_note(plan.host.peak_tflops, cpu_matmul_tflops(torch.float32))


def preflight(cfg: Any) -> Plan | None:
    """launch.train's check before Ray starts: print the table and raise a ConfigError naming the
    numbers and the fix when the run cannot fit (no plan when `cluster.preflight=false`); then
    `rollout.enforce_eager=auto` is decided from the plan's step prediction."""
    plan = None
    if cfg.cluster.preflight:
        plan, fix = plan_run(cfg)
        if not plan.fits:
            print(render(plan, fix), flush=True)
            raise ConfigError(refusal(plan, fix))
        print(summary_line(plan), flush=True)
        warning = cpu_bf16_warning(plan)
        if warning:
            print(warning, flush=True)
    note = resolve_enforce_eager(cfg, plan)
    if note:
        print(note, flush=True)
    return plan


def main(argv: list[str] | None = None) -> None:
    from launch.hub import resolve_hub_ids
    from reward.agents.openenv_task import expand_openenv
    from rl.config.compose import compose
    from rl.data.builtins import ensure_builtin

    overrides = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return
    try:
        try:
            cfg = compose("train", overrides, expand=expand_openenv)  # the same configs/ tree, steps, validation
        except Exception as err:  # noqa: BLE001 - ours (ConfigError) or Hydra's (a bad override or group)
            raise ConfigError(" ".join(str(err).split())) from None
        resolve_hub_ids(cfg)  # a Hub id: its snapshot in the Hugging Face cache
        ensure_builtin([cfg.model.path], cfg.run.seed)  # the built-in tiny model, when it is the one named
        plan, fix = plan_run(cfg)
    except INPUT_ERRORS as err:
        fail(err)
    print(render(plan, fix), flush=True)
    if not plan.fits:
        fail(ConfigError(refusal(plan, fix)))
    for note in (cpu_bf16_warning(plan), resolve_enforce_eager(cfg, plan)):
        if note:
            print(note, flush=True)


if __name__ == "__main__":
    main()
