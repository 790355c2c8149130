"""Spawned processes that each join a group and report back: the scaffolding of the weight-sync
wire tests (a member is `target(rank, *args, out)` and puts `pickle.dumps((rank, result))` on
`out`; pickled there, since a tensor put on a queue as it is travels as a handle into the member's
memory, gone when the parent reads it after the member ended)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from typing import Any, Callable


def run_members(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 120.0) -> dict[int, Any]:
    """Start `world` members, `target(rank, *args, out)`; their results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(pickle.loads(out.get(timeout=timeout_s)) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
