"""Streaming rollouts (`rollout.mode=streaming`): the driver's queue (rl/run/streaming.py) against
an in-process fleet with a controllable clock of finished requests, then the real AsyncLLM engine
in a Ray worker: weights loaded mid-generation, per-token versions, faults in its process."""

from __future__ import annotations

import threading

import pytest

from rl.data.types import GenerationRequest, Sample, ScoredSample
from rl.run.dynamic_sampling import DynamicSampling
from rl.run.streaming import StreamingRollouts, staleness_metrics


class QueueFleet:
    """Finishes the requests it was sent when the test says so (`finish`), each token dated by
    `version` at that moment: the order and timing of completions are the test's."""

    def __init__(self):
        self.sent: list[GenerationRequest] = []
        self.waiting: dict[tuple[int, int], GenerationRequest] = {}
        self.done: list[Sample] = []
        self.version = 0
        self.lock = threading.Lock()
        self.repairs = 0

    def submit(self, requests):
        with self.lock:
            self.sent += requests
            self.waiting.update({(r.group_id, r.sample_index): r for r in requests})

    def drain(self, wait_s):
        import time

        time.sleep(0.005)
        with self.lock:
            out, self.done = self.done, []
        return out

    def repair(self):
        self.repairs += 1

    def finish(self, group_ids=None, versions=None):
        """Finish the waiting requests of `group_ids` (all by default); tokens of `versions`."""
        with self.lock:
            keys = [k for k in self.waiting if group_ids is None or k[0] in group_ids]
            for k in keys:
                r = self.waiting.pop(k)
                v = versions or [self.version, self.version]
                self.done.append(Sample(r.prompt_ids, [1] * len(v), [-0.5] * len(v), "stop", v[0], r.prompt_text,
                                        "x", r.group_id, r.sample_index, dict(r.metadata), token_versions=list(v)))

    def started_groups(self):
        return {r.group_id for r in self.sent}


def _draw(P, n):
    def draw(b):
        return [GenerationRequest([b, g], f"p{b}.{g}", b * P + g, k, seed=k) for g in range(P) for k in range(n)]
    return draw


def _score(samples):
    return [ScoredSample(s, float(s.sample_index % 2)) for s in samples]


def _until(pred, timeout=5.0):
    import time

    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_admission_follows_the_staleness_bound_and_a_slow_group_holds_nothing_back():
    fleet = QueueFleet()
    P, n, k = 2, 2, 1
    stream = StreamingRollouts(fleet, _draw(P, n), _score, groups_per_step=P, max_staleness=k, start_step=0, steps=10)
    try:
        _until(lambda: len(fleet.started_groups()) == (k + 1) * P)  # versions 0..k may start: 4 groups
        import time

        time.sleep(0.1)
        assert len(fleet.started_groups()) == (k + 1) * P
        fleet.finish(group_ids={1, 2, 3})  # group 0 is the long tail: it does not hold step 0 back
        scored, samples, m = stream.take(0)
        assert sorted({s.group_id for s in samples}) == [1, 2]  # oldest first, then by arrival
        assert m["stream/ready_groups_count"] == 1 and m["policy/token_staleness_mean"] == 0
        assert len(scored) == P * n and fleet.repairs >= 1
        fleet.version = 1
        assert len(fleet.started_groups()) == (k + 1) * P  # nothing more until the learner is at version 1
        fleet.finish(group_ids={0})  # the long one ends, its tokens of version 1
        scored, samples, m = stream.take(1)
        assert sorted({s.group_id for s in samples}) == [0, 3]
        _until(lambda: len(fleet.started_groups()) == (1 + k + 1) * P)  # the learner at version 1: 2 more
        fleet.version = 2
        fleet.finish()  # groups 4, 5 (started at version 1) end at version 2
        _, samples, m = stream.take(2)
        assert sorted({s.group_id for s in samples}) == [4, 5]
    finally:
        stream.close()


def test_a_group_older_than_the_bound_is_generated_again_not_trained_on():
    fleet = QueueFleet()
    stream = StreamingRollouts(fleet, _draw(1, 2), _score, groups_per_step=1, max_staleness=1, start_step=0, steps=10)
    try:
        _until(lambda: len(fleet.sent) == 4)
        fleet.finish(group_ids={0})
        assert {s.group_id for s in stream.take(0)[1]} == {0}
        fleet.version = 3  # group 1's samples: first token of version 0, last of 3
        fleet.finish(group_ids={1}, versions=[0, 3])
        got = {}
        taking = threading.Thread(target=lambda: got.update(zip(("scored", "samples", "m"), stream.take(3))))
        taking.start()  # the learner at version 3: versions >= 2 allowed, groups up to 4 started
        _until(lambda: {2, 3, 4} <= fleet.started_groups())
        _until(lambda: [r.group_id for r in fleet.sent].count(1) == 4)  # group 1 sent again, whole
        fleet.finish(group_ids={2}, versions=[2, 3])
        taking.join(5)
        assert {s.group_id for s in got["samples"]} == {2} and got["m"]["stream/stale_groups_count"] == 1
        assert got["m"]["policy/token_staleness_max"] == 1 and got["m"]["policy/spanning_samples_frac"] == 1.0
    finally:
        stream.close()


