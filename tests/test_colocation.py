"""The GPU hand-over between rollout engines and learner ranks (rl/run/colocation.py): the order of
the calls that free and reclaim memory, on a fleet and learner that record them. The real calls
run in tests/test_faults.py (hybrid placement on CPU, DeepSpeed offload_states round trips) and
on a GPU in tests/test_gpu.py."""

from rl.run.colocation import GpuHandover


class Recorder:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def sleep(self, level=None):
        self.calls.append((self.name, "sleep", level))

    def wake(self, tags=None):
        self.calls.append((self.name, "wake", tags))

    def offload(self, keep_weights=False):
        self.calls.append((self.name, "offload", keep_weights))

    def onload(self):
        self.calls.append((self.name, "onload"))


def _handover(sleep: bool, colocated: bool) -> tuple[GpuHandover, list]:
    calls: list = []
    return GpuHandover(Recorder(calls, "fleet"), Recorder(calls, "learner"), sleep=sleep, colocated=colocated), calls


def test_hybrid_step_frees_each_side_before_the_other_takes_the_gpu():
    h, calls = _handover(sleep=True, colocated=True)
    h.to_learner()
    h.to_sync()
    h.to_rollout()
    assert calls == [
        ("fleet", "sleep", None),           # engine level (2 for full syncs): weights and KV cache dropped
        ("learner", "onload"),              # ...only then the learner's states come back
        ("learner", "offload", True),       # after training: all but the 16-bit weights the sync reads
        ("fleet", "wake", ("weights",)),    # the engine's weight memory, for the sync to fill
        ("learner", "offload", False),      # after the sync: the weights too
        ("fleet", "wake", None),            # then the KV cache: the engine generates
    ]


def test_a_checkpoint_between_steps_keeps_the_engines_weights():
    h, calls = _handover(sleep=True, colocated=True)
    with h.learner_resident():
        calls.append("save")
    assert calls == [("fleet", "sleep", 1), ("learner", "onload"), "save", ("learner", "offload", False),
                     ("fleet", "wake", None)]


def test_without_hybrid_only_the_engines_sleep_and_a_checkpoint_moves_nothing():
    h, calls = _handover(sleep=True, colocated=False)
    h.to_learner()
    h.to_sync()
    h.to_rollout()
    with h.learner_resident():
        pass
    assert calls == [("fleet", "sleep", None), ("fleet", "wake", ("weights",)), ("fleet", "wake", None)]
    h, calls = _handover(sleep=False, colocated=False)
    h.to_learner(), h.to_sync(), h.to_rollout()
    assert calls == []
