"""`launch.report` on synthetic run directories: finished (summary.json, no eval) and in progress
(eval rows, a half-written last line, no summary.json), the command line, and the config diff of
a supervised run against its own defaults. The real run's report is checked in test_loggers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.report import config_diff, main, read_rows, reward_components, write_report


def _run_dir(tmp_path: Path, *, with_eval: bool, finished: bool) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for i in range(6):
        row = {"step": i, "reward/mean": 0.1 * i, "reward/std": 0.2, "reward/exact_answer_mean": 0.1 * i,
               "reward/format_number_mean": 1.0, "reward/errors_count": 0.0, "actor/kl_nats": 0.001 * i,
               "actor/entropy_nats": 0.4, "rollout/completion_len_tokens": 3.5, "time/rollout_s": 1.0,
               "time/reward_s": 0.1, "time/train_s": 0.5, "time/sync_s": 0.05, "time/step_s": 1.7}
        if with_eval and i % 3 == 0:
            row.update({"eval/greedy_mean_reward": 0.2 + 0.1 * i, "eval/pass_at_1": 0.1 * i, "eval/rows_count": 8.0,
                        "time/eval_s": 0.3})
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text if finished else text + '{"step": 6, "reward/me')
    (run / "config.yaml").write_text("algorithm:\n  name: grpo\n  lr: 0.002\nrun:\n  steps: 6\n  dir: /x\n")
    (run / "samples.jsonl").write_text(
        json.dumps({"step": 4, "prompt_text": "2+2=", "completion_text": "4", "reward": 1.1, "error": None}) + "\n"
        + json.dumps({"step": 5, "prompt_text": "7+5=", "completion_text": "12", "data": {"answer": "12"},
                     "reward": 1.1, "error": None}) + "\n"
        + json.dumps({"step": 5, "prompt_text": "9+9=", "completion_text": "oops", "reward": None,
                      "error": "ValueError: no number"}) + "\n")
    if finished:
        (run / "summary.json").write_text(json.dumps({"steps_run": 6, "last_steps_reward_mean": 0.45,
                                                      "components": {"exact_answer": {"last_steps_mean": 0.45}},
                                                      "time/total_s": 12.5}))
    return run


@pytest.mark.parametrize("with_eval,finished", [(False, True), (True, False)], ids=["finished", "in_progress"])
def test_report_writes_a_picture_and_a_page(tmp_path, with_eval, finished):
    from matplotlib.image import imread

    run = _run_dir(tmp_path, with_eval=with_eval, finished=finished)
    png, md = write_report(str(run))
    assert Path(png) == run / "report.png" and Path(md) == run / "report.md"
    assert imread(png).shape == (640, 1200, 4)  # 15 x 8 inches at 80 dpi, RGBA
    page = Path(md).read_text()
    assert "| steps done | 6 |" in page and "![curves](report.png)" in page
    assert "| reward, first 3 steps | 0.1000 |" in page and "| reward, last 3 steps | 0.4000 |" in page
    if finished:
        assert "| status | finished |" in page and "| components.exact_answer.last_steps_mean | 0.45 |" in page
    else:
        assert "in progress (no summary.json yet)" in page
    assert "- `algorithm.lr`: 0.001 -> 0.002" in page and "- `run.steps`: 60 -> 6" in page
    assert "run.dir" not in page
    assert "| 7+5= | 12 | answer=12 | 1.1 |" in page and "| 9+9= | oops |  | error: ValueError: no number |" in page
    assert "2+2=" not in page  # only the last logged step's samples


def test_a_half_written_line_is_skipped_and_components_are_found(tmp_path):
    run = _run_dir(tmp_path, with_eval=True, finished=False)
    rows = read_rows(str(run))
    assert [r["step"] for r in rows] == list(range(6))
    assert reward_components(rows) == ["reward/exact_answer_mean", "reward/format_number_mean"]


def test_command_line(tmp_path, capsys):
    run = _run_dir(tmp_path, with_eval=False, finished=True)
    main([str(run)])
    assert "report.png" in capsys.readouterr().out and (run / "report.md").exists()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2 and "no metrics.jsonl" in capsys.readouterr().err


def test_a_supervised_run_is_compared_with_its_own_defaults(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 2.0, "eval/loss": 2.1}) + "\n")
    (run / "config.yaml").write_text("algorithm:\n  lr: 0.01\ndata:\n  format: chat\nrun:\n  log_every: 20\n")
    page = Path(write_report(str(run))[1]).read_text()
    assert "- `algorithm.lr`: 0.001 -> 0.01" in page and "- `data.format`: completion -> chat" in page
    assert "log_every" not in page and "kl_coef" not in page and "rollout" not in page  # not the RL defaults
    # an older run's config, under the deprecated optim.* names, is compared under the new ones
    (run / "config.yaml").write_text("optim:\n  lr: 0.01\n  micro_batch_size: 32\ndata:\n  format: chat\n")
    diff = {key: (default, ran) for key, default, ran in config_diff(str(run)) if ran != "(absent)"}
    assert diff == {"algorithm.lr": (0.001, 0.01), "trainer.micro_batch_size": (64, 32),
                    "data.format": ("completion", "chat")}


def test_a_default_path_made_absolute_by_the_launch_is_no_difference(tmp_path):
    """launch.train writes paths made absolute: the default `artifacts/tiny/model` launched from the
    repository is the same setting; another folder is a difference."""
    run = tmp_path / "rl"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    (run / "config.yaml").write_text(
        "model:\n  path: /home/me/rlpost/artifacts/tiny/model\ntask:\n  train_files:\n"
        "  - /home/me/rlpost/artifacts/tiny/data/train.jsonl\nrun:\n  steps: 60\n")
    diff = {key: (default, ran) for key, default, ran in config_diff(str(run))}
    assert "model.path" not in diff and "task.train_files" not in diff
    (run / "config.yaml").write_text("model:\n  path: /data/other/model\n")
    assert {key for key, _, _ in config_diff(str(run))} >= {"model.path"}
