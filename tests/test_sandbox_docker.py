"""The Docker sandbox backend against a real engine.

The module fixture uses the engine that answers; on a clean machine (root with apt-get) it starts
one with sandbox/image/start_dockerd.sh and builds the image with sandbox/image/build_rootfs.sh
(about a minute the first time, in the background from the start of the session: `start_setup`).
Where neither works the module is skipped with the exact error.
Every hostile program must be contained with the right outcome while the container survives, and
a closed box or backend must leave nothing behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from sandbox.backend import SandboxUnavailable
from sandbox.job import COMPILE_LIMITS, Limits

pytestmark = [pytest.mark.slow, pytest.mark.full]  # installs and starts a Docker engine: the full lane

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
IMAGE_DIR = os.path.join(ROOT, "sandbox", "image")
IMAGE = os.environ.get("SANDBOX_IMAGE", "rlpost-sandbox:bookworm")   # build_rootfs.sh reads it too
FAST = Limits(wall_s=5.0, cpu_s=2.0, memory_mb=256)

HELLO_C = b'#include <stdio.h>\nint main(void) { puts("hello from the box"); return 0; }\n'
FORK_BOMB_C = b"#include <unistd.h>\nint main(void) { for (;;) fork(); }\n"
MEMORY_BOMB_C = b"""#include <stdlib.h>
#include <string.h>
int main(void) {
    for (;;) {
        char *p = malloc(1 << 20);
        if (!p) return 3;
        memset(p, 1, 1 << 20);
    }
}
"""
BENCH_C = b"""#include <stdio.h>
int main(void) {
    long n, s = 0;
    if (scanf("%ld", &n) != 1) return 1;
    for (long i = 0; i < n; i++) s += (i * i) % 7;
    printf("%ld\\n", s);
    return 0;
}
"""


# -- engine, image and backend ------------------------------------------------------------------

def _engine_error() -> str:
    """'' when an engine answers, else why not."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - the reason is reported in the skip message
        return f"{type(e).__name__}: {e}"
    return ""


def _image_present() -> bool:
    import docker

    client = docker.from_env(timeout=30)
    try:
        client.images.get(IMAGE)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def _setup_step(script: str, timeout_s: int, log: list[str], niceness: int = 0) -> str:
    """Run one of sandbox/image/*.sh: '' when it succeeded, else why not (with its output)."""
    path = os.path.join(IMAGE_DIR, script)
    log.append(f"docker fixture: running {path}")
    started = time.monotonic()
    try:
        p = subprocess.run(["nice", "-n", str(niceness), "bash", path], capture_output=True, text=True,
                           timeout=timeout_s, env={**os.environ, "SANDBOX_IMAGE": IMAGE})
    except subprocess.TimeoutExpired:
        return f"{script} did not finish within {timeout_s}s"
    log.append(f"{p.stdout}{p.stderr}({time.monotonic() - started:.1f}s)")
    if p.returncode == 0:
        return ""
    return f"{script} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}"


def _set_up(log: list[str]) -> str:
    """A Docker engine with the sandbox image, set up from scratch where possible: '' when there
    is one, else why not (the module's skip reason)."""
    can_setup = os.geteuid() == 0 and shutil.which("apt-get") is not None
    err = _engine_error()
    if err:
        if not can_setup:
            return f"no Docker engine ({err}) and no way to start one (needs root and apt-get)"
        reason = _setup_step("start_dockerd.sh", 600, log)
        if reason:
            return reason
        err = _engine_error()
        if err:
            return f"start_dockerd.sh ran but no engine answers: {err}"
    if not _image_present():
        if not can_setup:
            return f"image {IMAGE} missing and building it needs root"
        # in the background while other tests run: at the lowest priority, so it takes idle CPU only
        # (not the engine's start above, whose processes the containers would inherit it from)
        return _setup_step("build_rootfs.sh", 1800, log, niceness=19)
    return ""


SETUP: dict = {"log": []}  # the background setup: its thread, its log, its outcome


def start_setup() -> None:
    """Begin the setup in a thread of this process, once: on a clean machine it is a minute and
    more of mostly network and disk (apt, debootstrap), which then overlaps the tests that run
    before this module (tests/conftest.py starts it once the session's tests are collected)."""
    if "thread" not in SETUP:
        SETUP["thread"] = threading.Thread(target=lambda: SETUP.update(reason=_set_up(SETUP["log"])),
                                           name="docker-setup", daemon=True)
        SETUP["thread"].start()


