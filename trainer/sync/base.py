"""The weight sync's contract: one strategy per transport, each owning its four moves.

    join()          make whatever the transport needs with the current rollout workers
    push(version)   send the learner's weights to every worker as policy `version` (with delta
                    syncs only what changed since the last push, unless `full`)
    verify(...)     every worker says it holds `version` and took the bytes that were sent
    rejoin()        after the fleet replaced workers: join again and push the current version

The driver holds a `WeightSync`; the learner only exports tensors (`trainer/weights.py`, through
a `Sender` the strategy places in each learner rank), and the fleet only replaces workers and
calls `after_replace` (which the strategy sets at `join`): neither knows the other. `sync` is
the loop around `push` that the training loop calls: a worker that fails meanwhile is replaced,
the transport joined again and the push redone, within the fleet's `rollout.max_restarts`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from rl.run.faults import ActorFailure, Deadlines


class Receivers(Protocol):
    """What a weight sync needs of the rollout fleet (`rollout.fleet.RolloutFleet` is one)."""

    workers: list[Any]  # Ray handles of `rollout.worker.RolloutWorker`
    where: list[dict[str, Any]]
    after_replace: Callable[[], None] | None
    version: int
    spec: Any  # rollout.protocol.RolloutSpec: its rollout.tensor_parallel_size says how many ranks an engine has

    def name(self, i: int) -> str: ...
    def wait(self, refs: dict[int, Any], kind: str,
             errors: dict[int, str] | None = None) -> tuple[dict[int, Any], dict[int, str]]: ...
    def replace(self, failed: dict[int, str], phase: str) -> None: ...


class Senders(Protocol):
    """What a weight sync needs of the learner (`trainer.group.LearnerGroup` is one): its ranks'
    handles, the exported weights' metas, and a bounded wait on calls to its ranks."""

    workers: list[Any]  # Ray handles of `trainer.learner.LearnerWorker`
    where: list[dict[str, Any]]
    metas: list  # rl.wire.weight_sync.WeightMeta, in the order every sync sends them

    def call(self, refs: list, kind: str, deadline: float | None = None, tolerate_errors: bool = False) -> list: ...


class WeightSync:
    """Base of the strategies: the `sync` loop, `verify` and the wiring to the fleet.
    `sender`: the class of the learner side, one placed in every learner rank at `join`."""

    sender: type

    def __init__(self, learner: Senders, fleet: Receivers, deadlines: Deadlines | None = None):
        self.learner, self.fleet = learner, fleet
        self.deadlines = deadlines or Deadlines()
        self.delta_fallbacks = 0  # delta syncs a worker's checksum refused (then sent whole)

    # --- what each strategy provides -------------------------------------------------------

    def _join(self) -> None:
        """Make the transport with the current workers (a no-op where there is nothing to make)."""

    def push(self, version: int, full: bool = False) -> tuple[float, dict[int, dict], dict[int, str], dict[int, str]]:
        """Send the weights (`full`: whole, where the strategy sends deltas): (bytes sent, each
        worker's report, workers that failed (gone or silent: to replace), workers whose receive
        raised (alive: a new join may do))."""
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------------

    @property
    def bytes_per_sync(self) -> float:
        """Bytes one sync sends to each worker: the whole model, or with LoRA the adapters."""
        return float(sum(m.nbytes for m in self.learner.metas))

    def make_sender(self):
        """The learner side placed in every learner rank at `join`."""
        return self.sender()

    def join(self) -> None:
        """Connect the learner and the current workers; from now on the fleet calls `rejoin` once
        it has replaced a worker."""
        self.fleet.after_replace = self.rejoin
        self.learner.call([w.attach_sender.remote(self.make_sender()) for w in self.learner.workers], "weight-sync join")
        self._join()

    def rejoin(self) -> None:
        self._join()
        self.sync(self.fleet.version)

    def verify(self, version: int, reports: dict[int, dict], sent: float) -> None:
        """Every worker holds `version` and, where it counts them, took every byte that was sent
        (`sent`; each of a tensor-parallel engine's `ranks` takes all of them)."""
        for i, report in reports.items():
            held = report.get("version")
            if held != version:
                raise ActorFailure(self.fleet.name(i), "weight sync", f"it holds policy version {held} after "
                                   f"loading version {version}")
            got, want = report.get("bytes"), sent * report.get("ranks", 1)
            if got is not None and got != want:
                raise ActorFailure(self.fleet.name(i), "weight sync", f"it took {got:,.0f} bytes of the "
                                   f"{want:,.0f} sent")

    def sync(self, version: int) -> float:
        """Push the current weights to every worker as `version`; returns the bytes sent to each.
        A delta that a worker's checksum refused is followed by the whole weights, once."""
        rejoined = full = False
        while True:
            sent, reports, failed, broken = self.push(version, full)
            if not failed and not broken:
                refused = [i for i, report in reports.items() if report.get("delta_mismatch")]
                if refused and full:
                    raise ActorFailure(self.fleet.name(refused[0]), "weight sync", "its copy of the weights disagrees "
                                       "with the learner's checksum even after a whole sync")
                if refused:
                    self.delta_fallbacks += 1
                    full = True
                    continue
                self.verify(version, reports, sent)
                self.fleet.version = version
                return sent
            if failed:
                self.fleet.replace(failed, "weight sync")  # raises once its replacements are used up
            elif rejoined:
                i, why = next(iter(broken.items()))
                raise ActorFailure(self.fleet.name(i), "weight sync", f"its receive failed twice ({why})")
            rejoined = True
            self._join()

    def close(self) -> None:
        """Stop being the fleet's `after_replace` hook (the transport's ends go with the actors)."""
        self.fleet.after_replace = None
