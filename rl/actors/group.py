"""`ActorGroup`: N actors of one class, made alike, and the four things every group of them needs:
create them with their placement, call all of them with a deadline, restart one, shut them down.

The rollout fleet, the learner group, the reward service, the environment service and the sandbox
pool each hold one (`group`) plus what is their own (how they split work, what a failure costs),
and wait on their actors through it: `gather` is the one wait (a deadline on every call; `each`
and `ask` read its answers as a list), `started` and `back` wait for actors to come up. The weight
sync reaches the fleet's and the learner's actors through the same narrow port: their `handles`,
`gather` and `kill`. Ray is passed in (`ray=`), so this module imports no actor framework
(tests/test_layers.py).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from rl.actors.faults import ActorFailure, Calls, Deadlines, FanOut, await_answers, fan_out

# The CPU priority (nice) of actors that run code nobody vetted: users' reward functions and
# environments, generated programs in the sandbox. Ray's own default for every worker; the run's
# learner and rollout actors run at `cluster.worker_niceness` (0 by default, launch/components.py).
UNTRUSTED_NICENESS = 15


def lower_priority(niceness: int) -> int:
    """Lower this process's CPU priority to `niceness` if it runs above it (never the other way:
    raising priority takes privileges). Returns its niceness now."""
    now = os.nice(0)
    return os.nice(niceness - now) if now < niceness else now


def _at_niceness(actor_cls: type, niceness: int) -> type:
    """`actor_cls` whose process lowers its priority to `niceness` before the class's own
    constructor runs (so whatever it starts inherits it)."""
    def __init__(self, *args, **kwargs):
        lower_priority(niceness)
        actor_cls.__init__(self, *args, **kwargs)

    return type(actor_cls.__name__, (actor_cls,), {"__init__": __init__, "__module__": actor_cls.__module__,
                                                   "__qualname__": actor_cls.__qualname__, "__doc__": actor_cls.__doc__})


class ActorGroup:
    def __init__(self, ray: Any, actor_cls: type, size: int, *, role: str,
                 args: Callable[[int], tuple] = lambda i: (), options: Mapping[str, Any] | None = None,
                 per_actor: list[Mapping[str, Any]] | None = None, deadlines: Deadlines | None = None,
                 niceness: int | None = None):
        """`size` actors of `actor_cls`, actor i made as `actor_cls(*args(i))` with Ray `options`
        and `per_actor[i]` over them (its placement bundle, its name). `role` names them in every
        message ("rollout worker 2 (pid 123)"). `niceness`: each actor's process first lowers its
        CPU priority to it (`UNTRUSTED_NICENESS` for actors that run unvetted code). Returns at
        once: `started()` waits for them."""
        self.ray, self.role, self.deadlines = ray, role, deadlines or Deadlines()
        cls = actor_cls if niceness is None else _at_niceness(actor_cls, niceness)
        self._remote, self._args = ray.remote(cls), args
        self._options = [{**(options or {}), **(per_actor[i] if per_actor else {})} for i in range(size)]
        self._calls = Calls.ray(ray)
        self.handles: list[Any] = [self._start(i) for i in range(size)]
        self.where: list[dict[str, Any]] = [{} for _ in range(size)]

    def __len__(self) -> int:
        return len(self.handles)

    def _start(self, i: int) -> Any:
        return self._remote.options(**self._options[i]).remote(*self._args(i))

    def name(self, i: int) -> str:
        pid = self.where[i].get("pid")
        return f"{self.role} {i}" + (f" (pid {pid})" if pid else "")

    def started(self, indices: list[int] | None = None, method: str = "where") -> FanOut[int]:
        """Wait (run.start_timeout_s) for the actors to answer `method` (default `where`: their
        process and node, kept in `where`). An error of the actor's start-up (its constructor, a
        user's load error) propagates as it was raised; one that does not answer in time is an
        ActorFailure naming it."""
        indices = list(range(len(self))) if indices is None else list(indices)
        out = self.gather({i: getattr(self.handles[i], method).remote() for i in indices}, "start-up",
                          self.deadlines.start_s, propagate_raised=True, setting="run.start_timeout_s")
        for i in out.keys:
            if i in out.died:
                raise out.errors[i]
            if i in out.hung:
                raise ActorFailure(self.name(i), "start-up", f"not up after {self.deadlines.start_s:.0f} s "
                                   "(run.start_timeout_s); is there a free CPU/GPU for it?")
        if method == "where":
            for i, where in out.results.items():
                self.where[i] = where
        return out

    def gather(self, refs: Mapping[int, Any], kind: str, deadline_s: float | None = None, *,
               kill_hung: bool = False, propagate_raised: bool = False, setting: str | None = None) -> FanOut[int]:
        """Wait for calls already made (actor index -> ref) at most the deadline of `kind` (or
        `deadline_s`); a silent actor is killed when `kill_hung` (Ray starts it again where the
        group lets it restart). The deadline learns from calls that all answered. A silent actor's
        `hung` names the setting the deadline comes from (`setting`, else the run's key for it)."""
        if setting is None:
            setting = (self.deadlines.key(kind) if deadline_s is None else
                       "run.start_timeout_s" if deadline_s == self.deadlines.start_s else "run.call_timeout_s")
        out = fan_out(refs, deadline_s or self.deadlines.of(kind), self._calls, propagate_raised=propagate_raised,
                      kill=(lambda i: self.kill(i, restart=True)) if kill_hung else None, setting=setting)
        if refs and not out.failed:
            self.deadlines.record(kind, out.elapsed_s)
        return out

    def each(self, refs: list, kind: str, deadline_s: float | None = None, tolerate_errors: bool = False) -> list:
        """One result per actor (`refs[i]` a call on actor i) within the deadline of `kind`: a dead
        or silent actor is an ActorFailure naming the first in order that failed (a group that
        cannot go on without all of them, as the learner's ranks); `tolerate_errors`: an error
        raised inside a live actor gives None (its peer in a collective failed), else it propagates."""
        out = self.gather(dict(enumerate(refs)), kind, deadline_s)
        for i in out.keys:
            if i in out.failed:
                raise ActorFailure(self.name(i), kind, out.failed[i]) from None
            if i in out.raised and not tolerate_errors:
                raise out.errors[i]
        return [out.results.get(i) for i in out.keys]

    def ask(self, method: str, kind: str | None = None) -> list:
        """Every actor's answer to `method` (no arguments) within the deadline of `kind` (default:
        the method's name), as `each`: a dead or silent actor is an ActorFailure naming it, the
        call and the setting of its deadline."""
        return self.each([getattr(h, method).remote() for h in self.handles], kind or method)

    def located(self) -> list[dict[str, Any]]:
        """Ask every actor again where it runs (`where`: a restarted one has a new process), within
        a call's deadline; kept in `where` and returned."""
        self.where[:] = self.ask("where")
        return list(self.where)

    def back(self, indices: list[int], method: str = "where", deadline_s: float | None = None) -> FanOut[int]:
        """Wait (run.start_timeout_s, or `deadline_s`) until Ray has started actors `indices` again
        after their processes died (a group whose options let Ray restart them): each is asked
        `method` (default `where`, kept in `where`) until it answers. Returns what became of each:
        one not back by the deadline is `hung`, one Ray gave up on `died`, one whose `method`
        raised `raised`; `failure(i, "restart", out)` names it."""
        out = await_answers(lambda i: getattr(self.handles[i], method).remote(), indices,
                            deadline_s or self.deadlines.start_s, self._calls, setting="run.start_timeout_s")
        if method == "where":
            for i, where in out.results.items():
                self.where[i] = where
        return out

    def failure(self, i: int, phase: str, out: FanOut[int]) -> ActorFailure:
        """The ActorFailure of actor `i`, which did not answer in `out` (hung, died or raised), during `phase`."""
        why = out.failed.get(i) or out.raised.get(i) or "no answer"
        return ActorFailure(self.name(i), phase, why)

    def kill(self, i: int, restart: bool = False) -> None:
        """End actor i's process (`restart`: Ray starts it again, where its options allow)."""
        self.ray.kill(self.handles[i], no_restart=not restart)

    def restart(self, i: int) -> Any:
        """Kill actor i and make a new one in its place (same arguments, same bundle); returns
        its handle. Call `started([i])` to wait for it."""
        self.kill(i)
        self.handles[i] = self._start(i)
        self.where[i] = {}
        return self.handles[i]

    def shutdown(self) -> None:
        for i in range(len(self.handles)):
            self.kill(i)
        self.handles = []
        self.where = []


class HoldsActorGroup:
    """For a class whose actors are one `ActorGroup` in `self.group` (the rollout fleet, the
    learner group): their handles, where they run and their names, as the group has them."""

    group: ActorGroup

    @property
    def workers(self) -> list[Any]:
        """The actors' Ray handles (a replaced actor's slot holds its replacement's)."""
        return self.group.handles

    @property
    def where(self) -> list[dict[str, Any]]:
        return self.group.where

    def name(self, i: int) -> str:
        return self.group.name(i)