@pytest.fixture(scope="module")
def engine() -> None:
    """The engine and image of the background setup (started here if the session did not)."""
    start_setup()
    SETUP["thread"].join(timeout=2400)  # the setup steps' own deadlines sum to 2400 s
    print("\n".join(SETUP["log"]), flush=True)
    reason = "the docker setup did not finish within 2400 s" if SETUP["thread"].is_alive() else SETUP["reason"]
    if reason:
        print(f"docker fixture: {reason}", flush=True)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def backend(engine):
    from sandbox.docker import DockerBackend

    be = DockerBackend(IMAGE)
    yield be
    be.close()


@pytest.fixture
def box(backend):
    with backend.box() as b:
        yield b


def container(backend):
    import docker

    return docker.from_env().containers.get(backend.container_id)


def uids_in_container(backend) -> list[int]:
    """The uid of every process in the backend's container (as its own non-root user sees it)."""
    out = container(backend).exec_run(["ps", "-eo", "uid="]).output.decode()
    return [int(u) for u in out.split()]


def build(box, name: str, source: bytes, *flags: str) -> None:
    box.write(f"{name}.c", source)
    out = box.run(["gcc", "-O2", *flags, "-o", name, f"{name}.c"], limits=COMPILE_LIMITS)
    assert out.exit_code == 0, out.stderr.decode(errors="replace")


def assert_alive(backend) -> None:
    with backend.box() as b:
        out = b.run(["echo", "still alive"], limits=FAST)
    assert out.exit_code == 0 and out.stdout == b"still alive\n", out


# -- it works ---------------------------------------------------------------------------------

def test_compile_and_run_c(box):
    build(box, "hello", HELLO_C)
    out = box.run(["./hello"], limits=FAST)
    assert out.exit_code == 0 and out.signal is None, out
    assert out.stdout == b"hello from the box\n"
    assert not (out.timed_out or out.memory_exceeded or out.output_exceeded)
    assert 0 <= out.wall_s < 2.0


def test_cpp_exit_status_and_stdin(box):
    box.write("a.cpp", b"#include <iostream>\nint main(){int a,b;std::cin>>a>>b;"
                       b"std::cout<<a+b<<std::endl;return 7;}\n")
    assert box.run(["g++", "-O2", "-o", "a", "a.cpp"], limits=COMPILE_LIMITS).exit_code == 0
    out = box.run(["./a"], stdin=b"2 40\n", limits=FAST)
    assert out.exit_code == 7 and out.stdout == b"42\n", out


def test_python3_runs_with_stdin_and_cpu_accounting(box):
    code = "import sys\nx = sum(i * i for i in range(3_000_000))\nprint(sys.stdin.read()[::-1], x)"
    out = box.run(["python3", "-c", code], stdin=b"abc", limits=FAST)
    assert out.exit_code == 0, out
    assert out.stdout.startswith(b"cba ")
    assert 0.05 < out.cpu_s <= out.wall_s + 0.05


def test_missing_command_is_exit_127(box):
    out = box.run(["no-such-program"], limits=FAST)
    assert out.exit_code == 127 and b"no-such-program" in out.stderr


def test_write_read_round_trip(box):
    data = bytes(range(256)) * 1000
    box.write("sub/dir/blob.bin", data)
    assert box.read("sub/dir/blob.bin") == data
    assert box.read("sub/dir/blob.bin", max_bytes=10) == data[:10]
    assert box.read("absent") is None
    box.write("run.sh", b"#!/bin/sh\necho script ran\n", executable=True)
    assert box.run(["./run.sh"], limits=FAST).stdout == b"script ran\n"
    with pytest.raises(ValueError):
        box.write("../escape", b"x")
    with pytest.raises(ValueError):
        box.read("/etc/passwd")


# -- isolation --------------------------------------------------------------------------------

def test_no_network(box):
    code = ("import socket\ns = socket.socket()\ns.settimeout(3)\n"
            "try:\n    s.connect(('1.1.1.1', 80))\nexcept OSError as e:\n    print('refused', e)\n"
            "else:\n    print('CONNECTED')\n"
            "import os\nprint(sorted(os.listdir('/sys/class/net')))")
    out = box.run(["python3", "-c", code], limits=FAST)
    assert out.exit_code == 0, out
    assert b"refused" in out.stdout and b"CONNECTED" not in out.stdout
    assert out.stdout.strip().endswith(b"['lo']")


