"""The weight-sync wire protocol (`rl.weight_sync`) between real processes: buckets arrive whole
and in order at every receiver, and a group whose peer never comes fails instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from rl.weight_sync import WeightMeta, free_port, init_group, receive, send

METAS = [WeightMeta("a", (2, 3), "float32"), WeightMeta("b", (4,), "float32"), WeightMeta("c", (2,), "bfloat16")]
TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "b": -torch.arange(4.0), "c": torch.tensor([1.5, 2.5], dtype=torch.bfloat16)}


def _member(rank: int, port: int, world: int, out) -> None:
    group = init_group("127.0.0.1", port, rank, world, "gloo", timeout_s=60)
    if rank == 0:
        send(group, [[TENSORS["a"], TENSORS["b"]], [TENSORS["c"]]])  # the buckets `buckets(METAS)` makes
        out.put((0, {}))
    else:
        out.put((rank, {name: t.clone() for name, t in receive(group, METAS)}))


def test_rank0_broadcasts_every_bucket_to_every_receiver() -> None:
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_member, args=(rank, port, 3, out)) for rank in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    for rank in (1, 2):
        assert list(results[rank]) == ["a", "b", "c"]
        for name, t in results[rank].items():
            assert t.dtype == TENSORS[name].dtype and torch.equal(t, TENSORS[name])


def test_a_peer_that_never_joins_fails_the_group_in_bounded_time() -> None:
    start = time.perf_counter()
    with pytest.raises(Exception):  # torch's DistStoreError: not every member joined in time
        init_group("127.0.0.1", free_port(), 0, 2, "gloo", timeout_s=2)
    assert time.perf_counter() - start < 30
