"""Issue 49: tinker-cookbook 0.6.1's recipes, unchanged, against `python -m launch.serve` (full lane:
the cookbook's environment, `launch/agent_env.sh tinker`, takes ~2 min to make, the service ~1).

The cookbook asks for `meta-llama/Llama-3.2-1B` (a name its model table knows, as sl_basic needs)
and loads that name's tokenizer from the Hugging Face cache; the service resolves the same name
through the same cache, laid out here offline with the untrained tiny model (tests/hub_cache.py),
as Hub ids always resolve. The RL recipe runs its steps and logs a reward for each; the SL recipe's
loss (its own `train_mean_nll`, computed from the log-probs the service returns) falls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.hub_cache import add_snapshot
from tests.serve_proc import ROOT, serving

pytestmark = pytest.mark.full
NAME = "meta-llama/Llama-3.2-1B"


@pytest.fixture(scope="module")
def cookbook_python() -> str:
    subprocess.run(["bash", "launch/agent_env.sh", "tinker"], cwd=ROOT, check=True, timeout=1200)
    return os.path.join(ROOT, ".venv-tinker", "bin", "python")


@pytest.fixture(scope="module")
def served(tiny_untrained, tmp_path_factory):
    """(base URL, the environment both sides run with) of a service serving NAME from a cache."""
    root = tmp_path_factory.mktemp("cookbook")
    cache = root / "hub"
    model = Path(tiny_untrained) / "model"
    add_snapshot(cache, NAME, model, "1" * 40)
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "config")):
            shutil.copy(f, tokenizer / f.name)
    add_snapshot(cache, "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer", tokenizer, "2" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": "tml-cookbook"}
    with serving([f"model.path={NAME}", f"run.dir={root / 'run'}"], root / "serve.log", env) as url:
        yield url, env


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_cookbook_rl_recipe_trains_against_the_service(cookbook_python, served, tmp_path):
    url, env = served
    out = subprocess.run(
        [cookbook_python, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={NAME}",
         "renderer_name=role_colon", f"base_url={url}", "group_size=4", "groups_per_batch=4", "max_tokens=4",
         "max_steps=3", "loss_fn=importance_sampling", "eval_every=0", "save_every=0", "lora_rank=4",
         "learning_rate=1e-3", f"log_path={tmp_path / 'rl'}", "behavior_if_log_dir_exists=delete"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [m for m in _metrics(tmp_path / "rl" / "metrics.jsonl") if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(-0.1 <= m["env/all/reward/total"] <= 1.0 for m in steps)
    checkpoints = _metrics(tmp_path / "rl" / "checkpoints.jsonl")
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")  # its final save_state + sampler weights


def test_the_cookbook_rl_recipe_with_its_default_loss_stops_at_once_saying_why(cookbook_python, served, tmp_path):
    """math_rl unchanged, its default loss (stable_reinforce) included: the hosted service's
    stability information never crosses the protocol (docs/tinker-service.md), so the recipe's
    first sample call is refused naming what is missing and the losses served, before any
    rollout batch is spent; the recipe exits non-zero, nothing trained."""
    url, env = served
    out = subprocess.run(
        [cookbook_python, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={NAME}",
         "renderer_name=role_colon", f"base_url={url}", "group_size=4", "groups_per_batch=4", "max_tokens=4",
         "max_steps=3", "eval_every=0", "save_every=0", "lora_rank=4", f"log_path={tmp_path / 'rl'}",
         "behavior_if_log_dir_exists=delete"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert "record_stability_info is not served" in said and "loss_fn=importance_sampling" in said, said[-4000:]
    metrics = tmp_path / "rl" / "metrics.jsonl"
    assert not metrics.exists() or not [m for m in _metrics(metrics) if "env/all/reward/total" in m]


def test_the_cookbook_sl_recipe_lowers_its_loss_against_the_service(cookbook_python, served, tmp_path):
    url, env = served
    conv = subprocess.run([cookbook_python, "-c", "import tinker_cookbook, os; print(os.path.join(os.path.dirname("
                           "tinker_cookbook.__file__), 'example_data', 'conversations.jsonl'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run(
        [cookbook_python, "-m", "tinker_cookbook.recipes.sl_basic", f"model_name={NAME}", f"base_url={url}",
         f"log_path={tmp_path / 'sl'}", "lora_rank=8", "eval_every=0", "save_every=0", "max_steps=8",
         "learning_rate=3e-3", "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
         f"dataset_builder.file_path={conv}", f"dataset_builder.common_config.model_name_for_tokenizer={NAME}",
         "dataset_builder.common_config.renderer_name=role_colon", "dataset_builder.common_config.batch_size=4",
         "dataset_builder.common_config.max_length=60"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    nll = [m["train_mean_nll"] for m in _metrics(tmp_path / "sl" / "metrics.jsonl") if "train_mean_nll" in m]
    assert len(nll) == 8
    assert sum(nll[-2:]) / 2 < sum(nll[:2]) / 2 * 0.9, nll
