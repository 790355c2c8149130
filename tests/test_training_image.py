"""The CPU training image: built with launch/docker/build.sh, the default job run in a container.

Marked `image` and kept out of the default run (pyproject's addopts say `-m 'not image'`): the
first build installs the whole stack (several minutes on 2 cores), later ones reuse the install
layer while pyproject.toml and launch/install.sh are unchanged. Run it with

    .venv/bin/python -m pytest -m image tests/test_training_image.py

It uses the Docker engine that answers; on a clean machine (root with apt-get) it starts one with
sandbox/image/start_dockerd.sh, as tests/test_sandbox_docker.py does, and is skipped with the
exact reason where no engine can be had. The build needs the Debian mirror (apt, debootstrap) and
this machine's pip indexes (the wheelhouse), not a container registry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

pytestmark = [pytest.mark.image, pytest.mark.slow]  # slow too: outside the fast lane (-m "not slow")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
IMAGE = os.environ.get("RLPOST_IMAGE", "rlpost-train:cpu")   # build.sh reads it too
STEPS = 3


def _run(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, **kwargs)


def _engine_error() -> str:
    """'' when an engine answers the docker CLI, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        p = _run(["docker", "info", "--format", "{{.ServerVersion}}"], 30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30s"
    return "" if p.returncode == 0 else (p.stderr or p.stdout).strip()[-500:]


@pytest.fixture(scope="module")
def engine() -> None:
    err = _engine_error()
    if not err:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"no Docker engine ({err}) and no way to start one (needs root and apt-get)")
    try:
        p = _run(["bash", "sandbox/image/start_dockerd.sh"], 600)
    except subprocess.TimeoutExpired:
        pytest.skip("sandbox/image/start_dockerd.sh did not finish within 600s")
    if p.returncode != 0:
        pytest.skip(f"sandbox/image/start_dockerd.sh failed (exit {p.returncode}): "
                    f"{(p.stderr or p.stdout).strip()[-1500:]}")
    err = _engine_error()
    if err:
        pytest.skip(f"start_dockerd.sh ran but no engine answers: {err}")


@pytest.fixture(scope="module")
def image(engine) -> str:
    """The CPU image, built (or brought up to date from the layer cache) by launch/docker/build.sh."""
    started = time.monotonic()
    p = _run(["bash", "launch/docker/build.sh", "cpu"], 3600, env={**os.environ, "RLPOST_IMAGE": IMAGE})
    took = time.monotonic() - started
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"build.sh failed (exit {p.returncode}) after {took:.0f}s:\n{out[-4000:]}"
    size = int(_run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], 60).stdout)
    print(f"built {IMAGE} in {took:.0f}s ({size / 1e9:.2f} GB)")
    return IMAGE


def test_image_has_the_sandbox_tools_and_runs_the_default_job_by_default(image):
    cmd = _run(["docker", "image", "inspect", "-f", "{{json .Config.Cmd}}", image], 60)
    assert json.loads(cmd.stdout) == ["python", "-m", "launch.train"]
    # install.sh finds its stamp (the venv is the recipe's); the packages import as the real ones
    # from any directory (not as namespace packages made of the install's placeholders).
    p = _run(["docker", "run", "--rm", "--network", "none", image, "sh", "-c",
              "for c in bwrap valgrind gcc g++; do command -v $c || exit 1; done && python --version && "
              "bash launch/install.sh && cd / && "
              "python -c 'import sandbox._helper, rl.config.schema; print(sandbox.__file__)' && echo OK"], 300)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.split("\n")
    assert [os.path.basename(x) for x in lines[:4]] == ["bwrap", "valgrind", "gcc", "g++"], p.stdout
    assert lines[4].startswith("Python 3.11."), p.stdout
    assert lines[5:7] == ["/opt/rlpost/sandbox/__init__.py", "OK"], p.stdout


# What docs/clusters-and-gpus.md gives a container for the code task's process sandbox (bubblewrap namespaces, a
# fresh /proc, per-run cgroups, its own seccomp filter); they weaken the container's own confinement.
SANDBOX_OPTS = ["--cap-add=SYS_ADMIN", "--security-opt", "seccomp=unconfined", "--security-opt",
                "apparmor=unconfined", "--security-opt", "systempaths=unconfined",
                "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw"]
SANDBOX_JOB = r"""
from sandbox.process import ProcessBackend
from sandbox.runner import run_job
from sandbox.job import Job, Language, TestCase

src = '''#include <stdio.h>
int main(void) {
    long n, s = 0;
    if (scanf("%ld", &n) != 1) return 1;
    for (long i = 0; i < n; i++) s += (i * i) % 7;
    printf("%ld\\n", s);
    return 0;
}
'''
job = Job(language=Language.C, source=src, tests=(TestCase(stdin="10\n", expected_stdout="19"),),
          hidden_tests=(TestCase(stdin="7\n", expected_stdout="14"),), bench_stdin="50000\n", name="image")
backend = ProcessBackend(slots=1)
try:
    r = run_job(job, backend)
finally:
    backend.close()
print(r.status.name, r.tests_passed, r.tests_total, r.measurement.method.name, r.measurement.value)
"""


def test_process_sandbox_in_a_container_needs_the_documented_options(image, tmp_path):
    """Without them the code task's sandbox refuses to start (it never runs untrusted code
    unisolated); with them a compile + test + benchmark job runs isolated in the container."""
    from sandbox.detect import missing, probe_host

    if missing(probe_host()):
        pytest.skip(f"this host cannot isolate either: {missing(probe_host())}")
    (tmp_path / "job.py").write_text(SANDBOX_JOB)
    run = ["docker", "run", "--rm", "--network", "none", "-v", f"{tmp_path}:/job:ro"]
    p = _run([*run, image, "python", "/job/job.py"], 300)
    assert p.returncode != 0 and "cannot isolate untrusted code" in p.stderr, p.stdout + p.stderr
    p = _run([*run, *SANDBOX_OPTS, image, "python", "/job/job.py"], 300)
    assert p.returncode == 0, p.stdout + p.stderr
    status, passed, total, method, value = p.stdout.split()
    assert (status, passed, total, method) == ("OK", "2", "2", "INSTRUCTIONS") and float(value) > 50_000, p.stdout


def test_default_job_runs_in_a_container(image, tmp_path):
    """A short default job: no network, the run directory on a host folder, one line per step and
    the closing reward line, summary.json and the final model written to the host."""
    started = time.monotonic()
    p = _run(["docker", "run", "--rm", "--network", "none", "--shm-size=8g",
              "-v", f"{tmp_path}:/out", image,
              "python", "-m", "launch.train", f"run.steps={STEPS}", "run.dir=/out/run"], 1800)
    took = time.monotonic() - started
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode} after {took:.0f}s:\n{out[-5000:]}"
    for step in range(1, STEPS + 1):
        assert re.search(rf"^step {step}/{STEPS} \| reward \d\.\d{{3}} \|", p.stdout, re.M), out[-5000:]
    final = re.search(r"^Reward mean: first 1 steps (\d\.\d+) -> last 1 steps (\d\.\d+)\. "
                      r"Run directory: /out/run$", p.stdout, re.M)
    assert final, out[-5000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_run"] == STEPS
    assert 0.0 <= summary["first_steps_reward_mean"] <= 1.0 and 0.0 <= summary["last_steps_reward_mean"] <= 1.0
    assert f"{summary['last_steps_reward_mean']:.3f}" == final.group(2)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert (run / "final_model" / "config.json").exists()
    print(f"{STEPS}-step default job in the container: {took:.0f}s; {final.group(0)}")
