"""SandboxPool on a real local Ray: workers pinned to nodes advertising a custom resource, and
the code reward inside a RewardService actor sending its jobs to them."""

from __future__ import annotations

import pytest

from reward import RewardFunctionSpec
from reward.service import RewardService
from rl.data.types import Sample
from sandbox.job import Job, Language, Status, TestCase
from sandbox.pool import SandboxPool, SandboxSettings, find_pool_workers
from tests.conftest import own_ray

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from tests.test_code_reward import FAST, ROW, SLOW  # noqa: E402  same problem as the reward tests


@pytest.fixture(scope="module")
def benchmark_node():
    # This machine plays a CPU node that advertises the `benchmark` resource.
    own_ray(num_cpus=4, resources={"benchmark": 2})
    yield
    ray.shutdown()


def test_pool_on_benchmark_nodes_serves_reward_actors(benchmark_node):
    pool = SandboxPool(SandboxSettings(backend="process", num_workers=2, slots_per_worker=1, resource="benchmark"))
    try:
        assert len(pool.placement) == 2 and all(p.startswith("process@") for p in pool.placement)
        assert ray.available_resources().get("benchmark", 0) == 0  # both workers hold one each
        jobs = [Job(Language.PYTHON, f"print({i} + int(input()))", tests=(TestCase("1", str(i + 1)),)) for i in range(5)]
        results = pool.run(jobs)
        assert [r.status for r in results] == [Status.OK] * 5 and {r.backend for r in results} == {"process"}

        # A reward actor finds the pool by name and its jobs run there (backend "unsafe_local" is
        # only the fallback used without a pool).
        before = pool.jobs_run()
        service = RewardService([RewardFunctionSpec("reward.code_speedup:passed_tests",
                                                    kwargs={"backend": "unsafe_local"})], num_workers=1)
        try:
            samples = [Sample(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], finish_reason="stop",
                              policy_version=0, prompt_text="", completion_text=c, group_id=0, sample_index=i,
                              metadata=ROW) for i, c in enumerate([SLOW, FAST, "long f(long n) {"])]
            scored = service.score(samples)
        finally:
            service.shutdown()
        assert [s.reward for s in scored] == [1.0, 1.0, 0.0]
        assert pool.jobs_run() - before == 3  # distinct jobs only: the SLOW candidate is the reference
        assert len(find_pool_workers()) == 2
    finally:
        pool.close()


def test_pool_without_matching_nodes_fails_with_the_fix(benchmark_node):
    with pytest.raises(RuntimeError, match="sandbox.resource"):
        SandboxPool(SandboxSettings(num_workers=1, resource="no-such-node-type"), start_timeout_s=3)


def test_killed_sandbox_worker_restarts_and_its_jobs_run_again(benchmark_node):
    """kill -9 a sandbox worker while it runs jobs: Ray starts it again under the same name and
    the jobs it held are sent again; every result is judged, none is lost or a sandbox_error."""
    import os
    import signal
    import threading
    import time

    pool = SandboxPool(SandboxSettings(backend="process", num_workers=1, slots_per_worker=1))
    try:
        before = pool.where()[0]["pid"]
        slow = "import time\ntime.sleep(1.0)\nprint(int(input()) * 2)"
        jobs = [Job(Language.PYTHON, slow, tests=(TestCase(str(i), str(2 * i)),)) for i in range(3)]
        out: list = []
        runner = threading.Thread(target=lambda: out.extend(pool.run(jobs)))
        runner.start()
        time.sleep(1.5)  # the first job is under way
        os.kill(before, signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert [r.status for r in out] == [Status.OK] * 3, [r.detail for r in out]
        assert pool.where()[0]["pid"] != before
    finally:
        pool.close()