def test_root_filesystem_is_read_only(box):
    for path in ("/usr/x", "/etc/x", "/x"):
        out = box.run(["sh", "-c", f"echo x > {path}"], limits=FAST)
        assert out.exit_code != 0 and b"Read-only file system" in out.stderr, (path, out)


def test_runs_as_a_non_root_uid_without_capabilities(box):
    out = box.run(["sh", "-c", "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"],
                  limits=Limits(processes=4))
    lines = out.stdout.decode().split("\n")
    assert int(lines[0]) not in (0, 10001) and int(lines[0]) == box.uid
    assert "CapEff:\t0000000000000000" in lines and "NoNewPrivs:\t1" in lines


def test_removing_its_own_work_dir_fails_the_program_not_the_sandbox(box):
    box.write("f", b"x")
    out = box.run(["sh", "-c", 'rm -rf "$HOME"'], limits=Limits(processes=4))
    assert out.exit_code == 0, out
    out = box.run(["echo", "hi"], limits=FAST)
    assert out.exit_code == 127 and b"cannot enter the work dir" in out.stderr, out
    assert box.read("f") is None
    box.write("g", b"back")      # a write recreates it
    assert box.run(["cat", "g"], limits=FAST).stdout == b"back"


def test_boxes_cannot_see_each_other(backend):
    with backend.box() as a, backend.box() as b:
        a.write("secret.txt", b"s3cret")
        assert a.uid != b.uid
        out = b.run(["cat", f"{a.dir}/secret.txt"], limits=FAST)
        assert out.exit_code != 0 and b"Permission denied" in out.stderr
        out = b.run(["sh", "-c", f"echo x > {a.dir}/planted"], limits=FAST)
        assert out.exit_code != 0
        assert a.read("planted") is None


def test_concurrent_boxes(backend):
    results: dict[int, object] = {}

    def work(i: int) -> None:
        with backend.box() as b:
            b.write("x.py", f"print({i} * 2)".encode())
            results[i] = b.run(["python3", "x.py"], limits=FAST)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for i, out in results.items():
        assert out.exit_code == 0 and out.stdout == f"{i * 2}\n".encode(), out


# -- hostile programs -------------------------------------------------------------------------

def test_infinite_loop_times_out_promptly(box, backend):
    started = time.monotonic()
    out = box.run(["sh", "-c", "while :; do :; done"], limits=Limits(wall_s=1.0, cpu_s=5.0))
    elapsed = time.monotonic() - started
    assert out.timed_out and out.signal == 9 and out.exit_code is None, out
    assert 0.9 < out.wall_s < 1.5 and elapsed < 3.0
    assert box.uid not in uids_in_container(backend)


def test_cpu_limit_kills_a_busy_loop(box):
    started = time.monotonic()
    out = box.run(["python3", "-c", "while True: pass"], limits=Limits(wall_s=20.0, cpu_s=1.0))
    assert out.timed_out and out.signal in (24, 9), out      # SIGXCPU, or SIGKILL at the hard cap
    assert 0.9 < out.cpu_s < 2.5 and time.monotonic() - started < 5.0


def test_ten_mb_of_stdout_is_cut_at_the_cap(box, backend):
    started = time.monotonic()
    ten_mb = "import sys\nfor _ in range(10): sys.stdout.write('x' * 2**20)"
    out = box.run(["python3", "-c", ten_mb], limits=Limits(output_bytes=1 << 20))
    assert out.output_exceeded and len(out.stdout) == 1 << 20, (len(out.stdout), out.exit_code)
    assert time.monotonic() - started < 5.0
    assert box.uid not in uids_in_container(backend)


def test_file_size_limit(box):
    out = box.run(["dd", "if=/dev/zero", "of=big", "bs=64k", "count=64"],
                  limits=Limits(file_bytes=1 << 20))
    assert out.output_exceeded and out.signal == 25, out    # SIGXFSZ
    assert len(box.read("big", 8 << 20)) == 1 << 20


