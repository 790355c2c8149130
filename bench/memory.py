"""Each role's peak resident memory on a real run beside the planner's prediction for it (issue 62.5).

The run is `python -m launch.train` with the workload's overrides (default: the real-model recipe,
`model=smollm2 task=math_chat`); while it runs, every process of its tree is sampled every 0.2 s
and its peak RSS read from the kernel (`VmHWM` in /proc/PID/status: the high-water mark, so no
peak is missed between samples). Processes are told apart by the run's own record of its actors
(`<run>/actors.json`: role and pid of each); the driver is the command itself. The
prediction is `launch.plan`'s for the same command (`rl/plan/memory_plan.py`: a role's bytes per
process, device and host, the page cache it keeps counted, times its processes), against the
role's processes together: a rollout worker with the engine-core process vLLM starts under it,
and "driver, Ray, rewards" as the driver, Ray's own processes and the reward workers. Target: every role within +-30%.

    python -m bench.memory [--workload recipe] [--out bench/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from bench.machine import machine_info, write_result

WORKLOADS = {
    "recipe": ["model=smollm2", "task=math_chat", "run.steps=4", "eval.every_steps=0", "run.save_every=0",
               "run.save_final_model=false"],
    "default": ["run.steps=4", "run.save_every=0", "run.save_final_model=false"],
}
ACTOR_ROLES = ("learner", "rollout")  # as the run's actors.json names them; every other process is OTHER
OTHER = "driver, Ray, rewards"
GIB = 2**30


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def actor_pids(run_dir: Path) -> dict[int, str]:
    """pid -> "learner 0", "rollout 0", ... from the `actors.json` the run writes once its actors
    are placed (launch/placement.py); empty before then."""
    try:
        rows = json.loads((run_dir / "actors.json").read_text())
    except (OSError, ValueError):
        return {}
    return {row["pid"]: f"{row['role']} {row['index']}" for row in rows if row["role"] in ACTOR_ROLES}


class Sampler:
    """Every process of the run (its tree, and Ray's, which daemonises out of it): its peak RSS
    and its ancestors, so that its role is settled from the run's actors once they are known: an
    actor's as the run names it, a process under an actor (vLLM's engine core under a rollout
    worker, a compiler DeepSpeed starts while a learner sets up, before actors.json exists) its
    actor's, any other OTHER."""

    def __init__(self, driver: int, run_dir: Path):
        self.driver, self.run_dir = driver, run_dir
        self.peaks: dict[int, int] = {}
        self.seen: dict[int, tuple[str, list[int]]] = {}  # pid -> (name, ancestor pids)
        self.actors: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _processes(self) -> list[psutil.Process]:
        try:
            tree = [psutil.Process(self.driver), *psutil.Process(self.driver).children(recursive=True)]
        except psutil.Error:
            tree = []
        ray_daemons = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and
                       any("ray" in part and ("gcs_server" in part or "raylet" in part or "dashboard" in part
                                              or "log_monitor" in part or "ray::" in part) for part in p.info["cmdline"][:3])]
        return list({p.pid: p for p in tree + ray_daemons}.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.actors = actor_pids(self.run_dir) or self.actors
            for p in self._processes():
                rss = peak_rss(p.pid)
                if not rss:
                    continue
                self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), rss)
                if p.pid not in self.seen:
                    try:
                        self.seen[p.pid] = (p.name(), [a.pid for a in p.parents()])
                    except psutil.Error:
                        self.seen[p.pid] = ("?", [])
            self._stop.wait(0.2)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _what(self, pid: int) -> tuple[str, str]:
        """(role, what the process is)."""
        if pid in self.actors:
            return self.actors[pid].split()[0], self.actors[pid]
        name, ancestors = self.seen[pid]
        for up in ancestors:
            if up in self.actors:
                return self.actors[up].split()[0], f"{name} (under {self.actors[up]})"
        return OTHER, "driver" if pid == self.driver else name

    def by_role(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for pid, peak in self.peaks.items():
            role, what = self._what(pid)
            r = out.setdefault(role, {"processes": {}, "largest_gib": 0.0, "total_gib": 0.0})
            r["processes"][f"{what} ({pid})"] = round(peak / GIB, 3)
            r["largest_gib"] = max(r["largest_gib"], peak / GIB)
            r["total_gib"] += peak / GIB
        return out


def predicted(overrides: list[str], run_dir: str) -> dict[str, dict]:
    """`launch.plan`'s bytes per process and process count of each role, for the command."""
    from launch.plan import plan_run
    from rl.config.compose import compose
    from rl.config.validation import validate
    from rl.data.builtins import ensure_builtin

    cfg = compose("train", overrides + [f"run.dir={run_dir}"])
    ensure_builtin([cfg.model.path, *cfg.task.train_files])  # (a built-in task is built on first use)
    validate(cfg)
    plan, _ = plan_run(cfg)
    return {r.name: {"per_process_gib": (r.per_process + r.host_per_process + r.cache_per_process) / GIB,
                     "count": r.count} for r in plan.roles}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="recipe", choices=sorted(WORKLOADS))
    parser.add_argument("--out", default="bench/results/memory.json")
    args = parser.parse_args(argv)
    overrides = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = f"{tmp}/run"
        plan = predicted(overrides, run_dir)
        proc = subprocess.Popen([sys.executable, "-m", "launch.train", *overrides, f"run.dir={run_dir}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with Sampler(proc.pid, Path(run_dir)) as sampler:
            out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"launch.train failed:\n{out[-3000:]}")
    measured = sampler.by_role()
    rows = []
    for role, want in plan.items():
        got = measured.get(role, {})
        # each role's processes together (a rollout worker is its actor and vLLM's engine core)
        value = got.get("total_gib", 0.0)
        expected = want["per_process_gib"] * want["count"]
        rows.append({"role": role, "measured_gib": round(value, 3), "predicted_gib": round(expected, 3),
                     "ratio": round(expected / value, 3) if value else None, "processes": got.get("processes", {})})
        ratio = f"{expected / value:.2f}x" if value else "n/a"
        print(f"{role:22s} measured peak {value:6.2f} GiB, planner {expected:6.2f} GiB: {ratio}", flush=True)
    write_result(args.out, {"machine": machine_info(), "workload": args.workload, "overrides": overrides,
                            "roles": rows, "target": "every role's prediction within +-30% of its measured peak RSS"})


if __name__ == "__main__":
    main()
