"""The one run-directory writer that RL, SFT and RM runs share (`rl.log.run_log.RunLog`)."""

from __future__ import annotations

import json

import pytest

from rl.log.run_log import RunLog, read_metrics, row_line


def test_off_a_terminal_steps_are_plain_lines_without_a_bar(tmp_path, capsys) -> None:
    log = RunLog(str(tmp_path / "run"), 3, progress=True, config_yaml="a: 1\n")
    for step in range(3):
        log.metrics(step, {"reward/mean": 0.5 + step / 10, "time/step_s": 1.0})
    log.write("a warning")
    summary = log.finish({"first": 1})
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "it/s" not in out + err and "%|" not in err  # no progress bar glued in
    assert out.splitlines() == ["step 1/3 | reward 0.500 | 1.0 s", "step 2/3 | reward 0.600 | 1.0 s",
                                "step 3/3 | reward 0.700 | 1.0 s", "a warning"]
    run = tmp_path / "run"
    assert (run / "config.yaml").read_text() == "a: 1\n"
    assert [r["reward/mean"] for r in read_metrics(str(run))] == pytest.approx([0.5, 0.6, 0.7])
    assert json.loads((run / "summary.json").read_text())["first"] == 1 and "time/total_s" in summary
    assert list((run / "tb").iterdir())


def test_supervised_rows_quiet_rows_and_a_used_directory(tmp_path, capsys) -> None:
    log = RunLog(str(tmp_path), 10, title="sft", line=row_line("sft"))
    log.metrics(1, {"train/loss": 0.25}, echo=False)
    log.metrics(1, {"eval/loss": float("nan")}, advance=False)
    log.close()
    assert capsys.readouterr().out == "sft step 1: \n"  # nan is not shown...
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "train/loss": 0.25}, {"step": 1, "eval/loss": None}]  # ...and stored as null
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunLog(str(tmp_path), 10)
    RunLog(str(tmp_path), 10, resume=True).close()  # a resumed run appends