def test_in_flight_state_resumes_without_losing_or_repeating_a_group():
    fleet = QueueFleet()
    stream = StreamingRollouts(fleet, _draw(2, 2), _score, groups_per_step=2, max_staleness=1, start_step=0, steps=10)
    _until(lambda: len(fleet.started_groups()) == 4)
    fleet.finish(group_ids={0, 1, 2})
    taken = {s.group_id for s in stream.take(0)[1]}
    _until(lambda: len(fleet.started_groups()) == 4)
    state = stream.in_flight()["streaming"]
    stream.close()
    assert {g.requests[0].group_id for g in state["ready"]} == {2} and {r.group_id for r in state["pending"]} == {3}

    again = QueueFleet()
    again.version = 1
    resumed = StreamingRollouts(again, _draw(2, 2), _score, groups_per_step=2, max_staleness=1, start_step=1,
                                steps=10, state=state)
    try:
        _until(lambda: 3 in again.started_groups())
        assert again.started_groups() == {3, 4, 5}  # the pending one again, then what the bound allows
        again.finish()
        later = {s.group_id for s in resumed.take(1)[1]}
        assert later == {2, 3} and not later & taken
    finally:
        resumed.close()


def test_dynamic_sampling_keeps_informative_groups_and_fills_only_past_its_budget():
    """Informative groups first; set-aside (all-equal) groups fill a step only once max_rounds x P
    groups finished since the last take, and every set-aside group makes room for another."""
    fleet = QueueFleet()
    flat = {1, 3, 4, 5, 6, 7, 8, 9}  # every group from 4 on is uninformative too
    score = lambda samples: [ScoredSample(s, 1.0 if s.group_id in flat or s.group_id >= 10 else float(s.sample_index))  # noqa: E731
                             for s in samples]
    stream = StreamingRollouts(fleet, _draw(2, 2), score, groups_per_step=2, max_staleness=1, start_step=0,
                               steps=20, sampling=DynamicSampling(2, max_rounds=2), poll_s=0.01)
    try:
        _until(lambda: len(fleet.started_groups()) == 4)
        fleet.finish()  # groups 0, 2 informative; 1, 3 all equal: set aside, 2 places freed
        _, samples, m = stream.take(0)
        assert {s.group_id for s in samples} == {0, 2} and m["dapo/filled_groups"] == 0
        _until(lambda: len(fleet.started_groups()) == 6)  # (0 + 1 + 1) x 2 + the 2 places set-aside groups freed
        fleet.version = 1
        got = {}
        taking = threading.Thread(target=lambda: got.update(out=stream.take(1)), daemon=True)
        taking.start()
        _until(lambda: len(fleet.started_groups()) == 8)  # the learner at version 1: 2 more
        fleet.finish(group_ids={4, 5})  # 2 of max_rounds x P = 4 looked at: no filling yet
        taking.join(0.5)
        assert taking.is_alive(), "filled before max_rounds x P groups were looked at"
        fleet.finish(group_ids={6, 7})  # 4 looked at, none informative: the step fills
        taking.join(5)
        _, samples, m = got["out"]
        assert m["dapo/filled_groups"] == 2 and m["dapo/informative_groups"] == 0
        assert m["dapo/looked_groups"] == 4 and len({s.group_id for s in samples}) == 2
        assert m["dapo/sampling_rounds"] == 2.0  # max_rounds steps' worth looked at
    finally:
        stream.close()


class AutoFleet(QueueFleet):
    """Finishes whatever was sent at every drain, dated by the learner's version then."""

    def drain(self, wait_s):
        self.finish()
        return super().drain(wait_s)


