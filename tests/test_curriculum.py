"""The difficulty curriculum (rl/data/curriculum.py): prompts whose group was all solved or all
failed rest for `task.curriculum_epochs` epochs, by hand; the state survives a checkpoint as JSON;
and a real run resumed from a checkpoint draws exactly the prompts the uninterrupted one drew."""

from __future__ import annotations

import json
import os

import pytest

from rl.data.curriculum import Curriculum


def _stream(rows: int):
    return lambda position: position % rows  # the epoch permutation, as the identity here


def test_flat_groups_rest_an_epoch_and_mixed_ones_do_not() -> None:
    c = Curriculum(rows=4, rest_epochs=1, pass_reward=1.0)
    assert c.draw(2, _stream(4), groups=[0, 1]) == [0, 1]
    # group 0 (row 0) all solved, group 1 (row 1) mixed: row 0 rests until position 2 + 4 = 6
    assert c.record({0: [1.0, 1.0], 1: [1.0, 0.0]}) == 1
    assert c.resting == {0: 6}
    assert c.draw(2, _stream(4), groups=[0, 1]) == [2, 3]
    assert c.record({0: [0.0, 0.2], 1: [None, 1.0]}) == 2  # all failed (0.2 < 1.0); one valid sample, solved
    assert c.resting == {0: 6, 2: 8, 3: 8}
    # positions 4 (row 0, resting until 6): passed over; 5 (row 1); 6 (row 2, resting until 8): passed over;
    # 7 (row 3, until 8): passed over; 8 (row 0, free again)
    assert c.draw(2, _stream(4), groups=[0, 1]) == [1, 0]
    assert c.last_skipped == 3 and c.metrics(2)["curriculum/skipped_frac"] == pytest.approx(3 / 5)
    assert c.cursor == 9 and c.resting == {2: 8, 3: 8}  # row 0 was drawn: no longer resting
    assert c.metrics(2)["curriculum/resting_rows"] == 0.0  # 8 < cursor 9: rows 2 and 3 may come back


def test_a_group_of_failed_samples_only_or_an_unknown_group_changes_nothing() -> None:
    c = Curriculum(rows=4, rest_epochs=2)
    c.draw(1, _stream(4), groups=[0])
    assert c.record({0: [None, None], 5: [1.0, 1.0]}) == 0 and c.resting == {}


def test_when_every_prompt_rests_the_draw_takes_resting_ones_after_an_epoch() -> None:
    c = Curriculum(rows=2, rest_epochs=3)
    c.draw(2, _stream(2), groups=[0, 1])
    c.record({0: [1.0], 1: [0.0]})
    assert c.draw(1, _stream(2), groups=[0]) == [0]  # positions 2, 3 passed over (an epoch), then 4 taken
    assert c.last_skipped == 2


def test_the_state_goes_through_json_and_back() -> None:
    c = Curriculum(rows=4, rest_epochs=1)
    c.draw(3, _stream(4), groups=[0, 1, 2])
    c.record({0: [1.0, 1.0]})
    again = Curriculum(rows=4, rest_epochs=1)
    again.load(json.loads(json.dumps(c.to_dict())))
    assert (again.cursor, again.resting, again.drawn) == (c.cursor, c.resting, c.drawn) == (3, {0: 7}, {1: 1, 2: 2})
    assert again.draw(4, _stream(4), groups=[0, 1, 2, 3]) == c.draw(4, _stream(4), groups=[0, 1, 2, 3])


def test_the_dataset_draws_round_zero_through_the_curriculum(tmp_path, tiny_dir) -> None:
    from transformers import AutoTokenizer

    from rl.data.dataset import PromptDataset

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(6)))
    tok = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "model"))
    data = PromptDataset([str(path)], "prompt", tok, seed=0, max_prompt_tokens=32)
    plain = [r.prompt_text for r in data.requests(0, 3, 1)]
    data.curriculum = Curriculum(len(data), rest_epochs=1)
    assert [r.prompt_text for r in data.requests(0, 3, 1)] == plain  # nothing resting: the same stream
    data.curriculum.record({0: [1.0], 1: [0.5], 2: [1.0]})  # rows of groups 0 and 2 rest
    rested = {plain[0], plain[2]}
    second = [r.prompt_text for r in data.requests(1, 3, 1)]
    assert not rested & set(second) and len(set(second)) == 3


@pytest.mark.slow
@pytest.mark.full  # an algorithm feature's run: the full lane
def test_a_run_sets_flat_prompts_aside_and_its_resume_draws_the_same_prompts(make_config, tiny_dir, tmp_path) -> None:
    """The tiny model on 12 arithmetic prompts, 4 a step (an epoch every 3 steps): prompts whose
    groups were flat are passed over in later epochs (logged), and a run resumed from its step-4
    checkpoint trains steps 4-7 on the prompts the uninterrupted run trained them on."""
    from launch.checks import check_run_dir
    from launch.train import train
    from rl.log.run_log import read_metrics

    rows = open(os.path.join(tiny_dir, "data", "train.jsonl")).readlines()[:12]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(rows))
    common = [f"task.train_files=[{small}]", "task.prompts_per_step=4", "rollout.n=4", "task.curriculum_epochs=1",
              "run.save_every=4", "run.log_samples_per_step=256", "run.save_final_model=false"]
    cfg = make_config(*common, "run.steps=8")
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert all("curriculum/skipped_frac" in m for m in metrics)
    assert metrics[0]["curriculum/skipped_frac"] == 0.0  # nothing rests before the first groups
    assert any(m["curriculum/skipped_frac"] > 0 for m in metrics[3:]), [m["curriculum/skipped_frac"] for m in metrics]

    def prompts_by_step(path: str) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for line in open(path):
            r = json.loads(line)
            out.setdefault(r["step"], []).append((r["group_id"], r["sample_index"], r["prompt_text"]))
        return {s: sorted(v) for s, v in out.items()}

    before = prompts_by_step(os.path.join(cfg.run.dir, "samples.jsonl"))
    os.remove(os.path.join(cfg.run.dir, "samples.jsonl"))
    import shutil

    shutil.rmtree(os.path.join(cfg.run.dir, "checkpoints", "step_000008"))
    with open(os.path.join(cfg.run.dir, "checkpoints", "latest"), "w") as f:
        f.write("step_000004")
    again = make_config(*common, "run.steps=8", "run.resume=true")
    train(again, resume_from=check_run_dir(again))
    after = prompts_by_step(os.path.join(cfg.run.dir, "samples.jsonl"))
    assert sorted(after) == [4, 5, 6, 7]
    assert all(after[s] == before[s] for s in after)
