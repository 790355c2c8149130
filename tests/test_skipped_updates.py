"""Issue 47.5: a skipped update (DeepSpeed's overflow skip, a non-finite grad norm) is never silent:
counted in the metrics, shown in the step line, and NotLearning names the cause and the last finite
figures. (The run that stops on it: tests/test_faults.py, slow.)"""

from __future__ import annotations

from rl.actors.faults import NotLearning
from rl.log.run_log import summary_line
from trainer.group import reduce_metrics


def test_skipped_updates_are_counted_and_shown_in_the_step_line():
    ranks = [{"_updates": 2.0, "_skipped": 2.0, "actor/grad_norm": 0.0, "_tokens": 4.0}] * 2
    metrics = reduce_metrics(ranks)
    assert metrics["actor/skipped_updates_count"] == 2 and metrics["actor/updates_count"] == 2
    assert "2 of 2 updates skipped (gradients not finite)" in summary_line(0, 4, metrics)
    assert "skipped" not in summary_line(0, 4, reduce_metrics([{"_updates": 1.0, "_tokens": 1.0}]))


def test_not_learning_names_the_field_the_cause_and_the_last_finite_figures():
    err = str(NotLearning(3, 5, {"actor/grad_norm": 0.25, "reward/mean": 0.5}))
    assert "trainer.max_skipped_steps=3" in err and "OVERFLOW" in err and "actor/grad_norm 0.25" in err
    assert "no update was ever applied" in str(NotLearning(2, 2, None))
