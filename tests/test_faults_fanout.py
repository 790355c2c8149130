"""`rl.actors.faults.fan_out`, the one "call many actors, wait with a deadline, tell the answered
from the hung, the dead and the raised" that the rollout fleet, the learner group, the reward
service, the environment service and the sandbox pool share: here with hand-made refs, so no Ray."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rl.actors.faults import Calls, fan_out, hung


class Died(Exception):
    """Stands for Ray's RayActorError."""


class Raised(Exception):
    """Stands for Ray's RayTaskError."""


class RaisedBecauseAPeerDied(Raised, Died):
    """Like a RayTaskError whose cause is a RayActorError: counts as dead, as the callers did."""


class Ref:
    """A call's ref: `done` (answered by the deadline), and what reading it gives or raises."""

    def __init__(self, value=None, error: BaseException | None = None, done: bool = True):
        self.value, self.error, self.done = value, error, done


class Fake:
    """Calls over `Ref`s that records what it was asked."""

    def __init__(self, sleep_s: float = 0.0):
        self.waited: list[tuple[list, float]] = []
        self.got: list[Ref] = []
        self.sleep_s = sleep_s

    def wait(self, refs: list, timeout_s: float) -> list:
        self.waited.append((refs, timeout_s))
        time.sleep(self.sleep_s)
        return [r for r in refs if r.done]

    def get(self, ref: Ref):
        self.got.append(ref)
        if ref.error is not None:
            raise ref.error
        return ref.value

    def calls(self) -> Calls:
        return Calls(wait=self.wait, get=self.get, died=(Died,), raised=(Raised,))


def four() -> dict[str, Ref]:
    return {
        "finishes": Ref(value=42),
        "hangs": Ref(done=False),
        "dies": Ref(error=Died("The actor died unexpectedly.\n\ntraceback ...")),
        "raises": Ref(error=Raised("\n  ValueError: bad input\nTraceback (most recent call last): ...")),
    }


def test_one_finishes_one_hangs_one_dies_one_raises():
    fake, killed = Fake(sleep_s=0.01), []
    out = fan_out(four(), 30.0, fake.calls(), kill=killed.append)
    assert len(fake.waited) == 1 and fake.waited[0][1] == 30.0  # all waited on together, once
    assert out.keys == ["finishes", "hangs", "dies", "raises"]
    assert out.results == {"finishes": 42}
    assert out.hung == {"hangs": hung(30.0)}
    assert out.hung["hangs"] == "no answer in 30 s (stopped or hung; the deadline is run.call_timeout_s)"
    assert out.died == {"dies": "its process died (The actor died unexpectedly.)"}
    assert out.raised == {"raises": "ValueError: bad input"}
    assert set(out.errors) == {"dies", "raises"} and isinstance(out.errors["raises"], Raised)
    assert out.failed == {"hangs": hung(30.0), "dies": "its process died (The actor died unexpectedly.)"}
    assert list(out.failed) == ["hangs", "dies"]  # in call order
    assert killed == ["hangs"]  # only the silent one is killed
    assert [r.value for r in fake.got] == [42, None, None]  # the hung call is never read
    assert out.deadline_s == 30.0 and 0.01 <= out.elapsed_s < 5


def test_failed_keeps_call_order_across_hung_and_dead():
    refs = {2: Ref(error=Died("gone")), 0: Ref(done=False), 1: Ref(value="ok"), 3: Ref(done=False)}
    out = fan_out(refs, 5.0, Fake().calls())
    assert list(out.failed) == [2, 0, 3]
    assert out.failed[2] == "its process died (gone)" and out.failed[0] == hung(5.0)


def test_all_answer():
    out = fan_out({0: Ref(value="a"), 1: Ref(value="b")}, 1.0, Fake().calls())
    assert out.results == {0: "a", 1: "b"}
    assert not out.hung and not out.died and not out.raised and not out.failed and not out.errors


def test_an_error_raised_inside_propagates_when_asked_in_call_order():
    fake, killed = Fake(), []
    refs = {"hangs": Ref(done=False), "raises": Ref(error=Raised("boom")), "later": Ref(done=False)}
    with pytest.raises(Raised, match="boom"):
        fan_out(refs, 1.0, fake.calls(), kill=killed.append, propagate_raised=True)
    assert killed == ["hangs"]  # the calls before it were dealt with; the ones after it not


def test_a_task_error_caused_by_a_dead_actor_counts_as_dead_even_when_propagating():
    refs = {0: Ref(error=RaisedBecauseAPeerDied("peer died"))}
    out = fan_out(refs, 1.0, Fake().calls(), propagate_raised=True)
    assert out.died == {0: "its process died (peer died)"} and not out.raised


def test_any_other_error_propagates():
    with pytest.raises(KeyError):
        fan_out({0: Ref(error=KeyError("lost object"))}, 1.0, Fake().calls())


def test_no_calls_waits_on_nothing():
    fake = Fake()
    out = fan_out({}, 1.0, fake.calls())
    assert fake.waited == [] and out.keys == [] and out.failed == {}


def test_empty_error_still_has_a_first_line():
    out = fan_out({0: Ref(error=Died())}, 1.0, Fake().calls())
    assert out.died == {0: "its process died (Died)"}


def test_an_actor_s_error_is_told_by_its_cause_not_the_call_s_name():
    """Ray's error for a call that raised in an actor starts with the call (`ray::Worker.f() (pid=..)`);
    what a report needs is the remote exception's own message."""
    from ray.exceptions import RayTaskError

    remote = RuntimeError("The size of tensor a (64) must match the size of tensor b (32)\nat dimension 1")
    exc = RayTaskError("RolloutWorker.receive_weights", "Traceback (most recent call last):\n  ...", remote)
    assert "pid=" in str(exc).splitlines()[0]  # (the call's name, as Ray prints it, and where it ran)
    calls = Calls(wait=Fake().wait, get=Fake().get, died=(Died,), raised=(RayTaskError,))
    out = fan_out({0: Ref(error=exc)}, 1.0, calls)
    assert out.raised == {0: "RuntimeError: The size of tensor a (64) must match the size of tensor b (32)"}


def test_the_ray_adapter_waits_for_all_with_the_deadline():
    """`Calls.ray(ray)` over a stand-in for the module: `ray.wait(refs, num_returns=len(refs),
    timeout=...)`, `ray.get`, RayActorError as dead and RayTaskError as raised."""
    seen = {}

    def wait(refs, num_returns, timeout):
        seen.update(refs=refs, num_returns=num_returns, timeout=timeout)
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    fake = Fake()
    ray = SimpleNamespace(wait=wait, get=fake.get,
                          exceptions=SimpleNamespace(RayActorError=Died, RayTaskError=Raised))
    refs = four()
    out = fan_out(refs, 7.0, Calls.ray(ray))
    assert seen == {"refs": list(refs.values()), "num_returns": 4, "timeout": 7.0}
    assert out.results == {"finishes": 42} and list(out.hung) == ["hangs"]
    assert list(out.died) == ["dies"] and list(out.raised) == ["raises"]
