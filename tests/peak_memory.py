"""Peak resident memory of a run's actors, sampled from /proc while it runs: what the planner's
estimates are checked against (tests/test_plan.py, tests/test_smollm2.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from bench.memory import peak_rss


class PeakSampler:
    """The peak resident memory (VmHWM) of each actor of a run, read from /proc while it runs
    (the actors' pids are in <run>/actors.json)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.peaks, self._stop = run_dir, {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                rows = json.loads((self.run_dir / "actors.json").read_text())
            except (OSError, ValueError):
                rows = []
            for row in rows:
                peak = peak_rss(row["pid"])
                if not peak:  # gone
                    continue
                key = (row["role"], row["index"])
                self.peaks[key] = max(self.peaks.get(key, 0), peak)
            self._stop.wait(0.25)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
