"""What `launch.train` does when a run cannot go on as planned: signals, lost actors, restarts.

- SIGINT or SIGTERM: the loop finishes the step it is in, writes a checkpoint there and stops;
  Ray is shut down, the command that resumes the run is printed, the exit code is 128 + the
  signal's number. A second signal stops at once (no checkpoint for the step in flight).
- An actor lost for good (a learner rank, a rollout worker past its replacements), or rewards
  that all fail: one `error:` line naming the actor, the phase and the step, then the command
  that resumes the run (exit 1). With `run.max_restarts=N` a lost actor restarts the run from
  its latest checkpoint instead, N times at most.
"""

from __future__ import annotations

import shlex
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rl.run import checkpoint
from rl.actors.faults import ActorFailure, NotLearning, RewardsFailing, RunStopped, StopRequest

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals(stop: StopRequest, say: Callable[[str], None] = print) -> Iterator[None]:
    """While inside: a first SIGINT/SIGTERM asks the loop to stop at the step's end; a second
    one raises SystemExit at once. Call from the main thread, after `ray.init` (which sets a
    SIGTERM handler of its own)."""

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.reason is not None:
            say(f"{name} again: stopping now, without finishing the step")
            raise SystemExit(128 + signum)
        stop.request(name)
        say(f"{name}: the run stops after this step with a checkpoint (send it again to stop at once)")

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def command(overrides: list[str], *extra: str) -> str:
    """`python -m launch.train` with the run's overrides (less run.dir and run.resume) and `extra`."""
    kept = [o for o in overrides if _key(o) not in ("run.dir", "run.resume")]
    return " ".join(["python -m launch.train", *map(shlex.quote, kept), *map(shlex.quote, extra)])


def resume_hint(run_dir: str, overrides: list[str], save_every: int) -> str:
    if checkpoint.latest(run_dir) is None:
        return (f"No checkpoint was written yet (run.save_every={save_every}); start again with: "
                + command(overrides, "run.dir=<a new directory>"))
    return "Resume with: " + command(overrides, f"run.dir={run_dir}", "run.resume=true")


def supervise(cfg: Any, run: Callable[[Any, bool], Any], overrides: list[str], resume_from: Any = None) -> Any:
    """Call `run(resume_from, restarted)` until it finishes, turning a stop, a lost actor or
    failing rewards into the messages and exit codes above; restarts it after a lost actor up to
    `run.max_restarts` times from the latest checkpoint (from the start when there is none)."""
    restarts = 0
    while True:
        try:
            return run(resume_from, restarts > 0)
        except RunStopped as err:
            print(f"Stopped by {err.reason} after step {err.next_step}, checkpoint written. "
                  + resume_hint(cfg.run.dir, overrides, cfg.run.save_every), flush=True)
            sys.exit(128 + signal.Signals[err.reason].value)
        except (ActorFailure, RewardsFailing, NotLearning) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            if isinstance(err, ActorFailure) and restarts < cfg.run.max_restarts:
                restarts += 1
                resume_from = checkpoint.latest(cfg.run.dir)
                start = f"its checkpoint before step {resume_from[1].next_step + 1}" if resume_from else "step 1"
                print(f"Restarting the run from {start} (restart {restarts} of run.max_restarts="
                      f"{cfg.run.max_restarts})", flush=True)
                continue
            print(resume_hint(cfg.run.dir, overrides, cfg.run.save_every), file=sys.stderr, flush=True)
            sys.exit(1)
        except SystemExit:  # a second signal: stopped at once, the latest checkpoint is the way back
            print(resume_hint(cfg.run.dir, overrides, cfg.run.save_every), file=sys.stderr, flush=True)
            raise