def _uninformative(gid: int, percent: int) -> bool:
    return (gid * 37) % 100 < percent  # a fixed, spread-out share of the groups


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("percent", [0, 50, 90, 100])
def test_dynamic_sampling_every_step_finishes_and_a_resume_keeps_the_budget(k, rounds, percent):
    """DAPO's dynamic sampling in the stream, for k = 1, 2, sampling rounds 1-3 and 0-100% of the
    groups uninformative: every step gets its groups (informative ones first, set-aside ones only
    once max_rounds steps' worth were looked at), none twice; a resume in the middle keeps the
    budget (set-aside groups, credit, groups looked at) and goes on. A regression guard: before,
    k=1 with leftover uninformative groups earned no credit and `take` waited forever."""
    P, n, steps = 2, 2, 8

    def score(samples):
        return [ScoredSample(s, 1.0 if _uninformative(s.group_id, percent) else float(s.sample_index))
                for s in samples]

    def stream_of(fleet, start, state=None):
        return StreamingRollouts(fleet, _draw(P, n), score, groups_per_step=P, max_staleness=k, start_step=start,
                                 steps=steps, sampling=DynamicSampling(P, rounds), state=state,
                                 poll_s=0.01, stall_s=5.0)

    def take(stream, step):
        got = {}
        worker = threading.Thread(target=lambda: got.update(out=stream.take(step)), daemon=True)
        worker.start()
        worker.join(10)
        assert "out" in got, f"step {step} never got its groups (k={k}, rounds={rounds}, {percent}% flat)"
        return got["out"]

    trained: list[int] = []
    fleet = AutoFleet()
    stream = stream_of(fleet, 0)
    state = None
    for step in range(steps):
        if step == steps // 2:  # a checkpoint here, and a resume from it with a new fleet
            state = stream.in_flight()["streaming"]
            stream.close()
            fleet = AutoFleet()
            fleet.version = step
            stream = stream_of(fleet, step, state)
        scored, samples, m = take(stream, step)
        groups = sorted({s.group_id for s in samples})
        assert len(groups) == P and len(scored) == P * n, m
        trained += groups
        flat = [g for g in groups if _uninformative(g, percent)]
        assert m["dapo/filled_groups"] == len(flat)
        if flat:  # fillers only once max_rounds steps' worth were looked at (or nothing more could come)
            assert m["dapo/looked_groups"] >= rounds * P or stream._exhausted(), m
        if percent == 0:
            assert m["dapo/filled_groups"] == 0
        fleet.version = step + 1  # the learner's update and sync
    stream.close()
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(state) >= {"credit", "dropped", "looked", "spare", "cursor", "ready", "pending"}
    if percent and rounds > 1:
        assert state["credit"] > 0, "set-aside groups earned no budget"
    # never more than max_rounds steps' worth per step, plus a refill for each set-aside group dropped unused
    drawn = stream._cursor * P
    assert drawn <= (steps + k) * rounds * P + stream._dropped + P
    assert stream._dropped <= sum(_uninformative(g, percent) for g in range(drawn))


def test_a_stream_with_nothing_finishing_stops_naming_its_deadline():
    from rl.run.streaming import StreamStalled

    stream = StreamingRollouts(QueueFleet(), _draw(1, 2), _score, groups_per_step=1, max_staleness=1, start_step=0,
                               steps=10, stall_s=0.5, stall_hint="run.call_timeout_s")
    try:
        with pytest.raises(StreamStalled, match=r"no sample finished for .*deadline is 0.5 s \(run.call_timeout_s\)"):
            stream.take(0)
    finally:
        stream.close()


def test_staleness_metrics_count_model_tokens_only():
    a = Sample([1], [5, 6, 7], [-1.0] * 3, "stop", 2, "", "", 0, 0, token_versions=[2, 2, 3])
    b = Sample([1], [5, 6], [-1.0, 0.0], "stop", 3, "", "", 0, 1, completion_mask=[1, 0], token_versions=[3, 3])
    m = staleness_metrics([a, b], version=4)
    assert m["policy/token_staleness_mean"] == pytest.approx((2 + 2 + 1 + 1) / 4)
    assert m["policy/token_staleness_max"] == 2 and m["policy/spanning_samples_frac"] == 0.5
    assert a.oldest_version() == 2 and m["policy/versions_per_sample_mean"] == 1.5


def _repair(fleet) -> None:
    """What the driver's Cluster does, less the weight sync: the replaced workers hold model.path's
    weights, which is what this test counts as current."""
    if fleet.repair():
        fleet.synced()


def _drain_all(fleet, keys: set, timeout_s: float = 120.0) -> dict:
    """Drain (repairing, as the driver's thread does) until every request of `keys` came back."""
    import time

    got, end = {}, time.monotonic() + timeout_s
    while not keys <= set(got):
        assert time.monotonic() < end, f"requests {sorted(keys - set(got))} never came back"
        for s in fleet.drain(0.2):
            got[(s.group_id, s.sample_index)] = s
        _repair(fleet)
    return got


