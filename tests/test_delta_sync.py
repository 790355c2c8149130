"""Delta weight syncs (`trainer.delta_sync`, rl/wire/delta.py): the codec with hand-computed
values, and a sender and two receivers in real processes over gloo: the first sync whole, then
only the changed values, a receiver whose copy went wrong caught by its checksum and mended by a
whole sync, and a large change sent whole."""

from __future__ import annotations

import pickle
import zlib

import pytest
import torch

from tests.members import run_members
from rl.wire.collective import free_port, init_group
from rl.wire.delta import (DELTA_FULL, DELTA_SPARSE, DELTA_UNCHANGED, DeltaReceiver, DeltaSender, apply_delta,
                           encode_delta)
from rl.wire.format import WeightMeta, checksum


def test_encode_sends_the_changed_values_while_they_take_at_most_the_fraction() -> None:
    old = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # one value changed: 4 bytes of position + 4 of value = 8 <= 0.5 x 16 bytes
    mode, positions, values, changed = encode_delta(torch.tensor([1.0, 5.0, 3.0, 4.0]), old, 0.5)
    assert (mode, positions.tolist(), values.tolist(), changed) == (DELTA_SPARSE, [1], [5.0], 1)
    assert positions.dtype == torch.int32
    # two changed: 16 bytes > 8: whole
    assert encode_delta(torch.tensor([0.0, 5.0, 3.0, 4.0]), old, 0.5)[0::3] == (DELTA_FULL, 2)
    assert encode_delta(old.clone(), old, 0.5)[0::3] == (DELTA_UNCHANGED, 0)
    assert encode_delta(old, None, 0.5)[0::3] == (DELTA_FULL, 4)  # nothing to change: whole


def test_changes_are_bits_not_values() -> None:
    nan = torch.tensor([float("nan"), 0.0])
    assert encode_delta(nan.clone(), nan, 1.0)[0] == DELTA_UNCHANGED  # NaN == NaN bit for bit
    mode, positions, _, _ = encode_delta(torch.tensor([float("nan"), -0.0]), nan, 1.0)
    assert mode == DELTA_SPARSE and positions.tolist() == [1]  # -0.0 is another value to send
    bf16 = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    # 1 + 1e-3 rounds back to 1.0 in bf16 (its step at 1 is 2^-7): no change to send
    assert encode_delta((bf16.float() + 1e-3).to(torch.bfloat16), bf16, 1.0)[0] == DELTA_UNCHANGED


def test_apply_writes_the_values_at_their_positions_and_the_checksum_is_crc32() -> None:
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0])
    apply_delta(kept, torch.tensor([3, 0], dtype=torch.int32), torch.tensor([-4.0, -1.0]))
    assert kept.tolist() == [-1.0, 2.0, 3.0, -4.0]
    assert checksum(kept) == zlib.crc32(kept.numpy().tobytes())
    flipped = kept.clone()
    flipped.view(torch.int32)[2] ^= 1  # one bit of the last place
    assert checksum(flipped) != checksum(kept)
    half = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)  # an odd count of 2-byte values
    assert checksum(half) == zlib.crc32(half.view(torch.int16).numpy().tobytes())


METAS = [WeightMeta("a", (4, 8), "float32"), WeightMeta("b", (64,), "bfloat16")]
LIMIT = 256  # bytes per bucket: "a" (128 bytes) and "b" (128) in one bucket each (different dtypes)


def _weights(step: int) -> list[torch.Tensor]:
    a = torch.arange(32.0).reshape(4, 8)
    b = torch.linspace(-1, 1, 64).to(torch.bfloat16)
    if step >= 2:
        a[1, 2] += 0.5  # one of 32 values: 8 bytes instead of 128
    if step >= 4:
        b = b + 1.0  # nearly every value: sent whole
    return [a, b]


def _member(rank: int, port: int, out) -> None:  # (tests/members.py)
    group = init_group("127.0.0.1", port, rank, 3, "gloo", timeout_s=60)
    if rank == 0:
        sender, sent = DeltaSender(max_fraction=0.5), []
        for step, full in ((1, False), (2, False), (3, False), (3, True), (4, False)):
            a, b = _weights(step)
            sent.append(sender.send(group, [[a], [b]], full=full))
        out.put(pickle.dumps((0, sent)))
        return
    receiver, got = DeltaReceiver(), []
    for step in (1, 2, 3, 3, 4):
        if step == 3 and rank == 2 and len(got) == 2:
            receiver.kept[0][5] = -7.0  # this receiver's copy goes wrong between two syncs
        stats: dict[str, float] = {}
        tensors = {name: t.clone() for name, t in
                   receiver.receive(group, METAS, "cpu", limit=LIMIT, stats=stats)}
        got.append((stats["bytes"], stats["delta_mismatch"], tensors))
    out.put(pickle.dumps((rank, got)))


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_a_sender_and_two_receivers_in_real_processes() -> None:
    results = run_members(_member, 3, free_port())
    sent = results[0]
    # 1: whole (nothing held yet): 128 + 128 bytes; 2: one float32 with its position (8 bytes),
    # "b" unchanged; 3: nothing changed (a receiver's bad copy is its own); 3 again, whole;
    # 4: "b" changed all over: whole, "a" as at 3
    assert [s["bytes"] for s in sent] == [256, 8, 0, 256, 128]
    assert [s["changed"] for s in sent] == [96, 1, 0, 96, 64]
    assert [s["full_buckets"] for s in sent] == [2, 0, 0, 2, 1]
    for rank in (1, 2):
        for k, (step, (nbytes, mismatch, tensors)) in enumerate(zip((1, 2, 3, 3, 4), results[rank])):
            assert nbytes == sent[k]["bytes"]
            bad = rank == 2 and k == 2  # the receiver whose copy went wrong, at the sync after it
            assert mismatch == (1 if bad else 0), (rank, k)
            a, b = _weights(step)
            assert torch.equal(tensors["a"], a) != bad and torch.equal(tensors["b"], b), (rank, k)


class _Recorder:
    """A group that records what rank 0 broadcasts (no peers)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, flat: torch.Tensor) -> None:
        self.sent.append(flat.clone())


def test_a_bucket_that_changed_everywhere_goes_whole_uncompared_for_a_while() -> None:
    from rl.wire.delta import DENSE_SYNCS

    sender, group = DeltaSender(max_fraction=0.5), _Recorder()
    w = torch.zeros(8)
    sender.send(group, [[w]])  # first: whole
    sender.send(group, [[w + 1.0]])  # every value changed: whole, and marked dense
    assert sender.dense == [DENSE_SYNCS]
    group.sent.clear()
    stats = sender.send(group, [[w + 1.0]])  # nothing changed, but not compared: whole
    assert stats["full_buckets"] == 1 and group.sent[0].tolist() == [DELTA_FULL, 0, 0] and len(group.sent) == 2
    assert sender.dense == [DENSE_SYNCS - 1]
    sender.dense = [0]  # once the count runs out, compared again
    assert sender.send(group, [[w + 1.0]])["bytes"] == 0
