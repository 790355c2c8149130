"""An LLM as judge: ``fn: reward.judge:score`` (``reward=judge``).

A served causal LM reads each completion through a prompt template and its reply is parsed into a
reward. Configure it like any reward function (``configs/reward/judge.yaml``)::

    functions:
      - fn: reward.judge:score
        kwargs: {path: artifacts/smollm2-135m-instruct, verdict: yes_no,
                 template: "Question: {prompt}\\nReference answer: {answer}\\n..."}

- ``template``: a Python format string over ``{prompt}``, ``{completion}`` and any column of the
  data (a reference-guided judge names ``{answer}``); a field that is not a column is refused before
  Ray starts (`columns_needed`, read by `reward.scorer.RewardScorer.missing_columns`).
- The rule that turns a reply into a reward (``verdict``): ``yes_no``, the first "yes" or "no" in
  the reply, 1.0 or 0.0; ``number``, the first number, divided by ``max_score`` and clipped to
  [0, 1]. A reply with neither raises, naming the reply: the reward service then scores the batch's
  samples one by one (replies are kept, so nothing is generated twice) and only the unparsable ones
  get that error. ``yes_prob`` generates nothing: the reward is the judge's probability of
  answering yes rather than no, P(yes) / (P(yes) + P(no)) over its first reply token (each summed
  over the spellings yes/Yes/YES, with and without a leading space), as generative verifiers score
  (Zhang et al. 2024, "Generative Verifiers: Reward Modeling as Next-Token Prediction"). A small
  judge whose greedy reply is always "no" can still rank a right answer above a wrong one, and a
  group's advantages need only the ranking.
- The model is loaded once per reward worker process (per path and dtype) and answers greedily in
  batches of ``batch_size``, through its chat template when it has one; every call has the reward
  service's deadline (``reward.timeout_s``), like every reward function. The judge runs in the
  reward workers (Ray actors of their own, ``reward.num_workers``).
"""

from __future__ import annotations

import os
import re
import string
import threading
from typing import Any, Callable

DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {answer}\nStudent's answer: {completion}\n\n"
                    "Does the student's final answer equal the reference answer? Reply with yes or no.")
PER_SAMPLE = ("prompt", "completion")  # the template fields every sample has
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_REPLIES_KEPT = 4096
VERDICTS = ("yes_no", "number", "yes_prob")
YES_NO_SPELLINGS = {"yes": ("yes", "Yes", "YES"), "no": ("no", "No", "NO")}

_models: dict[tuple[str, str], tuple[Any, Any]] = {}
# (path, dtype, verdict kind, judge input) -> reply or P(yes): a per-sample retry reuses it
_replies: dict[tuple[str, str, str, str], Any] = {}
_lock = threading.Lock()


