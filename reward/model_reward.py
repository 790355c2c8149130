"""A trained reward model as a reward function: ``fn: reward.model_reward:score``.

Configure it like any reward function (``configs/reward/model.yaml``)::

    functions:
      - fn: reward.model_reward:score
        kwargs: {path: artifacts/tiny_rm/model, batch_size: 64, dtype: float32}

``path`` is a transformers sequence-classification folder with one output, e.g. the
``final_model`` of ``python -m launch.train_rm``. Texts are tokenised and pooled exactly as in
training (`trainer.reward_model`): prompt ids, completion ids, EOS; the score is the head's
output at the last token. The model is loaded once per process (per path and dtype; a lock makes
concurrent first calls load it once) and scored in batches of ``batch_size`` without gradients.

The default ``path`` is the built-in tiny RM (``examples.preference``); `python -m launch.train`
builds it before Ray starts when a reward function names it and it is missing. This function
never builds a model: a missing folder is an error naming the path.
"""

from __future__ import annotations

import os
import threading
from typing import Any

BUILTIN_RM_PATH = os.path.normpath("artifacts/tiny_rm/model")

_models: dict[tuple[str, str], tuple[Any, Any]] = {}
_lock = threading.Lock()


def load(path: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) for `path`, loaded once per process and kept; thread-safe."""
    full = os.path.abspath(os.path.expanduser(path))
    key = (full, dtype)
    with _lock:
        if key not in _models:
            import torch
            from transformers import AutoTokenizer

            from trainer.reward_model import load_reward_model

            if not os.path.isdir(full):
                raise FileNotFoundError(
                    f"reward model path={path!r} does not exist (resolved to {full}); give the folder "
                    "written by `python -m launch.train_rm` (its run.dir/final_model)"
                )
            if dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"dtype={dtype!r}: choose float32, bfloat16 or float16")
            tokenizer = AutoTokenizer.from_pretrained(full)
            model = load_reward_model(full, dtype, tokenizer).eval()
            model.requires_grad_(False)
            if torch.cuda.is_available():
                model = model.cuda()
            _models[key] = (model, tokenizer)
    return _models[key]


def score(
    prompts: list[str],
    completions: list[str],
    *,
    path: str = BUILTIN_RM_PATH,
    batch_size: int = 64,
    dtype: str = "float32",
    threads: int = 1,
    **kwargs: Any,
) -> list[float]:
    """The reward model's score of every (prompt, completion) pair.

    `threads` (> 0) caps torch's CPU threads during the call (restored afterwards): on a
    machine whose cores also run rollouts and the learner, one thread per reward worker avoids
    oversubscription; 0 leaves torch's setting.
    """
    import torch

    from rl.data.padding import pad_id_of
    from trainer.reward_model import collate, rm_input_ids, sequence_scores

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    model, tokenizer = load(path, dtype)
    pad_id = pad_id_of(tokenizer)
    device = next(model.parameters()).device
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                rows = [rm_input_ids(tokenizer, p, c) for p, c in
                        zip(prompts[start : start + batch_size], completions[start : start + batch_size], strict=True)]
                batch = collate(rows, pad_id)
                out += sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device)).tolist()
        return out
    finally:
        if threads > 0:
            torch.set_num_threads(before)
