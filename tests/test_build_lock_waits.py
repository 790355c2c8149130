"""A wait outside our code, named (issue 58, point 6): DeepSpeed builds its ops with torch's
`cpp_extension.load`, which waits on `<build folder>/lock` (torch's FileBaton) while another
process builds, without a word and without end. A first run interrupted while it compiled left
that lock, and every later run waited in `LearnerWorker.setup` in silence. Now a lock is looked at
before DeepSpeed starts: who holds it (a process on this machine keeps it open), and if no one,
whether its build folder is still being written. Real locks, made by torch's own FileBaton in real
processes that hold them, release them or are killed holding them, in a temporary folder of
extensions (given as `root`, or as TORCH_EXTENSIONS_DIR to a process of its own: never set in
this one, whose background builds (tests/prebuild.py) would build in it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.utils.file_baton

import trainer.build_locks as engine
from trainer.build_locks import BuildLockError, await_build_locks, build_locks, require_no_stale_build_lock

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# A build in a process of its own: torch's FileBaton (loaded from its file: no torch import, so it
# starts in a blink) takes the op's lock as `cpp_extension._jit_compile` does, says so, "compiles"
# for `hold` seconds and releases it; killed meanwhile, it leaves the lock behind.
BUILDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("file_baton", sys.argv[1])
baton_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(baton_module)
baton = baton_module.FileBaton(sys.argv[2])
assert baton.try_acquire()
print("holding", flush=True)
time.sleep(float(sys.argv[3]))
baton.release()
"""


def _build(lock: str, hold_s: float) -> subprocess.Popen:
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, torch.utils.file_baton.__file__, lock, str(hold_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def _interrupted_build(lock: str) -> None:
    """A build killed while it held the lock (Ctrl-C during a first run's compile)."""
    proc = _build(lock, 600)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert os.path.exists(lock)


@pytest.fixture
def extensions(tmp_path):
    return tmp_path / "torch_extensions"


def test_a_lock_left_by_a_killed_build_is_refused_before_the_run_with_its_path_and_fix(extensions):
    lock = str(extensions / "deepspeed_shm_comm" / "lock")
    _interrupted_build(lock)
    [found] = build_locks(str(extensions))
    assert found.path == lock and found.holders == () and not found.stale  # no one holds it; left moments ago
    with pytest.raises(BuildLockError) as err:
        require_no_stale_build_lock(root=str(extensions))
    message = str(err.value)
    assert f"rm {lock}" in message and "no process on this machine holds it" in message
    assert "interrupted" in message and os.path.exists(lock)  # the user decides (another machine may build)


@pytest.mark.slow
def test_a_run_stops_before_ray_starts_naming_the_lock_and_the_fix(extensions, tmp_path):
    """`python -m launch.train` on a machine where an interrupted build left a lock: the check
    before Ray starts (launch/checks.py, check_host) says `error: ...` with the lock and the fix,
    exit 2, instead of learners that wait in their set-up in silence."""
    lock = str(extensions / "cpu_adam" / "lock")
    _interrupted_build(lock)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    out = subprocess.run([sys.executable, "-m", "launch.train", f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"error: torch's build lock {lock}" in out.stderr and f"remove it: rm {lock}" in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "run")  # nothing started


def test_a_stale_lock_is_removed_and_said(extensions, monkeypatch):
    """Once no process holds it and nothing was written in its folder for QUIET_BUILD_S, the lock
    is an interrupted build's: removed (the check and the learners say so), and the next build
    takes the lock as torch does."""
    monkeypatch.setattr(engine, "QUIET_BUILD_S", 0.3)
    lock = str(extensions / "deepspeed_shm_comm" / "lock")
    _interrupted_build(lock)
    said: list[str] = []
    started = time.monotonic()
    assert await_build_locks(said.append, report_s=0.1, poll_s=0.05, root=str(extensions)) == [lock]
    assert time.monotonic() - started < 30 and not os.path.exists(lock)
    assert any(line.startswith("waiting") and f"rm {lock}" in line for line in said), said
    assert said[-1].startswith(f"removed torch's build lock {lock}")
    _interrupted_build(lock)
    os.utime(lock, (time.time() - 1, time.time() - 1))
    said.clear()
    require_no_stale_build_lock(said.append, root=str(extensions))
    assert not os.path.exists(lock) and said[0].startswith(f"removed torch's build lock {lock}")
    baton = torch.utils.file_baton.FileBaton(lock)
    assert baton.try_acquire()
    baton.release()


@pytest.mark.slow
def test_a_build_under_way_is_waited_for_with_its_holder_named_and_a_deadline(extensions):
    lock = str(extensions / "cpu_adam" / "lock")
    builder = _build(lock, 3)
    try:
        [found] = build_locks(str(extensions))
        assert found.holders == (builder.pid,) and not found.stale
        said: list[str] = []
        require_no_stale_build_lock(said.append, root=str(extensions))  # a build under way stops no run
        assert said == [f"note: {found.describe()}; the learners wait for it to finish"]
        started = time.monotonic()
        assert await_build_locks(said.append, report_s=0.5, poll_s=0.1, root=str(extensions)) == []  # waited for
        assert 1.5 < time.monotonic() - started < 60
        assert builder.wait(30) == 0 and not os.path.exists(lock)
        waits = [line for line in said if line.startswith("waiting")]
        assert waits and all(f"process {builder.pid} on this machine is building it" in line for line in waits)
        assert f"end process {builder.pid}, or remove the lock: rm {lock}" in waits[0]
    finally:
        builder.kill()
    stuck = _build(lock, 600)
    try:
        with pytest.raises(BuildLockError, match=rf"waited \d+ s for .*process {stuck.pid} .*rm {lock}"):
            await_build_locks(lambda line: None, deadline_s=1.0, poll_s=0.1, root=str(extensions))
        assert os.path.exists(lock)  # a live build's lock is never removed
    finally:
        stuck.kill()
        stuck.wait(30)


@pytest.mark.slow
def test_deepspeed_setup_says_what_it_waits_on_then_goes_on(extensions, request):
    """The whole way: a DeepSpeed process group set up (`init_single_process`, the learners'
    `join_data_parallel` does the same) where an interrupted build left the op's lock. It says
    what it waits on and how to clear it, removes the lock once it is stale, and DeepSpeed loads
    its op; the old code waited in torch's FileBaton without end."""
    from tests.conftest import _prebuilt

    _prebuilt(request, "deepspeed_ops")  # the op built in the usual folder: copied, it is not built again
    from torch.utils.cpp_extension import _get_build_directory

    shutil.copytree(_get_build_directory("deepspeed_shm_comm", verbose=False), extensions / "deepspeed_shm_comm")
    lock = str(extensions / "deepspeed_shm_comm" / "lock")
    _interrupted_build(lock)
    # (the lock's mtime set to now just before: left moments ago, however long the imports took)
    code = ("import os, trainer.build_locks as b, trainer.engine as e; b.QUIET_BUILD_S = 3.0; "
            f"b.BUILD_LOCK_REPORT_S = 1.0; os.utime({lock!r}); e.init_single_process(); "
            "print('process group up', flush=True)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "1"}
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still waiting after 240 s: {exc.stdout!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("waiting") and f"rm {lock}" in line and "no process on this machine holds it"
               in line for line in lines), out.stdout
    assert any(line.startswith(f"removed torch's build lock {lock}") for line in lines), out.stdout
    assert lines[-1] == "process group up" and not os.path.exists(lock)
