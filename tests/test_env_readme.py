"""The docs' environment example (docs/environments-and-agents.md), run as the docs say (through train(), on the test
session's shared Ray)."""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))



def readme_example(first_line: str) -> str:
    """The docs page's python block that starts with `first_line` (so the documented example is what runs)."""
    text = open(os.path.join(HERE, "..", "docs", "environments-and-agents.md")).read()
    for block in text.split("```python\n")[1:]:
        code = block.split("```")[0]
        if code.startswith(first_line):
            return code
    raise AssertionError(f"no python block starting with {first_line!r} in docs/environments-and-agents.md")


@pytest.mark.slow
@pytest.mark.full  # the docs' example: the full lane
def test_readme_environment_trains_and_logs_episodes_and_evaluations(make_config, tiny_dir, tmp_path):
    """The docs' environment, run as the docs say: whole episodes in samples.jsonl, the
    learner agreeing with the rollout on every model token, eval figures before the first update
    and every 2 steps, in metrics.jsonl and TensorBoard."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.train import train
    from rl.log.run_log import read_metrics

    (tmp_path / "my_env.py").write_text(readme_example("# my_env.py"))
    cfg = make_config(f"task.env={tmp_path}/my_env.py:SecondChance", "task.max_turns=2", "reward.functions=[]",
                      "run.steps=3", "task.prompts_per_step=16", f"eval.files=[{tiny_dir}/data/test.jsonl]",
                      "eval.every_steps=2", "eval.max_rows=16", "eval.n=4", "run.save_final_model=false")
    train(cfg)
    *metrics, final = read_metrics(cfg.run.dir)  # 3 steps, then the evaluation after the last
    assert [("eval/pass_at_1" in m, "eval/pass_at_4" in m) for m in (*metrics, final)] == \
        [(True, True), (False, False), (True, True), (True, True)]
    for m in metrics:
        assert 1.0 <= m["episode/turns_mean"] <= 2.0 and m["episode/errors_count"] == 0
        assert m["sync/logprob_max_abs_diff"] < 1e-3  # learner and rollout agree on every model token
    assert max(m["episode/turns_max"] for m in metrics) == 2  # some first answers were wrong, and retried
    assert 0 <= metrics[0]["eval/greedy_pass_frac"] <= 1 and metrics[0]["eval/pass_at_1"] <= metrics[0]["eval/pass_at_4"]
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "samples.jsonl"))]
    retried = [r for r in rows if len(r["turns"]) == 3]
    assert retried, "no two-turn episode logged"
    model, obs, again = retried[0]["turns"]
    assert (model["role"], obs["role"], again["role"]) == ("model", "observation", "model")
    assert obs["text"] == retried[0]["prompt_text"] and model["reward"] == 0.0 and obs["start"] == model["end"]
    tb = EventAccumulator(os.path.join(cfg.run.dir, "tb"))
    tb.Reload()
    assert {"eval/pass_at_1", "eval/sampled_mean_reward", "episode/turns_mean"} <= set(tb.Tags()["scalars"])
    assert [e.step for e in tb.Scalars("eval/pass_at_1")] == [0, 2, 3]
