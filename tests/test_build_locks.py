"""A DeepSpeed op build killed mid-way (Ctrl-C during a first run) leaves torch's build lock; every
later learner would wait on it until its start-up deadline. Learners remove a stale one first."""

from __future__ import annotations

import os
import threading
import time

from torch.utils.file_baton import FileBaton

from trainer.build_locks import STALE_BUILD_LOCK_S, clear_stale_build_locks


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60  # left by a build killed 11 minutes ago
    os.utime(stale, (old, old))
    # what torch's build does with a lock that is there: wait for it to go (forever, for this one)
    waiter = threading.Thread(target=FileBaton(str(stale), wait_seconds=0.01).wait, daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    assert clear_stale_build_locks() == [str(stale)]
    waiter.join(5)
    assert not waiter.is_alive() and not stale.exists()
    assert fresh.exists()  # a build in progress (another learner's) keeps its lock
    assert clear_stale_build_locks() == []
