"""Hub ids where a model folder is asked for: `model.path=Qwen/Qwen3-1.7B` (with `model.revision`, a
branch, tag or commit), or `org/name@revision` in the other model fields (a reward model's `path`,
`algorithm.critic_init`).

The id is resolved by `huggingface_hub.snapshot_download` into the standard Hugging Face cache
(`HF_HUB_CACHE`, default ~/.cache/huggingface/hub) before Ray starts, and the field is replaced by
the snapshot folder it names (`.../models--org--name/snapshots/<commit>`): every actor then loads
that one commit, and a resumed run whose id now names another commit is refused as a changed config.
Offline (`HF_HUB_OFFLINE=1`, or no network) a cached id and revision resolve through the cache's
`refs/`; a missing one is refused naming the field, the cache and how to fill it. On a cluster the
other nodes read the same path: keep the cache on a filesystem they share (HF_HUB_CACHE).
A path that exists locally is always the local folder, never a Hub id.
"""

from __future__ import annotations

import os
from typing import Any

from rl.config.schema import ConfigError
from rl.data.hub import bounded_waits, hub_failure, transport_errors

# Files a training run never reads: other frameworks' weights and the originals some repos keep
# next to the Hugging Face ones (safetensors or PyTorch .bin weights, config and tokenizer are kept).
IGNORED = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.mlmodel",
           "original/*", "onnx/*", "openvino/*", "coreml/*"]


def split_revision(path: str) -> tuple[str, str]:
    """`org/name@rev` -> (`org/name`, `rev`); a path without `@` has revision ''."""
    name, sep, revision = path.partition("@")
    return (name, revision) if sep and name and revision else (path, "")


def looks_like_hub_id(path: str) -> bool:
    """`name` or `org/name` as the Hub spells repository ids, and not a path that exists here."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name, _ = split_revision(path)
    if os.path.exists(path) or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_model(path: str, revision: str = "", field: str = "model.path",
                  revision_field: str | None = None) -> str:
    """The local folder for `path`: itself when it is not a Hub id, else the cached (or downloaded)
    snapshot of that id at `revision` (or the `@rev` in `path`; neither: the default branch)."""
    if not looks_like_hub_id(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, at = split_revision(path)
    if at and revision and at != revision:
        raise ConfigError(f"{field}={path!r} names revision {at!r} but {revision_field}={revision!r}; give one of them")
    revision = at or revision
    rev_field = revision_field if revision and not at else field
    shown = f"{repo_id}@{revision}" if revision else repo_id
    bounded_waits()
    try:
        return snapshot_download(repo_id, revision=revision or None, ignore_patterns=IGNORED)
    except RevisionNotFoundError:
        raise ConfigError(f"{rev_field}: the Hub repository {repo_id} has no revision {revision!r}; give a branch, "
                          f"tag or commit of it") from None
    except GatedRepoError:
        raise ConfigError(f"{field}={path!r} is a gated Hub repository: accept its terms on the Hub and log in "
                          "(`hf auth login`, or HF_TOKEN) on this machine") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{field}={path!r} is neither a local folder nor a Hub model this machine can see; give "
                          "a local Hugging Face model folder, or a Hub id (e.g. Qwen/Qwen3-1.7B); for a private "
                          "repository log in first (`hf auth login`, or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached from here"
        where = f"{field}={path!r}" + (f", {revision_field}={revision!r}" if revision and not at else "")
        raise ConfigError(
            f"{where}: {shown} is not in the Hugging Face cache ({cache_dir()}) and {why}; download it "
            f"where there is network (`hf download {repo_id}" + (f" --revision {revision}" if revision else "")
            + "`) into this cache, point HF_HUB_CACHE at a cache that holds it, or give a local model folder"
        ) from None
    except HFValidationError as err:
        raise ConfigError(f"{field}={path!r}: not a Hub id the Hub accepts ({err}); give a local folder or "
                          "an id like org/name") from None
    except transport_errors() as err:
        raise ConfigError(f"{field}={path!r}: {hub_failure(err)}") from None


def resolve_hub_ids(cfg: Any) -> None:
    """Every model field that names a Hub id replaced by the folder of its snapshot
    in the Hugging Face cache: `model.path` at `model.revision`, a reward model's `path` and
    `algorithm.critic_init` at their `@revision`. Built-in and existing local paths stay as given."""
    from rl.data.builtins import builtin_dir

    if builtin_dir(cfg.model.path) is None:
        if cfg.model.revision and not looks_like_hub_id(cfg.model.path):
            raise ConfigError(f"model.revision={cfg.model.revision!r} applies to a Hub id, but model.path="
                              f"{cfg.model.path!r} is a local folder; drop model.revision")
        cfg.model.path = resolve_model(cfg.model.path, cfg.model.revision, "model.path", "model.revision")
    elif cfg.model.revision:
        raise ConfigError(f"model.revision={cfg.model.revision!r} applies to a Hub id, but model.path="
                          f"{cfg.model.path!r} is the built-in model; drop model.revision")
    critic = cfg.algorithm.get("critic_init") if "algorithm" in cfg else None  # RL configs only
    if critic and builtin_dir(critic) is None:
        cfg.algorithm.critic_init = resolve_model(critic, field="algorithm.critic_init")
    teacher = cfg.algorithm.get("teacher_path") if "algorithm" in cfg else None
    if teacher and builtin_dir(teacher) is None:
        cfg.algorithm.teacher_path = resolve_model(teacher, field="algorithm.teacher_path")
    for i, f in enumerate(cfg.reward.functions if "reward" in cfg else []):
        if f.kwargs and isinstance(f.kwargs.get("path"), str) and builtin_dir(f.kwargs.path) is None:
            f.kwargs.path = resolve_model(f.kwargs.path, field=f"reward.functions[{i}].kwargs.path")
