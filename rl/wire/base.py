"""The weight sync's contract, shared by its transports (rl/wire/collective.py, object_store.py,
ipc.py; `rl.wire.transports.make_weight_sync` picks one). Each transport module holds its three
sides: the learner's sender (a `WeightSender`, one in every learner rank), the rollout side's
receiver and the driver's strategy (a `WeightSync`), which owns its moves:

    join()          make whatever the transport needs with the current rollout workers; returns
                    the workers that failed meanwhile (gone or silent)
    push(version)   send the learner's weights to every worker as policy `version` (with delta
                    syncs only what changed since the last push, unless `full`)
    sync(version)   `push`, checked: every worker holds `version` and took the bytes that were
                    sent; a delta a worker refused is sent whole, a receive that raised in a live
                    worker is joined again and pushed once more; returns the workers that failed

A strategy reaches each side through a narrow port, an `rl.actors.group.ActorGroup`: its
`handles`, `gather` (every wait has a deadline), `kill` and `name`. On the learner's actors it
calls the methods of `SenderHost` by name (`attach_sender`, `sync_join`, `sync_send`), which
hand over to the sender placed there. It never replaces a worker and sets nothing on the fleet:
the driver's `Cluster` (launch/cluster.py) replaces the workers a sync reports failed, joins again
and syncs again, and tells the fleet when every worker is up to date.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, TypeVar

import torch

from rl.actors.faults import ActorFailure, Deadlines, FanOut
from rl.wire.format import WeightMeta


class Exported(Protocol):
    """What a sender reads of its learner rank (`trainer.weights.WeightExport`): the tensors a
    sync sends, whole, in the order of `metas()`."""

    def metas(self) -> list[WeightMeta]: ...
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]: ...
    def state_dict(self) -> dict[str, torch.Tensor] | None: ...
    def nbytes(self) -> float: ...
    def resident(self) -> AbstractContextManager: ...


@dataclass(frozen=True)
class SendOrder:
    """What the driver asks of every learner rank's sender for one push: the policy `version`
    being sent, how long rank 0 may wait for each bucket to arrive (`wait_s`, None: the
    transport's own), and `full`: whole weights even where the transport sends deltas."""

    version: int
    wait_s: float | None = None
    full: bool = False


Link = TypeVar("Link", contravariant=True)
Sent = TypeVar("Sent", covariant=True)


class WeightSender(Protocol[Link, Sent]):
    """The learner side of a transport, one in every learner rank (placed by the driver through
    `SenderHost.attach_sender`). `Link`: what `join` takes (the collective's group address, the
    IPC relay's queues; None where nothing is joined); `Sent`: what `send` returns (the bytes
    sent, or the object store's state dict)."""

    def bind(self, export: Exported, rank: int, device: Any) -> None:
        """Read the weights through `export` (this rank's, on `device`) and nothing else."""
        ...

    def join(self, link: Link) -> None: ...
    def send(self, order: SendOrder) -> Sent: ...
    def close(self) -> None: ...


class SenderHost(Protocol):
    """The learner actor's methods a strategy calls (`trainer.learner.LearnerWorker`), each on
    every rank unless it says: `attach_sender` holds the sender (closing the one before),
    `sync_join` and `sync_send` call its `join` and `send`; `node_address` (rank 0) is an address
    with a free port on its node, where the collective's group meets."""

    def attach_sender(self, sender: WeightSender) -> None: ...
    def sync_join(self, link: Any) -> None: ...
    def sync_send(self, order: SendOrder) -> Any: ...
    def node_address(self) -> tuple[str, int]: ...


class Port(Protocol):
    """What a weight sync may do with one side's actors (`rl.actors.group.ActorGroup` is one)."""

    handles: list[Any]
    where: list[dict[str, Any]]

    def name(self, i: int) -> str: ...
    def gather(self, refs: dict[int, Any], kind: str, deadline_s: float | None = None, *,
               kill_hung: bool = False, propagate_raised: bool = False) -> FanOut[int]: ...
    def kill(self, i: int, restart: bool = False) -> None: ...
    def each(self, refs: list, kind: str, deadline_s: float | None = None, tolerate_errors: bool = False) -> list: ...


@dataclass
class Pushed:
    """What one push did: bytes sent to each worker, each worker's report, the workers that
    failed (gone or silent: to replace) and those whose receive raised (alive: a new join may do)."""

    sent: float
    reports: dict[int, dict] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    raised: dict[int, str] = field(default_factory=dict)


@dataclass
class Synced:
    """The outcome of `sync`: the bytes sent to each worker, or the workers that failed (the
    `Cluster` replaces them and syncs again)."""

    sent: float = 0.0
    failed: dict[int, str] = field(default_factory=dict)


class WeightSync:
    """Base of the strategies. `learner`: the learner ranks' port (actors with `SenderHost`'s
    methods); `metas`: the exported weights' metadata, in the order every sync sends them;
    `rollout`: the rollout workers' port; `ranks_per_engine`: processes that hold weights per
    rollout worker (its tensor-parallel size)."""

    def __init__(self, learner: Port, metas: list[WeightMeta], rollout: Port, ranks_per_engine: int = 1,
                 deadlines: Deadlines | None = None):
        self.learner, self.metas, self.rollout = learner, metas, rollout
        self.ranks_per_engine = ranks_per_engine
        self.deadlines = deadlines or Deadlines()
        self.delta_fallbacks = 0  # delta syncs a worker's checksum refused (then sent whole)
        self._senders_placed = False

    # --- what each strategy provides -------------------------------------------------------

    def make_sender(self) -> WeightSender:
        """The learner side placed in every learner rank at the first `join`."""
        raise NotImplementedError

    def _join(self) -> dict[int, str]:
        """Make the transport with the current workers (a no-op where there is nothing to make);
        the workers that failed meanwhile."""
        return {}

    def push(self, version: int, full: bool = False) -> Pushed:
        """Send the weights (`full`: whole, where the strategy sends deltas)."""
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------------

    @property
    def bytes_per_sync(self) -> float:
        """Bytes one sync sends to each worker: the whole model, or with LoRA the adapters."""
        return float(sum(m.nbytes for m in self.metas))

    def on_learner(self, refs: list, kind: str, tolerate_errors: bool = False) -> list:
        """One result per learner rank within the deadline of `kind`; a dead or silent rank is an
        ActorFailure (its ZeRO shards are gone: the run resumes from a checkpoint).
        `tolerate_errors`: an error raised inside a live rank gives None (its peer in the
        collective failed, which the caller handles)."""
        return self.learner.each(refs, kind, tolerate_errors=tolerate_errors)

    def join(self) -> dict[int, str]:
        """Connect the learner and the current rollout workers (again after a replacement);
        returns the rollout workers that failed meanwhile (the caller replaces them and joins
        again)."""
        if not self._senders_placed:
            self.on_learner([w.attach_sender.remote(self.make_sender()) for w in self.learner.handles],
                            "weight-sync join")
            self._senders_placed = True
        return self._join()

    def close(self) -> None:
        """End what the transport made beside the actors (the senders go with the learner)."""

    def verify(self, version: int, reports: dict[int, dict], sent: float) -> None:
        """Every worker holds `version` and, where it counts them, took every byte that was sent
        (`sent`; each of a tensor-parallel engine's `ranks` takes all of them)."""
        for i, report in reports.items():
            held = report.get("version")
            if held != version:
                raise ActorFailure(self.rollout.name(i), "weight sync", f"it holds policy version {held} after "
                                   f"loading version {version}")
            got, want = report.get("bytes"), sent * report.get("ranks", 1)
            if got is not None and got != want:
                raise ActorFailure(self.rollout.name(i), "weight sync", f"it took {got:,.0f} bytes of the "
                                   f"{want:,.0f} sent")

    def sync(self, version: int) -> Synced:
        """Push the current weights to every worker as `version`, checked. A delta that a worker's
        checksum refused is followed by the whole weights, once; a receive that raised inside a
        live worker by a new join and push, once. Workers that failed are returned, not replaced."""
        rejoined = full = False
        while True:
            pushed = self.push(version, full)
            if pushed.failed:
                return Synced(failed=pushed.failed)
            if pushed.raised:
                if rejoined:
                    i, why = next(iter(pushed.raised.items()))
                    raise ActorFailure(self.rollout.name(i), "weight sync", f"its receive failed twice ({why})")
                rejoined = True
                failed = self._join()
                if failed:
                    return Synced(failed=failed)
                continue
            refused = [i for i, report in pushed.reports.items() if report.get("delta_mismatch")]
            if refused and full:
                raise ActorFailure(self.rollout.name(refused[0]), "weight sync", "its copy of the weights disagrees "
                                   "with the learner's checksum even after a whole sync")
            if refused:
                self.delta_fallbacks += 1
                full = True
                continue
            self.verify(version, pushed.reports, pushed.sent)
            return Synced(sent=pushed.sent)
