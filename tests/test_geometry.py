"""Batch geometry (rl/plan/geometry.py) against hand-computed cuts, and its users agreeing on it:
the learner's DeepSpeed config, the memory planner and the supervised training loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from rl.plan.geometry import BatchGeometry


def test_the_worked_example_of_the_docstring():
    # 32 prompts x 8 samples over 2 ranks, 2 updates per step, at most 48 sequences per pass:
    # 256 / 2 = 128 rows per rank, 128 / 2 = 64 per update, ceil(64 / 48) = 2 micro-batches of 32
    g = BatchGeometry(256, world_size=2, mini_batches=2, micro_batch_size=48)
    assert (g.examples_per_rank, g.examples_per_update, g.examples_cap) == (128, 64, 48)
    assert (g.accumulation_steps, g.micro_batch_examples) == (2, 32)
    assert g.micro_batch_sizes() == [32, 32]
    assert g.micro_batch_rows() == 32
    assert g.forward_sizes(128) == [48, 48, 32]  # scoring a rank's shard: runs of 48


def test_uneven_cuts_are_near_equal_the_larger_first():
    # 70 rows, at most 32: ceil(70/32) = 3 micro-batches; 70 = 24 + 23 + 23; DeepSpeed is told 24
    g = BatchGeometry(70, micro_batch_size=32)
    assert (g.accumulation_steps, g.micro_batch_examples, g.micro_batch_sizes()) == (3, 24, [24, 23, 23])
    assert g.micro_batch_sizes() == [len(t) for t in torch.tensor_split(torch.arange(70), 3)]
    assert g.forward_sizes(70) == [32, 32, 6]
    # 100 rows, at most 30: 4 micro-batches of 25
    assert BatchGeometry(100, micro_batch_size=30).micro_batch_sizes() == [25, 25, 25, 25]
    # a cap above the update: one micro-batch of the whole update; no cap (0): the same
    assert BatchGeometry(64, micro_batch_size=100).micro_batch_sizes() == [64]
    assert BatchGeometry(64).micro_batch_sizes() == [64] and BatchGeometry(64).forward_sizes(64) == [64]
    # a shard that does not divide: the largest rank's share (10 rows over 4 ranks: 3)
    g = BatchGeometry(10, world_size=4, micro_batch_size=2)
    assert (g.examples_per_rank, g.accumulation_steps, g.micro_batch_examples) == (3, 2, 2)


def test_preference_pairs_are_two_sequences_of_the_micro_batch():
    # 64 pairs per update, at most 48 sequences per pass = 24 pairs: ceil(64/24) = 3 micro-batches,
    # 64 = 22 + 21 + 21 pairs, the largest 44 sequences
    g = BatchGeometry(64, micro_batch_size=48, rows_per_example=2)
    assert (g.examples_cap, g.accumulation_steps, g.micro_batch_examples) == (24, 3, 22)
    assert g.micro_batch_sizes() == [22, 21, 21] and g.micro_batch_rows() == 44
    assert g.forward_sizes(50) == [24, 24, 2]
    # an odd cap rounds down to whole pairs: 129 sequences hold 64 pairs, one micro-batch
    assert BatchGeometry(64, micro_batch_size=129, rows_per_example=2).micro_batch_sizes() == [64]


def test_a_token_budget_caps_the_rows_as_the_learner_cuts_them():
    # 130 rows over 2 ranks: 65 per update; the row cut is 2 micro-batches of 33, but a token
    # budget cuts greedily up to micro_batch_size rows (rl.data.batch.plan_micro_batches), so the
    # largest micro-batch of 128-token rows is min(64 rows, 65 rows, 1e6 // 128 = 7812) = 64
    g = BatchGeometry(130, world_size=2, micro_batch_size=64, max_tokens_per_micro_batch=1_000_000)
    assert (g.accumulation_steps, g.micro_batch_examples) == (2, 33)
    assert g.micro_batch_rows(128) == 64
    assert BatchGeometry(130, 2, 1, 64, max_tokens_per_micro_batch=1024).micro_batch_rows(128) == 8  # 1024 // 128
    assert BatchGeometry(130, 2, 1, 64, max_tokens_per_micro_batch=100).micro_batch_rows(128) == 1  # a row alone
    assert BatchGeometry(130, 2, 1, 64).micro_batch_rows(128) == 33  # no budget: the row cut


def test_impossible_geometries_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="3 examples per step leave a rank nothing"):
        BatchGeometry(3, world_size=2, mini_batches=2)
    with pytest.raises(ValueError, match="micro_batch_size=1 sequences cannot hold one example of 2"):
        BatchGeometry(8, micro_batch_size=1, rows_per_example=2)
    with pytest.raises(ValueError, match="world_size=0"):
        BatchGeometry(8, world_size=0)


def test_the_learners_earlier_formula_is_kept_where_the_step_divides():
    """trainer/learner.py computed rows = samples // (mini_batches x world), gas = ceil(rows /
    micro_batch_size), micro = ceil(rows / gas); the planner the same. Unchanged for every
    config `validate` accepts (the step divides by mini_batches x ranks)."""
    for world, mini, mbs, per_update in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 5, 7, 64), (1, 3, 8, 65, 100)):
        samples = per_update * mini * world
        g = BatchGeometry(samples, world, mini, mbs)
        rows = samples // (mini * world)
        gas = max(1, -(-rows // mbs))
        assert (g.accumulation_steps, g.micro_batch_examples) == (gas, -(-rows // gas))
        assert sum(g.micro_batch_sizes()) == rows and max(g.micro_batch_sizes()) <= mbs


def test_learner_and_planner_read_one_geometry_from_the_config():
    from rl.config.compose import compose
    from rl.plan.memory_plan import Settings
    from trainer.learner import LearnerWorker
    from trainer.learner_setup import LearnerSpec, batch_geometry, deepspeed_config

    # 16 prompts x 8 = 128 samples, 2 ranks, 2 mini-batches: 32 rows per update, at most 12 per
    # pass: ceil(32/12) = 3 micro-batches of at most ceil(32/3) = 11 rows
    cfg = compose("train", ["task.prompts_per_step=16", "rollout.n=8", "trainer.num_workers=2",
                            "algorithm.mini_batches=2", "trainer.micro_batch_size=12"])
    spec = LearnerSpec.from_config(cfg)
    ds = deepspeed_config(spec, world_size=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (11, 3)
    assert batch_geometry(spec, 2).micro_batch_sizes() == [11, 11, 10]
    settings = Settings.from_config(cfg)
    assert settings.geometry() == batch_geometry(spec, 2)
    assert settings.micro_batch_rows() == 11
    # the learner's own cuts (no engine needed by rows): a rank's 32-row update into 11 + 11 + 10,
    # its 64-row shard scored in runs of 12 (5 x 12 + 4)
    worker = LearnerWorker.__new__(LearnerWorker)
    worker.spec, worker.world_size = spec, 2
    plan = worker._micro_batches(None, torch.arange(32))
    assert [len(rows) for rows in plan] == [11, 11, 10] and torch.equal(torch.cat(plan), torch.arange(32))
    assert [len(rows) for rows in worker._micro_batches(None, torch.arange(64), forward_only=True)] == [12] * 5 + [4]


class _RecordingStepper:
    """Accumulates gradients like TorchStepper (loss / micro-batches), never steps."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.passes: list[int] = []

    def train(self) -> None:
        pass

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        (loss / micro_batches).backward()

    def update(self) -> None:
        return None

    def lr(self) -> float:
        return 0.0


