"""`python -m launch.serve` started as its users start it, in its own process group, for the tests
that drive it with the tinker SDK or the cookbook: `serving(args, log_path, env)` yields its URL."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, env: dict[str, str] | None = None, start_s: float = 600,
            stopped: dict | None = None) -> Iterator[str]:
    """The service with `args` (serve.port=0 is added: it prints the port it took), its output in
    `log_path`; stopped (SIGTERM, then SIGKILL after 60 s) on exit. `stopped` gets how long it took
    to exit after the SIGTERM (`seconds`) and its `returncode` (None: it was killed)."""
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "serve.port=0", *args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline = None, time.monotonic() + start_s
        while url is None:
            log.seek(0)
            found = re.search(r"at (http://127\.0\.0\.1:\d+)", log.read())
            url = found.group(1) if found else None
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"launch.serve did not start:\n{log.read()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        signalled = time.monotonic()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # it exited already (it refused to start)
            pass
        try:
            returncode = proc.wait(60)
        except subprocess.TimeoutExpired:
            returncode = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if stopped is not None:
            stopped.update(seconds=time.monotonic() - signalled, returncode=returncode)
        log.close()