def test_fork_bomb_is_contained(box, backend):
    build(box, "bomb", FORK_BOMB_C)
    # The per-box RLIMIT_NPROC refuses the forks; the bomb spins until the wall limit.
    out = box.run(["./bomb"], limits=Limits(wall_s=1.5, processes=8))
    assert out.timed_out, out
    # With a huge per-box allowance the container's pids limit stops it, and is reported.
    out = box.run(["./bomb"], limits=Limits(wall_s=1.5, processes=100_000))
    assert out.timed_out and out.process_limit_hit, out
    assert box.uid not in uids_in_container(backend)
    assert box.run(["echo", "ok"], limits=FAST).stdout == b"ok\n"
    assert_alive(backend)


def test_leftover_processes_die_with_the_command(box, backend):
    out = box.run(["sh", "-c", "setsid sleep 300 & (sleep 301 &) ; echo started"],
                  limits=Limits(processes=8))
    assert out.exit_code == 0 and out.stdout == b"started\n", out
    assert box.uid not in uids_in_container(backend)


def test_memory_bomb_hits_the_address_space_limit(box, backend):
    build(box, "mbomb", MEMORY_BOMB_C)
    out = box.run(["./mbomb"], limits=Limits(memory_mb=256))
    assert out.exit_code == 3 and out.memory_exceeded, out   # malloc failed at RLIMIT_AS
    assert_alive(backend)


def test_memory_bomb_over_the_container_limit_is_oom_killed(engine):
    """A per-command allowance above the container's memory: the cgroup OOM killer takes the job
    (it made itself the first choice), not the container."""
    from sandbox.docker import DockerBackend

    with DockerBackend(IMAGE, memory_mb=256, tmpfs_mb=64) as small:
        with small.box() as b:
            build(b, "mbomb", MEMORY_BOMB_C)
            out = b.run(["./mbomb"], limits=Limits(memory_mb=2048))
            assert out.memory_exceeded and out.signal == 9, out
        assert_alive(small)


FORGED = ("import os, sys, time\n"
          "sys.stderr.buffer.write(b'\\x1eRLPOST-SUPERVISE nonce=0 exit=0 signal=0 wall=0 cpu=0 '\n"
          "                        b'timed_out=0 output_exceeded=0 oom_kills=0 pids_max=0 '\n"
          "                        b'vm_peak=0 maxrss=0\\n')\n"
          "sys.stderr.flush()\n")


def test_forged_report_is_ignored(box):
    out = box.run(["python3", "-c", FORGED + "sys.exit(5)"], limits=FAST)
    assert out.exit_code == 5 and b"\x1eRLPOST-SUPERVISE nonce=0" in out.stderr, out


def test_killing_the_supervisor_is_a_violation(box, backend):
    """The command runs as the supervisor's uid and can kill it: then it is killed too and
    reported as a violation, never with a report it forged."""
    code = FORGED + "os.kill(-1, 9)\nprint('survived', flush=True)\ntime.sleep(1)\nsys.exit(0)"
    out = box.run(["python3", "-c", code], limits=Limits(wall_s=5.0))
    assert out.violation and out.exit_code is None and out.signal == 9, out
    assert box.uid not in uids_in_container(backend)
    assert box.run(["echo", "ok"], limits=FAST).stdout == b"ok\n"


def test_command_cannot_look_into_its_supervisor(box):
    code = ("import ctypes, os\n"
            "sup = os.getppid()\n"
            "for path in (f'/proc/{sup}/mem', f'/proc/{sup}/environ', f'/proc/{sup}/fd/0'):\n"
            "    try:\n"
            "        open(path, 'rb').read(1)\n"
            "        print('READ', path)\n"
            "    except OSError as e:\n"
            "        print('denied', e.errno)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('ptrace', libc.ptrace(16, sup, 0, 0), ctypes.get_errno())\n")  # PTRACE_ATTACH
    out = box.run(["python3", "-c", code], limits=FAST)
    assert out.exit_code == 0, out
    assert b"READ" not in out.stdout and out.stdout.count(b"denied") == 3, out.stdout
    assert b"ptrace -1 1\n" in out.stdout, out.stdout     # EPERM


def test_stopping_the_supervisor_hits_the_host_deadline(engine):
    from sandbox.docker import DockerBackend

    with DockerBackend(IMAGE, host_grace_s=1.0) as be, be.box() as b:
        started = time.monotonic()
        out = b.run(["sh", "-c", "kill -STOP -1; sleep 60"], limits=Limits(wall_s=1.0, processes=4))
        assert out.timed_out and out.violation, out
        assert time.monotonic() - started < 5.0
        assert b.uid not in uids_in_container(be)
        assert b.run(["echo", "ok"], limits=FAST).stdout == b"ok\n"


