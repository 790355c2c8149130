"""The session's builds (the tiny task models, SmolLM2's folder), made in a background process while
other tests run.

Each build is single-threaded (or nearly), and so are most fast tests: on a 2-core machine one
core idles through both. tests/conftest.py runs the fast tests first and, once the session's tests
are collected, starts the builds they need here, one after another in the order the tests first
need them, each in a process of its own (no GIL shared with the tests). A build fixture waits for
its own build and fails with the build's log when it failed; a build no collected test named (a
fixture requested at run time) is made when asked. Same code, seed and thread count as in the test
process, so the same files. The builds run at the lowest priority (`nice -n 19`): they take the
idle core, never a test's (a test of deadlines, starved by a build, once missed one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SMOLLM2_PATH = "artifacts/smollm2-135m-instruct"  # configs/model/smollm2.yaml's model.path

# fixture -> (temp dir name, Python run in that dir (OUT: its path), the fixture's value relative to the dir)
BUILDS: dict[str, tuple[str, str, str]] = {
    # not a fixture: DeepSpeed compiles its CPU shared-memory collective op (g++, ~40 s of one core)
    # the first time a learner starts on a machine (cached in ~/.cache/torch_extensions); compiled
    # here first, the first end-to-end test does not wait for it (tests/conftest.py)
    "deepspeed_ops": ("deepspeed_ops", "from deepspeed.comm.torch import build_shm_op; build_shm_op()", "."),
    # the trained tiny policy (right some of the time: GRPO learns from it), ~47 s of one core
    "tiny_trained": ("tiny", "from examples.arith import build; build(OUT, seed=0)", "."),
    # the same shape, tokenizer and data untrained, in seconds: the fast lane's tests check configs,
    # shapes and plumbing, never learning
    "tiny_untrained": ("tiny_untrained", "from examples.arith import build; "
                                         "build(OUT, seed=0, steps=0, target_accuracy=0, n_eval=8, log_every=0)", "."),
    # the real model's folder made on first use of model=smollm2's path, as launch.train makes it
    "smollm2": ("smollm2", f"from rl.data.builtins import ensure_builtin; "
                           f"assert ensure_builtin([{SMOLLM2_PATH!r}]) == [{SMOLLM2_PATH!r}]", SMOLLM2_PATH),
    "tiny_calc": ("tiny_calc", "from examples.calculator import build; build(OUT, seed=0, log_every=0)", "."),
    "tiny_code_agent": ("tiny_code_agent", "from examples.code_agent import build; build(OUT, seed=0, log_every=0)",
                        "."),
    "tiny_code": ("tiny_code", "from examples.code_speedup import build; build(OUT, seed=0, threads=0, log_every=0)",
                  "."),
}
BUILD_TIMEOUT_S = 1800


class Prebuilds:
    """Builds of `BUILDS` under pytest's temp dir: `start(names)` begins them in the background,
    `path(name)` waits for one (or makes it now) and returns the fixture's path."""

    def __init__(self, tmp_path_factory) -> None:
        self._factory = tmp_path_factory
        self._dirs: dict[str, Path] = {}
        self._done: dict[str, threading.Event] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def start(self, names: list[str]) -> None:
        with self._lock:
            queued = [n for n in names if n not in self._done]
            for name in queued:
                self._done[name] = threading.Event()
        if queued:
            threading.Thread(target=lambda: [self._build(n) for n in queued], name="prebuild", daemon=True).start()

    def path(self, name: str) -> str:
        with self._lock:
            mine = name not in self._done
            if mine:
                self._done[name] = threading.Event()
        if mine:
            self._build(name)
        if not self._done[name].wait(BUILD_TIMEOUT_S + 60):
            raise TimeoutError(f"the background build of {name} did not finish in {BUILD_TIMEOUT_S} s")
        if name in self._errors:
            raise RuntimeError(f"building {name} failed:\n{self._errors[name]}")
        return str(self._dirs[name] / BUILDS[name][2])

    def _build(self, name: str) -> None:
        dirname, code, _ = BUILDS[name]
        out = self._dirs[name] = self._factory.mktemp(dirname)
        log = out.parent / f"{out.name}.build.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            with open(log, "w") as f:
                proc = subprocess.run(["nice", "-n", "19", sys.executable, "-c", f"OUT = {str(out)!r}; {code}"],
                                      cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                self._errors[name] = f"exit {proc.returncode}; {log}:\n{log.read_text()[-4000:]}"
        except Exception as err:  # noqa: BLE001 - reported by the fixture that waits for it
            self._errors[name] = f"{type(err).__name__}: {err}"
        finally:
            self._done[name].set()
