"""Integration tests for `RewardService` on a real local Ray cluster."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from reward import RewardFunctionSpec, RewardLoadError, RewardScorer
from rl.data.types import Sample
from tests.conftest import own_ray

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

USER_FILE = """
    import os

    def pid_parity(prompts, completions, **kwargs):
        # proves the function ran in an actor, not the driver
        return [0.0 if os.getpid() == kwargs["driver_pid"][0] else 1.0 for _ in completions]

    def length_or_boom(prompts, completions, **kwargs):
        if "boom" in completions:
            raise ValueError("boom in batch")
        return [float(len(c)) for c in completions]

    def die_on_die(prompts, completions, **kwargs):
        if "die" in completions:
            os._exit(3)
        return [1.0] * len(completions)
"""


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    own_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def make_samples(n: int, driver_pid: int = 0) -> list[Sample]:
    samples = []
    for i in range(n):
        text = ["42", "7", "boom", "x", "-3"][i % 5]
        samples.append(
            Sample(
                prompt_ids=[1],
                completion_ids=[5] * len(text),
                logprobs=[-1.0] * len(text),
                finish_reason="length" if i % 4 == 3 else "stop",
                policy_version=0,
                prompt_text=f"p{i}",
                completion_text=text,
                group_id=i // 2,
                sample_index=i % 2,
                metadata={"answer": "42" if i % 3 else "7", "driver_pid": driver_pid},
            )
        )
    return samples


def test_pool_matches_pure_scorer_in_order(ray_session: None, user_file: Path) -> None:
    from reward import RewardService

    specs = [
        RewardFunctionSpec("reward.builtin:exact_answer"),
        RewardFunctionSpec("reward.builtin:format_number", weight=0.1),
        RewardFunctionSpec(f"{user_file}:length_or_boom", weight=0.5, name="len"),
    ]
    samples = make_samples(10)
    expected = RewardScorer(specs).score(samples)
    with RewardService(specs, num_workers=2) as service:
        got = service.score(samples)
    assert [g.sample for g in got] == samples
    assert [(g.reward, g.components, g.error) for g in got] == [
        (e.reward, e.components, e.error) for e in expected
    ]
    errors = [g.error for g in got if g.error]
    assert errors == ["len: ValueError: boom in batch"] * 2  # samples 2 and 7


def test_user_file_runs_inside_actors(ray_session: None, tmp_path: Path, user_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from reward import RewardService

    monkeypatch.chdir(tmp_path)  # relative spec resolved against the driver's directory
    service = RewardService([RewardFunctionSpec("my_rewards.py:pid_parity")], num_workers=2)
    try:
        got = service.score(make_samples(5, driver_pid=os.getpid()))
    finally:
        service.shutdown()
    assert [g.reward for g in got] == [1.0] * 5


def test_bad_spec_fails_at_construction_with_loader_message(ray_session: None, tmp_path: Path) -> None:
    from reward import RewardService

    with pytest.raises(ValueError) as info:
        RewardService(
            [RewardFunctionSpec("reward.builtin:exact_answer"), RewardFunctionSpec("missing.py:f")],
            num_workers=2,
            base_dir=str(tmp_path),
        )
    msg = str(info.value)
    assert isinstance(info.value, RewardLoadError)
    assert msg == (
        f"reward.functions[1].fn='missing.py:f': file {tmp_path / 'missing.py'} not found; "
        f"give a path relative to the base directory {tmp_path}, or an absolute path"
    )
    assert "RayTaskError" not in msg and "Traceback" not in msg


def test_worker_crash_marks_its_chunk_and_pool_recovers(ray_session: None, user_file: Path) -> None:
    from reward import RewardService

    service = RewardService([RewardFunctionSpec(f"{user_file}:die_on_die")], num_workers=2)
    try:
        samples = make_samples(4)
        samples[3].completion_text = "die"  # second worker's chunk is samples 2..3
        got = service.score(samples)
        assert [g.reward for g in got[:2]] == [1.0, 1.0]
        assert all(g.reward is None and "reward worker died" in g.error for g in got[2:])
        assert [g.reward for g in service.score(make_samples(4))] == [1.0] * 4
    finally:
        service.shutdown()
