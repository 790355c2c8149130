"""Shared fixtures: the built-in tiny model (built once per session) and config composition."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The built-in tiny model and arithmetic task, built from scratch into a temp dir."""
    from launch.prepare_tiny import prepare_tiny

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


@pytest.fixture
def make_config(tiny_dir, tmp_path):
    """Compose the real Hydra config with overrides, pointed at the tiny model and a temp run dir."""
    from hydra import compose, initialize_config_dir

    import launch.train  # noqa: F401  registers the schema
    from rl.config import validate

    def build(*overrides: str):
        base = [
            f"model.path={tiny_dir}/model",
            f"task.train_files=[{tiny_dir}/data/train.jsonl]",
            f"run.dir={tmp_path}/run",
            "run.progress=false",
        ]
        with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base=None):
            cfg = compose("train", overrides=base + list(overrides))
        validate(cfg)
        launch.train.resolve_paths(cfg)
        return cfg

    return build
