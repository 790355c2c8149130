"""`python -m launch.report RUN_DIR`: a picture and a page of any run, finished or in progress.

Writes `<run>/report.png` (reward and its components, KL, entropy, response length, the time
split of every step, eval metrics when the run has them) and `<run>/report.md` (the summary
table, the config keys that differ from the defaults, a few sample generations, the picture).
It reads only the run directory's files: metrics.jsonl (a half-written last line of a run in
progress is skipped), summary.json (absent while the run goes on: the table is computed from the
metrics), config.yaml and samples.jsonl. Every RL run writes its report at its end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

from rl.log.loggers import flatten
from rl.log.run_log import read_metrics

TIME_PARTS = ("time/rollout_s", "time/reward_s", "time/score_s", "time/train_s", "time/sync_s", "time/eval_s")
# (title, y label, metric keys: the first one present of each tuple is drawn)
PANELS: tuple[tuple[str, str, tuple[tuple[str, ...], ...]], ...] = (
    ("KL to the reference", "nats per token", (("actor/kl_nats", "actor/kl_in_reward_nats"),)),
    ("Entropy of the policy", "nats per token", (("actor/entropy_nats",),)),
    ("Response length", "tokens", (("rollout/completion_len_tokens",),)),
)


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """metrics.jsonl rows by step (a step redone after a resume: its latest row); a line that does
    not parse (the one a running run is writing) is skipped."""
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl: not a run directory, or no step has ended yet")
    return read_metrics(run_dir)


def step_reward(row: dict[str, Any]) -> float | None:
    """A step's mean reward, or None for a step that had none: every sample failed (no reward/mean,
    a non-finite one, or no sample without an error)."""
    value = row.get("reward/mean")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    samples, errors = row.get("reward/samples_count"), row.get("reward/errors_count")
    if isinstance(samples, (int, float)) and isinstance(errors, (int, float)) and errors >= samples:
        return None
    return float(value)


def reward_ends(rows: list[dict[str, Any]], k: int = 5) -> tuple[int, float | None, float | None]:
    """(k, mean reward of the first k steps, of the last k): over the training steps (rows with
    time/step_s; not an evaluation's row), k at most half of them so the two do not overlap. A step
    without rewards does not count (issue 58: the last steps' mean repeated an earlier step's); None
    where no step of the k had rewards."""
    steps = [r for r in rows if "time/step_s" in r]
    k = max(1, min(k, len(steps) // 2))
    ends = [[v for r in part if (v := step_reward(r)) is not None] for part in (steps[:k], steps[-k:])]
    first, last = (statistics.fmean(values) if values else None for values in ends)
    return k, first, last


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"] + 1, r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def reward_components(rows: list[dict[str, Any]]) -> list[str]:
    """The per-function reward means (`reward/<fn>_mean`), in first-seen order."""
    keys = dict.fromkeys(k for r in rows for k in r if k.startswith("reward/") and k.endswith("_mean")
                         and k != "reward/mean")
    return list(keys)


def _legend(ax: Any) -> None:
    """A legend only where something was drawn (an empty one warns and shows a blank box)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def draw(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """report.png: a 2x3 grid of the run's curves (steps counted from 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # fixed margins: matplotlib's constrained layout took 0.6 of the 1.2 s a report took to draw
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.07, top=0.91, wspace=0.22, hspace=0.32)
    fig.suptitle(title)
    for ax in axes.flat:  # steps are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    marker = "o" if len(rows) <= 30 else None  # a run of one or two steps still shows its points
    ax = axes[0][0]
    ax.plot(*_series(rows, "reward/mean"), label="reward (weighted sum)", linewidth=2, color="black", marker=marker)
    for key in reward_components(rows):
        ax.plot(*_series(rows, key), label=key.removeprefix("reward/").removesuffix("_mean"), alpha=0.8,
                marker=marker, markersize=4)
    ax.set(title="Reward (mean over samples)", xlabel="step", ylabel="reward")
    _legend(ax)
    for ax, (name, unit, choices) in zip((axes[0][1], axes[0][2], axes[1][0]), PANELS):
        for keys in choices:
            key = next((k for k in keys if any(k in r for r in rows)), None)
            if key is not None:
                ax.plot(*_series(rows, key), label=key, marker=marker)
                _legend(ax)
        if not ax.lines:  # e.g. no KL with algorithm.kl_coef=0: say so rather than draw empty axes
            ax.text(0.5, 0.5, f"not logged in this run\n({', '.join(k for keys in choices for k in keys)})",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(title=name, xlabel="step", ylabel=unit)
    ax = axes[1][1]
    bottom = [0.0] * len(rows)
    steps = [r["step"] + 1 for r in rows]
    for i, key in enumerate(TIME_PARTS):  # one colour per phase in every report
        values = [float(r.get(key) or 0.0) for r in rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=key.removeprefix("time/").removesuffix("_s"), width=0.9,
                   color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="Time per step, by phase", xlabel="step", ylabel="seconds")
    if any(bottom):  # headroom above the bars for the legend
        ax.set_ylim(0, max(bottom) * 1.3)
        ax.legend(fontsize=8, ncol=3, loc="upper center")
    ax = axes[1][2]
    eval_keys = sorted(dict.fromkeys(k for r in rows for k in r if k.startswith("eval/")
                                       and not k.endswith("_count") and k != "eval/tokens"))
    for key in eval_keys:
        ax.plot(*_series(rows, key), marker="o", label=key.removeprefix("eval/"))
    if eval_keys:
        _legend(ax)
    else:
        ax.text(0.5, 0.5, "no evaluation in this run\n(eval.files, eval.every_steps)", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.set(title="Evaluation on held-out rows", xlabel="step", ylabel="mean reward or fraction")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summary_table(rows: list[dict[str, Any]], summary: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(name, value) lines: summary.json's scalars, or while running the figures so far."""
    n, first, last = reward_ends(rows)
    out = [("steps done", str(len(rows))),
           ("status", "finished" if summary and "ended_early" not in summary else
            f"ended early: {summary['ended_early']}" if summary else "in progress (no summary.json yet)")]
    if any("reward/mean" in r or "reward/errors_count" in r for r in rows):  # an RL run's
        out += [(f"reward, {end} {n} steps", "no step had rewards" if mean is None else f"{mean:.4f}")
                for end, mean in (("first", first), ("last", last))]
    for key, value in flatten(summary or {}).items():
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            out.append((key, f"{value:.4g}" if isinstance(value, float) else str(value)))
    steps = [r.get("time/step_s") for r in rows if isinstance(r.get("time/step_s"), (int, float))]
    if steps:
        out.append(("mean step time (s)", f"{statistics.fmean(steps):.2f}"))
    return out


def config_app(config: dict[str, Any]) -> str:
    """Which entry point wrote a run's config: `train` (RL), `train_rm` or `train_sft` (their
    `data` section; older supervised runs: `optim`)."""
    if "rollout" in config or "task" in config or not ("data" in config or "optim" in config):
        return "train"
    return "train_rm" if "loss" in config else "train_sft"


def config_diff(run_dir: str) -> list[tuple[str, Any, Any]]:
    """(key, default, this run's) for every config key whose value differs from the defaults
    (`configs/<app>.yaml` composed with no overrides, <app> the run's kind); run.dir is left out."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return []
    from omegaconf import OmegaConf

    from rl.config.compose import compose
    from rl.config.supervised import PAIR_ROWS, renamed

    tree: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    app = config_app(tree)
    ran = flatten(tree)
    if app != "train":  # an older supervised run's deprecated optim.* keys, under their new names
        per_example = PAIR_ROWS if app == "train_rm" else 1
        ran = dict(renamed(key, value, per_example) or (key, value) for key, value in ran.items())
    defaults = flatten(OmegaConf.to_container(compose(app, []), resolve=False))
    keys = [k for k in dict.fromkeys([*defaults, *ran])
            if k != "run.dir" and not _same_value(defaults.get(k), ran.get(k))]
    return [(k, defaults.get(k, "(absent)"), ran.get(k, "(absent)")) for k in keys]


def _same_value(default: Any, ran: Any) -> bool:
    """Equal, or the same path: launch.train writes a relative default path made absolute."""
    if isinstance(default, list) and isinstance(ran, list) and len(default) == len(ran):
        return all(_same_value(d, r) for d, r in zip(default, ran))
    if isinstance(default, str) and isinstance(ran, str) and default and not os.path.isabs(default) \
            and os.path.isabs(ran):
        return os.path.normpath(ran).endswith(os.sep + os.path.normpath(default))
    return default == ran


def sample_lines(run_dir: str, keep: int = 4) -> list[dict[str, Any]]:
    """The first `keep` logged samples of the last step that has any."""
    path = os.path.join(run_dir, "samples.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not rows:
        return []
    last = max(r.get("step", 0) for r in rows)
    return [r for r in rows if r.get("step", 0) == last][:keep]


def _cell(value: Any, width: int = 300) -> str:
    text = str(value).replace("|", "\\|").replace("\n", "\\n")
    return text if len(text) <= width else text[:width] + "..."


def write_report(run_dir: str, rows: list[dict[str, Any]] | None = None) -> tuple[str, str]:
    """Write report.png and report.md into `run_dir`; returns their paths. `rows`: the run's
    metrics as the run itself wrote them (its RunLog's), else read from metrics.jsonl."""
    rows = read_rows(run_dir) if rows is None else rows
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    png, md = os.path.join(run_dir, "report.png"), os.path.join(run_dir, "report.md")
    steps = sum("time/step_s" in r for r in rows)  # not the evaluation after the last step
    draw(rows, png, f"{os.path.basename(os.path.abspath(run_dir))}: {steps} steps")
    lines = [f"# Run report: {os.path.abspath(run_dir)}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in summary_table(rows, summary)]
    lines += ["", "![curves](report.png)", "", "## Config: what differs from the defaults", ""]
    diff = config_diff(run_dir)
    lines += ([f"- `{k}`: {_cell(d, 80)} -> {_cell(v, 80)}" for k, d, v in diff] if diff
              else ["(the defaults)"])
    lines += ["", "## Sample generations (last logged step)", "",
              "| prompt | completion | data (dataset columns) | reward |", "|---|---|---|---|"]
    for s in sample_lines(run_dir):
        completion = s.get("completion_text") or " ".join(t.get("text", "") for t in s.get("turns") or [])
        reward = s.get("reward")
        data = ", ".join(f"{k}={v}" for k, v in (s.get("data") or {}).items())
        lines.append(f"| {_cell(s.get('prompt_text', ''))} | {_cell(completion)} | {_cell(data)} | "
                     f"{'error: ' + _cell(s['error']) if s.get('error') else reward} |")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return png, md


def write_report_or_warn(run_dir: str, rows: list[dict[str, Any]] | None = None) -> None:
    """write_report for a run that just ended (launch.train, launch.serve): a report that fails
    never fails the run, whose results are written already."""
    try:
        png, _ = write_report(run_dir, rows)
        print(f"Report: {png} (and report.md)", flush=True)
    except Exception as err:  # noqa: BLE001 - the run's results are written already
        print(f"warning: no report for {run_dir}: {type(err).__name__}: {err}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (finished or in progress)")
    args = parser.parse_args(argv)
    try:
        png, md = write_report(args.run_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"Wrote {png} and {md}")


if __name__ == "__main__":
    main()