@pytest.mark.slow
@pytest.mark.full  # the real model; the default lane's streaming run: test_e2e's streaming mechanics
def test_weights_loaded_mid_generation_date_every_token_and_faults_are_caught(smollm2):
    """The real AsyncLLM engine (SmolLM2, fp32) in a Ray worker: weights of another policy loaded
    while 4 requests are generating (inflight_kv=recompute) split each sample into tokens of
    version 0 and version 1, and each token's recorded log-prob is the one its version's model
    gives it (< 1e-3, recomputed with Hugging Face). Then faults in the worker's process: an engine
    left paused is named and resumed; a killed worker (its engine-core process goes with it) and a
    stopped one are replaced and their requests sent again."""
    import os
    import signal
    import time

    import psutil
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rl.config.schema import ModelConfig, RolloutConfig
    from rl.actors.faults import Deadlines
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env
    from tests.conftest import shared_ray

    shared_ray()
    spec = RolloutSpec(ModelConfig(path=smollm2, dtype="float32"),
                       RolloutConfig(max_new_tokens=160, max_model_len=256, kv_cache_gib=1, mode="streaming",
                                     inflight_kv="recompute", pause_timeout_s=2.0, max_restarts=3), seed=0, threads=2)
    logs: list[str] = []
    fleet = RolloutFleet(spec, num_cpus=1, env_vars=vllm_env(1, 2), log=logs.append,
                         deadlines=Deadlines(floor_s=4.0, factor=20.0, start_s=120.0))
    prompt = [1, 2, 3, 4]
    requests = [GenerationRequest(prompt + [10 + g], "", g, 0, seed=g) for g in range(4)]
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    other = {k: v.clone() for k, v in base.state_dict().items() if k != "lm_head.weight"}
    other["model.norm.weight"] *= 1.7  # a different policy: sharper next-token distributions
    try:
        fleet.submit(requests)
        time.sleep(1.5)
        ray.get(fleet.workers[0].load_weights_from_object.remote(other, 1), timeout=60)
        got = _drain_all(fleet, {(g, 0) for g in range(4)})
        tuned = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        tuned.load_state_dict(other, strict=False)
        spanning = 0
        for s in got.values():
            v = s.token_versions
            assert v == sorted(v) and set(v) <= {0, 1} and s.policy_version == v[0] == 0
            spanning += len(set(v)) == 2
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            for model, version in ((base, 0), (tuned, 1)):
                with torch.no_grad():
                    logits = model(ids).logits[0, len(s.prompt_ids) - 1: -1]
                want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
                mine = [i for i, t in enumerate(v) if t == version]
                diff = (want[mine] - torch.tensor(s.logprobs)[mine]).abs().max().item() if mine else 0.0
                assert diff < 1e-3, f"version {version} tokens: log-probs differ by {diff}"
        assert spanning >= 1, "no sample spanned the weight update: load earlier or generate longer"

        # an engine left paused: named after rollout.pause_timeout_s and resumed
        ray.get(fleet.workers[0].pause.remote())
        fleet.submit([GenerationRequest(prompt, "", 10, 0, seed=1, max_tokens=8)])
        _drain_all(fleet, {(10, 0)}, timeout_s=30)
        assert any("left paused" in line and "resuming it" in line for line in logs), logs

        # a killed worker: replaced, its requests sent again; its engine-core process ends too
        pid = fleet.where[0]["pid"]
        cores = psutil.Process(pid).children(recursive=True)
        fleet.submit([GenerationRequest(prompt, "", 11, k, seed=k, max_tokens=40) for k in range(2)])
        os.kill(pid, signal.SIGKILL)
        assert len(_drain_all(fleet, {(11, 0), (11, 1)})) == 2 and fleet.restarts == 1
        gone, alive = psutil.wait_procs(cores, timeout=10)
        assert not alive, f"engine processes outlived their actor: {alive}"

        # a request the engine refuses (a token id outside the vocabulary): its own error, no fault
        fleet.submit([GenerationRequest([10**9], "", 13, 0, seed=1, max_tokens=4)])
        refused = _drain_all(fleet, {(13, 0)})[(13, 0)]
        assert "refused" in refused.error and "out of vocabulary" in refused.error and fleet.restarts == 1

        # a stopped worker: its drain misses the deadline, it is replaced, the request sent again
        pid = fleet.where[0]["pid"]
        fleet.submit([GenerationRequest(prompt, "", 12, 0, seed=3, max_tokens=8)])
        os.kill(pid, signal.SIGSTOP)
        _drain_all(fleet, {(12, 0)})
        assert fleet.restarts == 2 and any("during streaming generation" in line for line in logs)

        # an agent's call (another thread) on a worker that dies: the driver's thread replaces it
        # (as it also runs the weight syncs), the call waits for that and is sent again
        os.kill(fleet.where[0]["pid"], signal.SIGKILL)
        answer: dict = {}
        call = threading.Thread(target=lambda: answer.update(
            sample=fleet.generate_one(GenerationRequest(prompt, "", 14, 0, seed=4, max_tokens=4))))
        call.start()
        end = time.monotonic() + 60
        while call.is_alive() and time.monotonic() < end:
            _repair(fleet)
            call.join(0.2)
        assert answer["sample"].error is None and len(answer["sample"].completion_ids) >= 1
        assert fleet.restarts == 3
    finally:
        fleet.shutdown()