# -- benchmarking ---------------------------------------------------------------------------------

def test_callgrind_instruction_count_is_deterministic(box):
    build(box, "bench", BENCH_C)
    totals = []
    for _ in range(2):
        out = box.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=cg.out", "./bench"],
                      stdin=b"200000\n", limits=Limits(wall_s=60.0, cpu_s=60.0, memory_mb=768))
        assert out.exit_code == 0, out.stderr[-2000:]
        report = box.read("cg.out", 1 << 22)
        totals.append(int(re.search(rb"^(?:summary|totals):\s*(\d+)", report, re.M).group(1)))
    assert totals[0] == totals[1] and totals[0] > 200_000


# -- cleanup ------------------------------------------------------------------------------------

def test_box_close_removes_its_dir_and_processes(backend):
    b = backend.box()
    b.write("f.txt", b"data")
    b.run(["sh", "-c", "echo x > /tmp/stray-$(id -u); echo y > /dev/shm/stray-$(id -u)"],
          limits=Limits(processes=4))
    ls = container(backend).exec_run(["ls", "-a", "/tmp", "/dev/shm"]).output.decode()
    assert os.path.basename(b.dir) in ls and f"stray-{b.uid}" in ls
    b.close()
    ls = container(backend).exec_run(["ls", "-a", "/tmp", "/dev/shm"]).output.decode()
    assert os.path.basename(b.dir) not in ls and f"stray-{b.uid}" not in ls, ls
    assert b.uid not in uids_in_container(backend)
    b.close()   # idempotent


def test_backend_close_removes_the_container(engine):
    import docker

    from sandbox.docker import LABEL, DockerBackend

    be = DockerBackend(IMAGE)
    cid = be.container_id
    client = docker.from_env()
    assert cid in [c.id for c in client.containers.list(all=True, filters={"label": LABEL})]
    be.close()
    assert cid not in [c.id for c in client.containers.list(all=True, filters={"label": LABEL})]
    if shutil.which("docker"):
        ps = subprocess.run(["docker", "ps", "-a", "-q", "--no-trunc", "--filter",
                             f"label={LABEL}"], capture_output=True, text=True)
        assert ps.returncode == 0 and cid not in ps.stdout


def test_leftovers_of_dead_owners_are_removed(engine):
    import socket

    import docker

    from sandbox.docker import LABEL, DockerBackend

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = docker.from_env()
    stale = client.containers.create(IMAGE, ["true"], labels={
        LABEL: "1", "rlpost.owner": f"{socket.gethostname()}:{dead.pid}"})
    with DockerBackend(IMAGE) as be:
        ids = [c.id for c in client.containers.list(all=True, filters={"label": LABEL})]
        assert stale.id not in ids and be.container_id in ids


def test_no_engine_is_a_clear_refusal():
    from sandbox.docker import DockerBackend

    with pytest.raises(SandboxUnavailable, match="start_dockerd.sh.*sandbox.backend=process"):
        DockerBackend(base_url="unix:///nonexistent/docker.sock")


def test_missing_image_is_a_clear_refusal(engine):
    from sandbox.docker import DockerBackend

    with pytest.raises(SandboxUnavailable, match="build_rootfs.sh"):
        DockerBackend("rlpost-sandbox:no-such-tag")


# -- the runner on top ----------------------------------------------------------------------------

def test_run_job_through_the_docker_backend(backend):
    runner = pytest.importorskip("sandbox.runner")
    from sandbox.job import Job, Language, Method, Status, TestCase

    job = Job(language=Language.C, source=BENCH_C.decode(),
              tests=(TestCase(stdin="10\n", expected_stdout="19"),),
              hidden_tests=(TestCase(stdin="7\n", expected_stdout="14"),),
              bench_stdin="50000\n", name="docker-smoke")
    results = [runner.run_job(job, backend) for _ in range(2)]
    for r in results:
        assert r.status is Status.OK, r
        assert r.backend == "docker" and r.tests_passed == r.tests_total == 2
        assert r.measurement.method is Method.INSTRUCTIONS and r.measurement.value > 50_000
    assert results[0].measurement.value == results[1].measurement.value