def template_fields(template: str) -> list[str]:
    """The names a format-string template reads, in order, each once."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(f"judge template {template!r} is not a format string: {err}") from None
    if any(not name.isidentifier() for name in names):
        raise ValueError(f"judge template {template!r}: fields must be plain names, e.g. {{answer}}")
    return list(dict.fromkeys(names))


def columns_needed(template: str = DEFAULT_TEMPLATE, verdict: str = "yes_no", **_: Any) -> list[str]:
    """The data columns the template reads (checked against the data before Ray starts, with the
    verdict rule's name)."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict={verdict!r}: choose one of {', '.join(VERDICTS)}")
    return [name for name in template_fields(template) if name not in PER_SAMPLE]


def parse_verdict(reply: str, verdict: str = "yes_no", max_score: float = 10.0) -> float:
    """The reward a reply gives (see the module doc); ValueError when it gives none."""
    if verdict == "yes_no":
        found = _YES_NO.search(reply)
        if found is None:
            raise ValueError(f"judge reply {reply[:80]!r} says neither yes nor no")
        return 1.0 if found.group(1).lower() == "yes" else 0.0
    if verdict == "number":
        found = _NUMBER.search(reply)
        if found is None:
            raise ValueError(f"judge reply {reply[:80]!r} holds no number")
        return min(max(float(found.group(0)) / max_score, 0.0), 1.0)
    raise ValueError(f"verdict={verdict!r}: choose yes_no or number (yes_prob reads no reply)")


def answer_token_ids(tokenizer: Any) -> dict[str, list[int]]:
    """The single-token spellings of "yes" and "no" in `tokenizer` (with and without a leading
    space; not the unknown token); ValueError when either word has none (the judge cannot be read by
    its probabilities)."""
    found: dict[str, list[int]] = {}
    for word, spellings in YES_NO_SPELLINGS.items():
        ids = {tuple(tokenizer.encode(prefix + s, add_special_tokens=False)) for s in spellings for prefix in ("", " ")}
        found[word] = sorted({ids_[0] for ids_ in ids if len(ids_) == 1 and ids_[0] != tokenizer.unk_token_id})
        if not found[word]:
            raise ValueError(f"verdict=yes_prob: the judge's tokenizer has no single token for {word!r}; use "
                             "verdict=yes_no")
    return found


def load(path: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) for `path`, loaded once per process; thread-safe."""
    full = os.path.abspath(os.path.expanduser(path))
    with _lock:
        if (full, dtype) not in _models:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            if not os.path.isdir(full):
                raise FileNotFoundError(f"judge path={path!r} does not exist (resolved to {full}): give a causal LM "
                                        "folder (config.json, weights, tokenizer)")
            tokenizer = AutoTokenizer.from_pretrained(full, padding_side="left")
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            model = AutoModelForCausalLM.from_pretrained(full, dtype=getattr(torch, dtype)).eval()
            model.requires_grad_(False)
            _models[(full, dtype)] = (model, tokenizer)
    return _models[(full, dtype)]


def _cached(path: str, dtype: str, kind: str, texts: list[str], batch_size: int,
            compute: Callable[[Any, Any, Any], list[Any]]) -> list[Any]:
    """The judge's value of `kind` for each text: kept ones reused (a per-sample retry reuses
    them), new ones computed in batches by `compute(model, tokenizer, encoded batch)`, the batch
    being each text as a user turn through the chat template, left padded."""
    model, tok = load(path, dtype)
    todo = [t for t in dict.fromkeys(texts) if (path, dtype, kind, t) not in _replies]
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        if tok.chat_template:
            inputs = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                              tokenize=False) for t in chunk]
        else:
            inputs = chunk
        enc = tok(inputs, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template)
        for text, value in zip(chunk, compute(model, tok, enc), strict=True):
            _replies[(path, dtype, kind, text)] = value
    while len(_replies) > _REPLIES_KEPT:
        _replies.pop(next(iter(_replies)))
    return [_replies[(path, dtype, kind, t)] for t in texts]


def _replies_for(path: str, dtype: str, texts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """The judge's greedy reply to each text."""
    import torch

    def generate(model: Any, tok: Any, enc: Any) -> list[str]:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    return _cached(path, dtype, "reply", texts, batch_size, generate)


def _yes_probs_for(path: str, dtype: str, texts: list[str], batch_size: int) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of the judge's first reply token for each text (one forward pass
    per batch)."""
    import torch

    def yes_odds(model: Any, tok: Any, enc: Any) -> list[float]:
        words = answer_token_ids(tok)
        positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding: each row from 0
        with torch.no_grad():
            probs = model(**enc, position_ids=positions).logits[:, -1].float().softmax(-1)
        yes, no = probs[:, words["yes"]].sum(-1), probs[:, words["no"]].sum(-1)
        return (yes / (yes + no).clamp(min=1e-30)).tolist()

    return _cached(path, dtype, "yes_prob", texts, batch_size, yes_odds)


def score(prompts: list[str], completions: list[str], *, path: str, template: str = DEFAULT_TEMPLATE,
          verdict: str = "yes_no", max_score: float = 10.0, max_new_tokens: int = 8, batch_size: int = 32,
          dtype: str = "float32", threads: int = 1, **columns: Any) -> list[float]:
    """The judge's reward for every (prompt, completion): the reply to `template` filled with the
    sample and its row's columns, parsed by `verdict`. Raises on the first reply that cannot be
    parsed (the reward service then isolates it, see the module doc)."""
    import torch

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size={batch_size} and max_new_tokens={max_new_tokens} must be >= 1")
    fields = columns_needed(template, verdict)
    texts = [template.format(prompt=p, completion=c, **{f: columns[f][i] for f in fields})
             for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        if verdict == "yes_prob":
            return _yes_probs_for(path, dtype, texts, batch_size)
        replies = _replies_for(path, dtype, texts, max_new_tokens, batch_size)
    finally:
        if threads > 0:
            torch.set_num_threads(before)
    return [parse_verdict(reply, verdict, max_score) for reply in replies]


score.columns_needed = columns_needed  # read by RewardScorer.missing_columns with the config's kwargs
