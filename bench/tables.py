"""The docs' benchmark tables, written from the benchmarks' JSON (bench/results/), so no figure in
them is typed by hand.

docs/benchmarks.md marks each generated table with a pair of comments,
`<!-- bench.tables:NAME -->` ... `<!-- /bench.tables:NAME -->`; this module rewrites what lies
between from the JSON files named in `TABLES`, and `--check` fails (naming the table) where the
docs differ from what the JSON says (tests/test_bench_tables.py runs it).

    python -m bench.tables [--check] [--docs docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
GOAL = 3.0  # ours / TRL samples/s at every shape and precision (issue 62)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _host(machine: dict) -> str:
    """The machine a result came from and the commit it measured."""
    load = machine.get("load_avg_at_start")
    said = f"{machine.get('cores', '?')}-core {machine.get('cpu', '?')}"
    return said + (f", load {load[0]:.1f} at start" if load else "") + \
        f", commit `{str(machine.get('git_commit', '?'))[:7]}`"


def _table(caption: str, header: list[str]) -> list[str]:
    """A caption line, then a Markdown table's head."""
    return [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def _split(split: dict, keys: dict[str, str]) -> str:
    return ", ".join(f"{label} {split[k]:.2f}" for k, label in keys.items() if k in split)


# (file, the cases of it in the table: None for all) -- every run of the code now in (a repeat
# beside its first run), and the newest run of a case not rerun since
VS_TRL_FILES = (("vs_trl_smollm2_8x4.json", None), ("vs_trl_smollm2_8x4_repeat.json", None),
                ("vs_trl_smollm2_n8_bf16_repeat.json", None), ("vs_trl_smollm2_n8_fp32_mb16_repeat.json", None),
                ("vs_trl_smollm2_long_repeat.json", None))


def vs_trl(files: tuple[tuple[str, tuple[str, ...] | None], ...] = VS_TRL_FILES) -> str:
    """Ours against TRL per case: samples/s both sides, the ratio, each side's step split."""
    lines = ["| case | ours samples/s | TRL samples/s | ratio | goal | ours per step (s) | TRL per step (s) | file |",
             "|---|---|---|---|---|---|---|---|"]
    for name, cases in files:
        data = _load(name)
        for case in data["cases"]:
            ours, trl = case.get("ours"), case.get("trl")
            if not ours or not trl or (cases is not None and case["case"] not in cases):
                continue
            o = _split(ours["mean_split_s"], {"time/rollout_s": "rollout", "time/train_s": "train", "time/sync_s": "sync"})
            t = _split(trl["mean_split_s"], {"generate_s": "generate", "rest_s": "rest"})
            lines.append(f"| {case['case']} ({case['prompts']} x {case['samples']} x {case['max_new_tokens']}) "
                         f"| {ours['samples_per_s']:.2f} | {trl['samples_per_s']:.2f} "
                         f"| **{case['ratio_samples_per_s']:.2f}x** "
                         f"| >= {GOAL}x {'PASS' if case['ratio_samples_per_s'] >= GOAL else 'FAIL'} "
                         f"| {ours['median_step_s']:.2f}: {o} | {trl['median_step_s']:.2f}: {t} "
                         f"| `{name}` ({_host(data['machine'])}) |")
    return "\n".join(lines)


def bounds(name: str = "bounds.json") -> str:
    """Each phase of a step against its bound (bench.bounds)."""
    data = _load(name)
    lines = _table(f"SmolLM2-135M-Instruct, {data['dtype']}, {_host(data['machine'])}.",
                   ["phase", "ours", "its bound", "ours / bound", "target", "measured"])
    for phase, r in data["phases"].items():
        if "error" in r:
            lines.append(f"| {phase} | failed: {r['error'][-120:].strip()} | | | | {r.get('measured', '')} |")
            continue
        verdict = "PASS" if r["passed"] else "FAIL"
        lines.append(f"| {phase} | {r['ours']} | {r['bound']} | **{r['ratio']:.2f}x** | {r['target']} {verdict} "
                     f"| {r.get('measured', '')} |")
    return "\n".join(lines)


def memory(name: str = "memory.json") -> str:
    """Each role's measured peak RSS against the planner's prediction (bench.memory)."""
    data = _load(name)
    lines = _table(f"Workload `{data['workload']}` ({' '.join(data['overrides'])}), {_host(data['machine'])}.",
                   ["role", "processes", "measured peak RSS (GiB)", "planner (GiB)", "planner / measured",
                    "within +-30%"])
    for r in data["roles"]:
        ratio = r["ratio"]
        ok = "yes" if ratio is not None and 0.7 <= ratio <= 1.3 else "no"
        lines.append(f"| {r['role']} | {len(r['processes'])} | {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} "
                     f"| {'n/a' if ratio is None else f'{ratio:.2f}x'} | {ok} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"vs_trl": vs_trl, "bounds": bounds, "memory": memory}
BLOCK = re.compile(r"(<!-- bench\.tables:(\w+) -->)(.*?)(<!-- /bench\.tables:\2 -->)", re.S)


def render(text: str) -> tuple[str, list[str]]:
    """`text` with every marked table rewritten; the names of those that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"docs mark a table {name!r}; bench/tables.py knows {', '.join(TABLES)}")
        table = "\n" + TABLES[name]() + "\n"
        if table != m.group(3):
            changed.append(name)
        return m.group(1) + table + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--check", action="store_true", help="change nothing; fail where the docs differ")
    args = parser.parse_args(argv)
    path = Path(args.docs)
    text, changed = render(path.read_text())
    if args.check:
        if changed:
            print(f"{path}: tables {', '.join(changed)} differ from bench/results/; run python -m bench.tables")
            return 1
        return 0
    path.write_text(text)
    print(f"{path}: rewrote {', '.join(changed) or 'nothing (all current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
