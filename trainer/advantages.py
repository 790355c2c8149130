"""A step's advantages, estimated on the learner ranks, where the batch already is.

Each rank holds its shard of the step's batch, scored (old, reference and teacher log-probs,
critic values). The estimators see the whole step (REINFORCE++'s and PPO's whitening are over the
batch), so with several ranks the ranks gather the scored per-token inputs among themselves,
each computes the same estimate (`rl/algo/estimate.py`, pure) and keeps its own rows. From the
driver come only the rewards, one per sample (`Outcomes`); back go only the estimate's metrics.
"""

from __future__ import annotations

import torch

from rl.algo.estimate import Estimate, estimate_advantages
from rl.config.schema import AlgorithmConfig
from rl.data.batch import shard_rows
from rl.data.types import Outcomes, TrainBatch


def student_logprobs(batch: TrainBatch) -> torch.Tensor:
    """The policy's log-probs of the sampled tokens before this update: the learner's where it
    scored them (trainer.recompute_old_logprobs), else the rollout engine's."""
    return batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs


def gather_rows(part: torch.Tensor, index: list[torch.Tensor], width: int, device: torch.device | str) -> torch.Tensor:
    """Every rank's rows of a per-row tensor ([rows] or [rows, <= width]), in the step's row order
    (`index[r]`: rank r's rows, `shard_rows`), on CPU. A collective: every rank calls it."""
    flat = part.dim() == 1
    part = part[:, None] if flat else part
    width = 1 if flat else width
    most = max(len(rows) for rows in index)
    padded = torch.zeros((most, width), dtype=part.dtype, device=device)  # NCCL gathers CUDA tensors only
    padded[: part.shape[0], : part.shape[1]] = part.to(device)
    parts = [torch.empty_like(padded) for _ in index]
    torch.distributed.all_gather(parts, padded)
    whole = torch.zeros((sum(len(rows) for rows in index), width), dtype=part.dtype)
    for rows, got in zip(index, parts):
        whole[rows] = got[: len(rows)].cpu()
    return whole[:, 0] if flat else whole


def estimate_on_ranks(settings: AlgorithmConfig, shard: TrainBatch, outcomes: Outcomes, kl_coef: float, rank: int,
                      world_size: int, width: int, device: torch.device | str) -> Estimate:
    """This rank's rows of the step's estimate: its `shard` (scored) is rows `shard_rows(...)[rank]`
    of a batch `width` tokens wide (less the first). One rank: the shard is the batch."""
    inputs = {"mask": shard.loss_mask, "old_logprobs": shard.old_logprobs, "ref_logprobs": shard.ref_logprobs,
              "values": shard.values, "turn_rewards": shard.turn_rewards, "teacher_logprobs": shard.teacher_logprobs,
              "student_logprobs": student_logprobs(shard), "episode_index": shard.episode_index}
    index = None
    if world_size > 1:
        n_rows = len(outcomes.reward) if shard.episode_index is None else None
        if n_rows is None:  # an episode's segments are rows of their own: count the rows
            count = torch.tensor([len(shard)], device=device)
            torch.distributed.all_reduce(count)
            n_rows = int(count)
        index = shard_rows(n_rows, world_size)
        inputs = {k: None if v is None else gather_rows(v, index, width, device) for k, v in inputs.items()}
    est = estimate_advantages(settings, outcomes.reward, outcomes.valid, outcomes.group_ids, inputs.pop("mask"),
                              kl_coef, **inputs)
    if index is None:
        return est
    mine, own_width = index[rank], shard.loss_mask.shape[1]
    returns = None if est.returns is None else est.returns[mine, :own_width]
    return Estimate(est.advantages[mine, :own_width], returns, est.metrics)
