"""Shared fixtures: the built-in tiny model (built once per session) and config composition."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The built-in tiny model and arithmetic task, built from scratch into a temp dir."""
    from examples.arith import build as prepare_tiny

    out = tmp_path_factory.mktemp("tiny")
    prepare_tiny(str(out), seed=0)
    return str(out)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for tests that drive actors directly (e2e tests start their own via train())."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_code(tmp_path_factory) -> tuple[str, dict]:
    """The built-in tiny code model and code speed-up task (dir, build summary), built once."""
    from examples.code_speedup import build as build_tiny_code

    out = tmp_path_factory.mktemp("tiny_code")
    summary = build_tiny_code(str(out), seed=0, threads=0, log_every=0)
    return str(out), summary


def compose_config(overrides: list[str]):
    """The real Hydra config of `launch.train` with overrides, validated, paths made absolute."""
    import launch.train
    from rl.compose import compose

    cfg = compose("train", overrides)
    launch.train.resolve_paths(cfg)
    return cfg


@pytest.fixture
def make_config(tiny_dir, tmp_path):
    """Compose the real Hydra config with overrides, pointed at the tiny model and a temp run dir."""

    def build(*overrides: str):
        base = [
            f"model.path={tiny_dir}/model",
            f"task.train_files=[{tiny_dir}/data/train.jsonl]",
            f"run.dir={tmp_path}/run",
            "run.progress=false",
        ]
        return compose_config(base + list(overrides))

    return build
