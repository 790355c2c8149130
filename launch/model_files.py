"""A model folder as the checks and the planner read it: its config.json, and the sequence length
its position embeddings allow. A missing or unreadable folder is a ConfigError naming the field."""

from __future__ import annotations

import json
import os
from typing import Any

from rl.config.schema import ConfigError


# Keys of config.json that bound the sequence length (the names transformers' model families use).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")


def require_model(path: str, what: str = "model.path") -> dict[str, Any]:
    """A model folder must exist once the built-in ones have been built (`rl.data.builtins.ensure_builtin`)
    and hold a readable `config.json`; returns that config as a dict."""
    from trainer.gguf import convert_command, is_gguf

    if is_gguf(path):
        command, out = convert_command(path)
        raise ConfigError(f"{what}={path!r} is a GGUF checkpoint (llama.cpp's format), which vLLM and DeepSpeed do "
                          f"not train; convert it to a Hugging Face folder with `{command}` and set {what}={out}")
    if not os.path.isdir(path):
        raise ConfigError(
            f"{what}={path!r} does not exist; give a local Hugging Face model folder (config.json + "
            "weights + tokenizer), or leave the default to use the built-in tiny model"
        )
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(
            f"{what}={path!r} has no config.json, so it is not a Hugging Face model folder; give the folder "
            "that save_pretrained wrote (config.json + weights + tokenizer)"
        )
    try:
        with open(config, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{what}={path!r}: its config.json cannot be read ({err}); write it again with "
                          "save_pretrained") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what}={path!r}: its config.json is not a JSON object; write it again with save_pretrained")
    return loaded


def _count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1


def position_limit(config: dict[str, Any]) -> tuple[int, str] | None:
    """The longest sequence (tokens) the model config allows and the key it comes from, or None when
    it names none. Errs on the long side: a RoPE scaling `factor` > 1 raises the limit, and a
    `model_max_length` above the position table wins (as vLLM reads them)."""
    for node in (config, config.get("text_config"), config.get("language_config")):
        if not isinstance(node, dict):
            continue
        found = [(int(node[k]), k) for k in POSITION_KEYS if _count(node.get(k))]
        if not found:
            continue
        limit, key = min(found)
        if _count(node.get("model_max_length")) and node["model_max_length"] > limit:
            limit, key = int(node["model_max_length"]), "model_max_length"
        factor = 1.0
        for rope in (node.get("rope_scaling"), node.get("rope_parameters")):
            if isinstance(rope, dict):  # one set of parameters, or one per layer type
                for r in (rope, *rope.values()):
                    if isinstance(r, dict) and isinstance(r.get("factor"), (int, float)):
                        factor = max(factor, float(r["factor"]))
        if factor > 1:
            return int(limit * factor), f"{key} x rope factor {factor:g}"
        return limit, key
    return None


def embedding_rows(config: dict[str, Any]) -> int | None:
    """How many token ids the model embeds (`vocab_size`, or its text model's), None if unsaid."""
    for node in (config, config.get("text_config")):
        if isinstance(node, dict) and _count(node.get("vocab_size")):
            return int(node["vocab_size"])
    return None


def experts(config: dict[str, Any]) -> int:
    """How many routed experts a mixture-of-experts model has (0: a dense model), by the keys
    transformers' MoE families use."""
    for node in (config, config.get("text_config")):
        if isinstance(node, dict):
            for key in ("num_experts", "num_local_experts", "n_routed_experts"):
                if _count(node.get(key)):
                    return int(node[key])
    return 0


def vllm_architectures() -> frozenset[str]:
    """The architectures vLLM implements itself, read from its model registry's source: the keys
    of its `_..._MODELS` tables (importing the registry costs ~5 s of the launch). Empty when vLLM
    is not installed."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    registry = os.path.join(list(spec.submodule_search_locations)[0], "model_executor", "models", "registry.py")
    with open(registry, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id.endswith("_MODELS") for t in targets) and \
                isinstance(node.value, ast.Dict):
            names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return frozenset(names)


def require_vllm_architecture(path: str, config: dict[str, Any]) -> None:
    """vLLM must serve the model: its own implementation of the architecture, or, for a
    transformers model class it lacks, its Transformers backend (which needs a class that takes
    transformers' attention interface; vLLM's own rule, vllm/model_executor/models/registry.py).
    A model with remote code (`auto_map`) is left to vLLM."""
    archs = config.get("architectures")
    where = os.path.join(path, "config.json")
    if not archs or not isinstance(archs, list):
        raise ConfigError(f"model.path={path!r}: {where} names no `architectures`, so vLLM cannot tell which model "
                          "class to build; save the model with save_pretrained (which writes it)")
    known = vllm_architectures()
    if config.get("auto_map") or not known or any(a in known for a in archs):
        return
    import transformers

    for arch in archs:
        cls = getattr(transformers, arch, None)
        if cls is not None and (cls.is_backend_compatible() or cls._can_set_attn_implementation()):
            return  # vLLM's Transformers backend serves it
    raise ConfigError(
        f"model.path={path!r}: architecture {', '.join(archs)} (architectures in {where}) is not one vLLM serves: "
        "vLLM has no implementation of it, and "
        + ("transformers has no class of that name" if all(getattr(transformers, a, None) is None for a in archs)
           else "its transformers class does not take transformers' attention interface, which vLLM's Transformers "
                "backend needs")
        + "; use rollout.backend=hf (the Hugging Face engine, slower) or a model vLLM supports")
