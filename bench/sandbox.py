"""Sandbox benchmark: what isolation costs, and how stable the speed-up reward is under load.

1. Throughput: full compile + test + benchmark cycles per second for the same jobs (slow, medium
   and fast rewrites of code-task problems) through the isolating backend and through the bare,
   unsandboxed subprocess backend (`unsafe_local`), same runner, same slots, interleaved rounds.
   Target: sandbox / bare >= 0.8.
2. Stability: the reward of one program (re-measured, no memo) 20 times while other processes
   keep every core busy. Target spread 0% with `instructions`; `cpu_time` shown for contrast.

    python -m bench.sandbox [--problems 8] [--repeats 20] [--out bench/results/sandbox.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from reward.code_speedup import make_job, speedup_to_reward
from examples.code_speedup import all_code_problems
from sandbox.backend import Backend
from sandbox.job import Job, Method, Status
from sandbox.pool import SandboxSettings, make_backend
from sandbox.runner import run_job
from bench.machine import write_result


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def cycles_per_s(backend: Backend, jobs: list[Job], slots: int) -> tuple[float, list[Status]]:
    started = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        results = list(pool.map(lambda job: run_job(job, backend), jobs))
    return len(jobs) / (time.perf_counter() - started), [r.status for r in results]


def throughput(backend_name: str, jobs: list[Job], slots: int, rounds: int) -> dict:
    sandboxed = make_backend(SandboxSettings(backend=backend_name, slots_per_worker=slots))
    bare = make_backend(SandboxSettings(backend="unsafe_local", slots_per_worker=slots))
    rates: dict[str, list[float]] = {backend_name: [], "unsafe_local": []}
    try:
        cycles_per_s(sandboxed, jobs[:2], slots)  # warm the page cache / compiler once for both
        for _ in range(rounds):
            for name, backend in ((backend_name, sandboxed), ("unsafe_local", bare)):
                rate, statuses = cycles_per_s(backend, jobs, slots)
                bad = [s for s in statuses if s is not Status.OK]
                if bad:
                    raise RuntimeError(f"{name}: {len(bad)} of {len(jobs)} jobs failed ({bad[:3]})")
                rates[name].append(rate)
    finally:
        sandboxed.close()
        bare.close()
    sand, base = statistics.fmean(rates[backend_name]), statistics.fmean(rates["unsafe_local"])
    return {"jobs": len(jobs), "slots": slots, "rounds": rounds,
            "sandbox_cycles_per_s": sand, "bare_cycles_per_s": base, "ratio": sand / base,
            "per_round_cycles_per_s": rates, "target_ratio": 0.8, "meets_target": sand / base >= 0.8}


def reward_spread(backend_name: str, repeats: int, method: Method) -> dict:
    problem = all_code_problems()[0]
    row = problem.to_row()
    candidate = (problem.variants.get("medium") or problem.variants["fast"])[0]
    backend = make_backend(SandboxSettings(backend=backend_name, slots_per_worker=1))
    burners = [multiprocessing.Process(target=_burn, args=(time.time() + 3600,), daemon=True)
               for _ in range(os.cpu_count() or 2)]
    for p in burners:
        p.start()
    rewards, costs = [], []
    try:
        for _ in range(repeats):
            ref = run_job(make_job(row["reference"], row, method.value), backend)
            cand = run_job(make_job(candidate, row, method.value), backend)
            if ref.measurement is None or cand.measurement is None:
                raise RuntimeError(f"not measured: {ref.status} {ref.detail} / {cand.status} {cand.detail}")
            costs.append(cand.measurement.value)
            rewards.append(speedup_to_reward(ref.measurement.value / cand.measurement.value))
    finally:
        for p in burners:
            p.kill()
        backend.close()
    spread = (max(rewards) - min(rewards)) / min(rewards)
    return {"method": method.value, "problem": problem.problem_id, "repeats": repeats,
            "load_processes": len(burners), "reward_min": min(rewards), "reward_max": max(rewards),
            "reward_spread": spread, "cost_spread": (max(costs) - min(costs)) / min(costs),
            "cost_unit": "instructions" if method is Method.INSTRUCTIONS else "s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="process", choices=["process", "docker"])
    parser.add_argument("--problems", type=int, default=8, help="problems; 3 jobs each (slow/medium/fast)")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/sandbox.json")
    args = parser.parse_args()

    problems = all_code_problems()
    step = max(1, len(problems) // args.problems)
    jobs = []
    for problem in problems[::step][: args.problems]:
        row = problem.to_row()
        for kind in ("slow", "medium", "fast"):
            if problem.variants.get(kind):
                jobs.append(make_job(problem.variants[kind][0], row, "instructions", name=f"{problem.problem_id}/{kind}"))

    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "backend": args.backend}
    report["throughput"] = throughput(args.backend, jobs, args.slots, args.rounds)
    t = report["throughput"]
    print(f"throughput: {args.backend} {t['sandbox_cycles_per_s']:.2f} vs bare {t['bare_cycles_per_s']:.2f} "
          f"compile+test+benchmark cycles/s ({t['jobs']} jobs, {t['slots']} slots): ratio {t['ratio']:.3f} "
          f"(target >= 0.8)")
    report["stability"] = [reward_spread(args.backend, args.repeats, m) for m in (Method.INSTRUCTIONS, Method.CPU_TIME)]
    for s in report["stability"]:
        print(f"stability ({s['method']}, {s['repeats']} repeats, {s['load_processes']} busy processes): "
              f"reward {s['reward_min']:.6f}..{s['reward_max']:.6f}, spread {100 * s['reward_spread']:.3f}% "
              f"(cost spread {100 * s['cost_spread']:.3f}%)")
    write_result(args.out, report)


if __name__ == "__main__":
    main()
