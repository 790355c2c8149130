"""GGUF checkpoints (llama.cpp's format) turned into plain Hugging Face folders.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package)
and dequantizes it, but the loaded model keeps a GGUF quantization config and refuses
`save_pretrained`, and vLLM and DeepSpeed want safetensors. `convert_gguf` builds a plain model
from the file's config, loads the dequantized weights into it and writes an ordinary folder:
safetensors, tokenizer (with its chat template), generation config (with its EOS).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_gguf(path: str) -> bool:
    """A `.gguf` file, or a folder holding one but no config.json (what `model.path` cannot load)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def convert_command(path: str) -> tuple[str, str]:
    """The command line that converts the GGUF checkpoint at `path` (a file or a folder), and the
    folder it writes."""
    p = Path(path)
    found = p if p.is_file() else next(iter(sorted(p.glob("*.gguf"))), p / "MODEL.gguf")
    out = f"{found.with_suffix('')}-hf"
    return f"python -m launch.convert_gguf {found} --out {out}", out


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 generation: dict[str, Any] | None = None) -> str:
    """Write `out_dir` (complete or absent) as a plain HF folder holding the dequantized weights
    of `gguf_file` in `dtype` (default float32); `generation` updates its generation config.
    Returns `out_dir`. Imports torch and transformers only when called."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    from trainer.engine import save_pretrained_atomic

    gguf_file = Path(gguf_file)
    where, name = str(gguf_file.parent), gguf_file.name
    # Each from_pretrained parses the whole GGUF header again (~5 s for a 49k-token vocabulary):
    # the config is read once and handed to the model's load.
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=copy.deepcopy(config), dtype=dtype)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are dequantized: a plain model
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    if generation:
        model.generation_config.update(**generation)
    save_pretrained_atomic(model.eval(), tokenizer, out_dir)
    return str(out_dir)
