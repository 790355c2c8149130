"""`python -m launch.plan [same overrides as launch.train]`: what the run will hold in memory per role,
whether it fits the machine (or the declared GPUs), and what a step costs, before anything starts.

The config is composed from `configs/train.yaml` with the overrides, exactly as `launch.train`
composes it, and validated the same way (`rl.config.schema.validate`); of the model only `config.json`
is read. The arithmetic is `rl/plan/memory_plan.py`; this module detects the hardware and prints.
Exit code 0 when the run fits, 2 (with one `error:` line naming the fix) when it does not.
`launch.train` runs the same check (`preflight`) before Ray starts; `cluster.preflight=false` skips it.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from typing import Any

from launch.cli import INPUT_ERRORS, fail
from launch.model_files import require_model
from rl.config.schema import ConfigError
from rl.plan.memory_plan import GIB, ModelShape, Plan, Settings, find_fix, make_plan, refusal


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


def plan_run(cfg: Any) -> tuple[Plan, tuple[list[str], Plan] | None]:
    """The plan of a validated config whose model folder exists, and a fix when it does not fit."""
    shape = ModelShape.from_config(require_model(cfg.model.path))
    s = Settings.from_config(cfg)
    host, gpu = capacities(cfg, s)
    plan = make_plan(shape, s, host, gpu)
    return plan, (None if plan.fits else find_fix(shape, s, host, gpu))


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
    if plan.step_s is not None:
        cost = f", ${plan.step_usd:.4f} per step" if plan.step_usd is not None else ""
        console.print(f"Step time: ~{plan.step_s:,.1f} s with every sequence {plan.seq_len} tokens, at "
                      f"{plan.peak_tflops:g} TFLOP/s peak ({plan.peak_source}){cost}")
    else:
        console.print(f"Step time: {plan.peak_source}")
    if plan.fits:
        console.print("Verdict: fits.")
    else:
        fixed = f"; with {' '.join(fix[0])} it fits" if fix else "; no change of up to 4 settings makes it fit"
        console.print(f"Verdict: does not fit{fixed}.")
    return out.getvalue()


def summary_line(plan: Plan) -> str:
    """One line for launch.train's log when the run fits."""
    parts = [f"{r.name} {_g(r.per_process + r.host_per_process)} GiB" + (f" x{r.count}" if r.count > 1 else "")
             for r in plan.roles]
    budget = "; ".join(f"{c.what} {_g(c.need)}/{_g(c.capacity) if c.capacity else '?'} GiB" for c in plan.checks)
    step = f"; step ~{plan.step_s:,.1f} s" if plan.step_s is not None else ""
    return f"Plan: {', '.join(parts)} ({budget}){step} (python -m launch.plan for the table)"


def preflight(cfg: Any) -> Plan | None:
    """launch.train's check before Ray starts: print the table and raise a ConfigError naming the
    numbers and the fix when the run cannot fit (nothing when `cluster.preflight=false`)."""
    if not cfg.cluster.preflight:
        return None
    plan, fix = plan_run(cfg)
    if not plan.fits:
        print(render(plan, fix), flush=True)
        raise ConfigError(refusal(plan, fix))
    print(summary_line(plan), flush=True)
    return plan


def main(argv: list[str] | None = None) -> None:
    from examples import ensure_builtin
    from launch.hub import resolve_hub_ids
    from rl.config.compose import compose

    overrides = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return
    try:
        try:
            cfg = compose("train", overrides)  # the same configs/ tree and validation as launch.train
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


if __name__ == "__main__":
    main()
