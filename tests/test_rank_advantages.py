"""The advantages the learner ranks estimate where the batch is (trainer/advantages.py) equal the
estimate of the whole batch in one place, whitening included: two real gloo ranks, each holding
its interleaved shard as `LearnerGroup.update` sends it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl.algo.estimate import estimate_advantages
from rl.config.schema import AlgorithmConfig
from rl.data.batch import shard_rows
from rl.data.types import Outcomes, TrainBatch
from trainer.advantages import estimate_on_ranks, student_logprobs

ROWS, WIDTH = 5, 7


def _batch(segments: bool) -> tuple[TrainBatch, Outcomes]:
    """5 rows of different lengths (right padding), scored: old/ref log-probs and values. With
    `segments`, rows 3 and 4 are earlier segments of samples 0 and 2 (3 samples, 5 rows)."""
    g = torch.Generator().manual_seed(3)
    lengths = [6, 4, 8, 3, 5]
    attention = torch.tensor([[1] * n + [0] * (WIDTH + 1 - n) for n in lengths])
    mask = attention[:, 1:].float()
    mask[:, :1] = 0  # the prompt
    per_token = lambda: torch.randn((ROWS, WIDTH), generator=g) * mask  # noqa: E731
    batch = TrainBatch(input_ids=attention.clone(), attention_mask=attention, loss_mask=mask,
                       rollout_logprobs=per_token(), advantages=torch.zeros((ROWS, WIDTH)),
                       group_ids=torch.tensor([0, 0, 1, 0, 1]), policy_version=0, old_logprobs=per_token(),
                       ref_logprobs=per_token(), values=per_token(),
                       episode_index=torch.tensor([0, 1, 2, 0, 2]) if segments else None)
    samples = 3 if segments else ROWS
    outcomes = Outcomes(reward=torch.tensor([1.0, 0.0, 2.5, 0.5, -1.0][:samples], dtype=torch.float64),
                        valid=torch.tensor([True, True, True, False, True][:samples]),
                        group_ids=batch.group_ids[:samples])
    return batch, outcomes


CASES = [  # (settings, kl_coef, segments)
    (AlgorithmConfig(advantage="reinforce_pp", kl_in_reward=True, kl_estimator="k1"), 0.1, False),  # global whitening
    (AlgorithmConfig(advantage="gae", lam=0.9), 0.0, False),  # whitened GAE with returns
    (AlgorithmConfig(advantage="grpo", kl_in_reward=True, kl_estimator="k1"), 0.2, True),  # an episode's KL: all its rows'
    (AlgorithmConfig(advantage="gae", lam=0.9), 0.0, True),
]


def _whole(settings: AlgorithmConfig, kl_coef: float, segments: bool):
    b, o = _batch(segments)
    return estimate_advantages(settings, o.reward, o.valid, o.group_ids, b.loss_mask, kl_coef, b.old_logprobs,
                               b.ref_logprobs, b.values, None, None, student_logprobs(b), b.episode_index)


def _rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for i, (settings, kl_coef, segments) in enumerate(CASES):
            batch, outcomes = _batch(segments)
            shard = batch.select(shard_rows(len(batch), 2)[rank])  # trimmed to its own longest row, as sent
            est = estimate_on_ranks(settings, shard, outcomes, kl_coef, rank, 2, WIDTH, "cpu")
            out[(rank, i)] = (est.advantages, est.returns, est.metrics)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_estimate_what_one_place_estimates_for_the_whole_batch():
    from rl.wire.collective import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(free_port(), out), nprocs=2, join=True, start_method="spawn")
        got = dict(out)
    for i, (settings, kl_coef, segments) in enumerate(CASES):
        whole = _whole(settings, kl_coef, segments)
        assert whole.advantages.abs().sum() > 0
        for rank, rows in enumerate(shard_rows(ROWS, 2)):
            advantages, returns, metrics = got[(rank, i)]
            width = advantages.shape[1]
            assert width < WIDTH or rank == 0  # rank 1's rows are shorter: its shard was trimmed
            torch.testing.assert_close(advantages, whole.advantages[rows, :width])
            if whole.returns is not None:
                torch.testing.assert_close(returns, whole.returns[rows, :width])
            assert metrics == pytest.approx(whole.metrics)


def test_one_rank_estimates_its_batch_without_a_process_group():
    settings, kl_coef, segments = CASES[0]
    batch, outcomes = _batch(segments)
    est = estimate_on_ranks(settings, batch, outcomes, kl_coef, 0, 1, WIDTH, "cpu")
    torch.testing.assert_close(est.advantages, _whole(settings, kl_coef, segments).advantages)
