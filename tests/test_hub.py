"""Hub ids as model paths (launch/hub.py), resolved through huggingface_hub's real code against a
Hugging Face cache laid out on disk (tests/hub_cache.py), offline: no network is touched."""

from __future__ import annotations

import json

import pytest

from launch.hub import looks_like_hub_id, resolve_hub_ids, resolve_model, split_revision
from rl.config.schema import ConfigError
from tests.hub_cache import add_snapshot, offline_cache

MAIN = "a" * 40
V1 = "b" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """`org/tiny` at two commits (main; tag v1) in an offline cache of this test's own."""
    for commit, name in ((MAIN, "main"), (V1, "v1")):
        folder = tmp_path / f"src-{name}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "which": name}))
        (folder / "tokenizer.json").write_text("{}")
        add_snapshot(tmp_path / "hub", "org/tiny", folder, commit, refs=(name,))
    offline_cache(monkeypatch, tmp_path / "hub")
    return tmp_path / "hub"


def _which(folder: str) -> str:
    with open(f"{folder}/config.json") as f:
        return json.load(f)["which"]


@pytest.mark.parametrize("path, hub", [
    ("Qwen/Qwen3-1.7B", True), ("gpt2", True), ("org/name@v1", True),
    ("artifacts/tiny/model", False),  # two slashes: a path, never an id
    ("./org/name", False), ("/abs/org", False), ("~/models/x", False), ("org/na me", False), ("", False),
])
def test_which_paths_are_hub_ids(path, hub):
    assert looks_like_hub_id(path) is hub


def test_an_existing_local_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not looks_like_hub_id("org/name") and resolve_model("org/name") == "org/name"


def test_split_revision():
    assert split_revision("org/name@v1") == ("org/name", "v1")
    assert split_revision("org/name") == ("org/name", "")
    assert split_revision("org/name@") == ("org/name@", "")


def test_a_cached_id_resolves_to_its_snapshot_at_the_revision_asked(cache):
    main = resolve_model("org/tiny")
    assert main == str(cache / "models--org--tiny" / "snapshots" / MAIN) and _which(main) == "main"
    assert _which(resolve_model("org/tiny", "v1", "model.path", "model.revision")) == "v1"
    assert _which(resolve_model("org/tiny@v1", field="algorithm.critic_init")) == "v1"
    assert _which(resolve_model("org/tiny", V1)) == "v1"  # a commit works as a revision too


def test_the_config_s_model_fields_are_replaced_by_their_snapshots(cache):
    from rl.config.compose import compose

    cfg = compose("train", ["model.path=org/tiny", "model.revision=v1", "algorithm.critic_init=org/tiny@main",
                            "reward.functions=[{fn: reward.builtin:exact_answer}, "
                            "{fn: reward.model_reward:score, kwargs: {path: org/tiny}}]"])
    resolve_hub_ids(cfg)
    assert _which(cfg.model.path) == "v1" and cfg.model.path.startswith(str(cache))
    assert _which(cfg.algorithm.critic_init) == "main"
    assert _which(cfg.reward.functions[1].kwargs.path) == "main"
    default = compose("train", [])
    resolve_hub_ids(default)  # the built-in model's path is left for rl.data.builtins.ensure_builtin
    assert default.model.path == "artifacts/tiny/model"


@pytest.mark.parametrize("overrides, names", [
    (["model.path=org/missing"], ["model.path='org/missing'", "org/missing is not in the Hugging Face cache",
                                  "HF_HUB_OFFLINE is set", "hf download org/missing"]),
    (["model.path=org/tiny", "model.revision=v9"], ["model.revision='v9'", "org/tiny@v9 is not in",
                                                    "hf download org/tiny --revision v9"]),
    (["model.path=org/tiny@v1", "model.revision=main"], ["names revision 'v1' but model.revision='main'"]),
    (["algorithm.critic_init=org/gone@v2"], ["algorithm.critic_init='org/gone@v2'", "org/gone@v2 is not in"]),
    (["model.revision=v1"], ["model.revision='v1' applies to a Hub id", "is the built-in model"]),
])
def test_a_missing_id_or_revision_is_refused_naming_the_field_and_the_cache(cache, overrides, names):
    from rl.config.compose import compose

    with pytest.raises(ConfigError) as err:
        resolve_hub_ids(compose("train", overrides))
    for name in names:
        assert name in str(err.value), str(err.value)
    if any(" is not in" in name for name in names):  # where it looked
        assert str(cache) in str(err.value)


def test_model_revision_with_a_local_folder_is_refused(tmp_path, monkeypatch):
    from rl.config.compose import compose

    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="model.revision='v1' applies to a Hub id, but model.path='mine' is a local"):
        resolve_hub_ids(compose("train", ["model.path=mine", "model.revision=v1"]))


def test_the_run_s_checks_refuse_a_missing_id_first(cache, tmp_path):
    """`launch.train`'s checks (what runs before Ray starts) stop on the id before building or loading anything."""
    from launch.checks import check_inputs
    from rl.config.compose import compose

    overrides = ["model.path=org/missing", f"run.dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match=r"model.path='org/missing': org/missing is not in the Hugging Face cache"):
        check_inputs(compose("train", overrides), overrides)
    assert not (tmp_path / "run").exists()