def test_the_supervised_loop_weighs_uneven_micro_batches_by_their_examples():
    """5 examples, at most 2 per pass: micro-batches of 2, 2, 1 rows. Each micro-batch's mean
    loss counts by its share of the batch, so the gradient is the whole batch's mean: with
    loss_i = x_i * w, d/dw = mean(x) = (1 + 2 + 3 + 4 + 5) / 5 = 3 (an unweighted mean of the
    three micro-batch means would count the lone row as much as each pair)."""
    from trainer.supervised import train_loop

    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    stepper = _RecordingStepper()
    torch.nn.init.ones_(stepper.model.weight)
    sizes = []

    def loss_fn(model, indices):
        sizes.append(len(indices))
        return (model(x[indices, None]).squeeze(1)).mean(), {"rows": float(len(indices))}

    metrics = []
    losses = train_loop(stepper, 5, loss_fn, steps=1, batch_size=5, micro_batch_size=2,
                        on_step=lambda _, m: metrics.append(m))
    assert sizes == [2, 2, 1]
    assert float(stepper.model.weight.grad) == pytest.approx(3.0)
    assert losses == [pytest.approx(3.0)]  # the batch's mean loss (w = 1)
    assert metrics[0]["rows"] == pytest.approx((2 * 2 + 2 * 2 + 1 * 1) / 5)  # weighted by share of the batch
