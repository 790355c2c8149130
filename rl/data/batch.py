"""Turning scored samples into the learner's padded `TrainBatch`."""

from __future__ import annotations

from typing import Any

import torch

from rl.data.types import ScoredSample, TrainBatch


def _rows(scored: list[ScoredSample], segment_rows: bool) -> list[tuple[int, Any]]:
    """(sample index, the part laid out as a row): each sample's own part, then, with
    `segment_rows`, the earlier segments of the samples that did not fail (a failed one trains on
    nothing: its own row, zero-masked, keeps its place)."""
    rows: list[tuple[int, Any]] = [(i, s.sample) for i, s in enumerate(scored)]
    if segment_rows:
        rows += [(i, seg) for i, s in enumerate(scored) if s.error is None for seg in s.sample.segments or ()]
    return rows


def build_train_batch(scored: list[ScoredSample], pad_id: int, version: int, mask_truncated: bool = False,
                      max_staleness: int = 0, segment_rows: bool = False) -> TrainBatch:
    """Right-pad prompt+completion rows; the loss covers completion tokens of scored samples only
    (an episode's model tokens: its observation tokens are masked out). Episodes also get
    `turn_rewards`: each rewarded turn's reward on its last model token.

    A sample whose reward failed keeps its row (the learner's batch size stays fixed) with a zero
    loss mask, so it contributes nothing; so does a completion cut at the token budget when
    `mask_truncated` (DAPO's overlong filtering). Advantages are filled in later (`rl.algo.estimate`).
    Samples must come from policy versions `version - max_staleness` .. `version` (asynchronous
    rollouts, `algorithm.off_policy_steps`): older ones are refused, never trained on. (A failed
    sample, e.g. an agent that crashed before its first call, has no tokens of any version.)

    With `segment_rows`, an episode's earlier segments (`Sample.segments`: its prompt changed
    midway) are rows too, after the samples' own, each its own prompt + tokens under the episode's
    mask and finish reason; `episode_index` then says whose each row is, so that advantages are
    computed per episode (its reward counted once in its group) and spread to all of its rows.
    Without, only each episode's last segment is a row.
    """
    stale = {s.sample.policy_version for s in scored  # (a failed sample is never trained on: no date needed)
             if s.error is None and not version - max_staleness <= s.sample.policy_version <= version}
    if stale:
        raise RuntimeError(f"samples from policy versions {sorted(stale)} reached a step training version {version} "
                           f"(at most {max_staleness} behind allowed)")
    rows = _rows(scored, segment_rows)
    width = max(2, max(len(part.prompt_ids) + len(part.completion_ids) for _, part in rows))  # (all may be empty)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    rollout_lp = torch.zeros((b, width - 1))
    adv = torch.zeros((b, width - 1))
    episodes = any(s.sample.turns is not None for s in scored)
    turn_rewards = torch.zeros((b, width - 1)) if episodes else None
    for r, (i, part) in enumerate(rows):
        s = scored[i]
        p, c = part.prompt_ids, part.completion_ids
        input_ids[r, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attention[r, : len(p) + len(c)] = 1
        # position t predicts token t+1: completion token j sits at len(p)+j, predicted from len(p)+j-1
        span = slice(len(p) - 1, len(p) - 1 + len(c))
        rollout_lp[r, span] = torch.tensor(part.logprobs)
        if s.error is None and c and not (mask_truncated and s.sample.finish_reason == "length"):
            # an episode's observation tokens are not the model's: never in the loss
            mine = part.completion_mask
            loss_mask[r, span] = 1.0 if mine is None else torch.tensor(mine, dtype=torch.float32)
            for t in part.turns or () if turn_rewards is not None else ():
                if t.role == "model" and t.reward is not None:  # each rewarded turn's on its last model token
                    turn_rewards[r, len(p) - 1 + t.end - 1] += t.reward
    segmented = len(rows) > len(scored)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_lp,
        advantages=adv,
        group_ids=torch.tensor([scored[i].sample.group_id for i, _ in rows], dtype=torch.long),
        policy_version=version,
        turn_rewards=turn_rewards,
        episode_index=torch.tensor([i for i, _ in rows], dtype=torch.long) if segmented else None,
    )


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int,
                       groups: list[int] | None = None) -> list[list[int]]:
    """Row indices of each micro-batch cut by a token budget (`trainer.max_tokens_per_micro_batch`):
    rows sorted longest first, each micro-batch filled while its padded size (rows x its longest
    row) stays within `max_tokens` and its rows within `max_rows` (`trainer.micro_batch_size`); a
    row longer than the budget gets a micro-batch of its own. With `groups` (each row's group,
    for shared-prefix micro-batches) a group's rows go in together where they fit, groups sorted
    by their longest row; a group too large for one micro-batch is cut by the row rule. Every row
    lands in exactly one micro-batch. (Cuts by rows alone are `rl.plan.geometry.BatchGeometry`'s.)"""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens}: a token budget must be > 0 (row cuts: rl.plan.geometry)")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    units: dict[int, list[int]] = {}
    for i in order:  # each unit longest row first, units in the order of their longest rows
        units.setdefault(i if groups is None else groups[i], []).append(i)
    plan: list[list[int]] = []

    def fits(current: list[int], more: int) -> bool:  # a micro-batch's first row is its longest
        return len(current) + more <= max_rows and (len(current) + more) * lengths[current[0]] <= max_tokens

    for unit in units.values():
        if plan and fits(plan[-1], len(unit)):
            plan[-1].extend(unit)
            continue
        plan.append([unit[0]])
        for i in unit[1:]:
            if fits(plan[-1], 1):
                plan[-1].append(i)
            else:
                plan.append([i])
    return plan


def shard_rows(n_rows: int, world_size: int) -> list[torch.Tensor]:
    """Interleaved row indices per learner rank, so every rank sees a mix of groups and lengths."""
    return [torch.arange(rank, n_rows, world_size) for rank in range(world_size)]


def group_order(group_ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Row indices with each group's rows together (shared-prefix micro-batches compute a group's
    prompt once only where its rows meet): groups in a random order (`generator`; None: as they
    first appear), rows within a group as they are."""
    groups = list(dict.fromkeys(group_ids.tolist()))
    if generator is not None:
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    rank = {g: k for k, g in enumerate(groups)}
    keys = torch.tensor([rank[g] for g in group_ids.tolist()], dtype=torch.long)
    return torch.sort(keys, stable=True).indices


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """The plan cut into exactly `count` micro-batches (halving the largest) so that every
    data-parallel rank runs as many backward passes as the others (ZeRO reduces at each one)."""
    plan = [list(mb) for mb in plan]
    while len(plan) < count:
        largest = max(range(len(plan)), key=lambda j: len(plan[j]))
        if len(plan[largest]) < 2:
            raise ValueError(f"cannot split {sum(map(len, plan))} rows into {count} micro-batches")
        rows = plan.pop(largest)
        plan[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return plan
