"""reasoning-gym's procedural tasks, as its authors wrote them: rows from any of its datasets,
mixed the way its `CompositeDataset` mixes them, each completion scored by its own dataset's
`score_answer` on the answer between `<answer>` tags (reasoning-gym's `extract_answer`), or on its
last number (`extract_answer: final_answer`, for a model that does not write the tags).

`task=reasoning_gym task.datasets=[{name: basic_arithmetic, weight: 1, config: {...}}, ...]`:
before Ray starts, `launch.checks` refuses an unknown dataset or config key (`spec_errors`) and
writes the rows (`write_splits`); `score` is the reward function. Needs the `reasoning-gym` extra
(`pip install -e .[reasoning-gym]`); imported only when a run names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import lru_cache
from typing import Any

EXTRA = "the reasoning-gym extra (.venv/bin/pip install -e '.[reasoning-gym]')"
ENTRY = "rg_entry"  # the column holding reasoning-gym's own entry (JSON): what `score_answer` reads


def _gym():
    try:
        import reasoning_gym
        from reasoning_gym import composite, factory
    except ImportError as err:
        raise ImportError(f"task.datasets names reasoning-gym datasets but reasoning-gym is not installed "
                          f"({err}); install {EXTRA}") from None
    return reasoning_gym, composite, factory


def spec_errors(specs: list[dict[str, Any]], field: str = "task.datasets") -> list[str]:
    """What is wrong with `specs` (each {name, weight, config}), one message per fault, naming the
    field and the choices: an unknown dataset, an unknown config key, a weight not above 0, a
    config the dataset itself refuses (its `validate`)."""
    _, _, factory = _gym()
    errors: list[str] = []
    if not specs:
        return [f"{field} is empty: name at least one reasoning-gym dataset, e.g. "
                f"{field}=[{{name: basic_arithmetic, weight: 1}}]"]
    names = [s.get("name") if isinstance(s, dict) else None for s in specs]
    for i, spec in enumerate(specs):
        where = f"{field}[{i}]"
        if not isinstance(spec, dict):
            errors.append(f"{where}={spec!r}: an entry is a mapping {{name: ..., weight: ..., config: {{...}}}}")
            continue
        unknown = sorted(set(spec) - {"name", "weight", "config"})
        if unknown:
            errors.append(f"{where} has the key(s) {', '.join(unknown)}; a dataset entry takes name, weight, config")
        name = spec.get("name")
        if name not in factory.DATASETS:
            close = sorted(n for n in factory.DATASETS if str(name or "")[:4] in n)[:8] or sorted(factory.DATASETS)[:8]
            errors.append(f"{where}.name={name!r} is not a reasoning-gym dataset (e.g. {', '.join(close)}; "
                          f"{len(factory.DATASETS)} in all: python -c 'import reasoning_gym.factory as f; "
                          f"print(sorted(f.DATASETS))')")
            continue
        if names.count(name) > 1:
            errors.append(f"{where}.name={name!r} is named twice; give each dataset one entry")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            errors.append(f"{where}.weight={weight!r}: must be a number above 0")
        config = spec.get("config") or {}
        if not isinstance(config, dict):
            errors.append(f"{where}.config={config!r}: must be a mapping of {name}'s config keys")
            continue
        _, config_cls = factory.DATASETS[name]
        keys = {f.name for f in dataclasses.fields(config_cls)}
        bad = sorted(set(config) - keys)
        if bad:
            errors.append(f"{where}.config has {', '.join(map(str, bad))}, which {name}'s config "
                          f"({config_cls.__name__}) lacks; its keys: {', '.join(sorted(keys))}")
            continue
        try:
            made = config_cls(**config)
            if hasattr(made, "validate"):
                made.validate()
        except Exception as err:  # the dataset's own check (an AssertionError, a ValueError...)
            errors.append(f"{where}.config={dict(config)}: {name} refuses it ({type(err).__name__}: {err})")
    return errors


def _composite(specs: list[dict[str, Any]], size: int, seed: int):
    _, composite, _ = _gym()
    return composite.CompositeDataset(composite.CompositeConfig(size=size, seed=seed, datasets=[
        composite.DatasetSpec(name=s["name"], weight=float(s.get("weight", 1.0)), config=dict(s.get("config") or {}))
        for s in specs]))


def row(entry: dict[str, Any], instruction: str = "") -> dict[str, Any]:
    """One of our rows for one reasoning-gym entry: the question (then `instruction`, if any) as
    the prompt, its answer, its dataset (for per-dataset evaluation) and the whole entry, which
    `score_answer` reads."""
    prompt = f"{entry['question']} {instruction}" if instruction else entry["question"]
    return {"prompt": prompt, "answer": str(entry["answer"]),
            "dataset": entry["metadata"]["source_dataset"], ENTRY: json.dumps(entry, default=str)}


def splits(specs: list[dict[str, Any]], size: int, eval_size: int, seed: int,
           instruction: str = "") -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows: one composite of `size + eval_size` entries drawn with `seed`;
    the first `eval_size` (by index) are held out, and a training entry whose question is also
    held out is dropped, so no held-out question is trained on (small datasets repeat questions)."""
    mix = _composite(specs, size + eval_size, seed)
    held = [row(mix[i], instruction) for i in range(eval_size)]
    seen = {r["prompt"] for r in held}
    train = [r for r in (row(mix[i], instruction) for i in range(eval_size, eval_size + size)) if r["prompt"] not in seen]
    return train, held


def data_dir(specs: list[dict[str, Any]], size: int, eval_size: int, seed: int, root: str,
             instruction: str = "") -> str:
    """Where rows for exactly these settings (and this reasoning-gym version) are kept."""
    from importlib.metadata import version

    _gym()
    key = json.dumps([specs, size, eval_size, seed, instruction, version("reasoning-gym")], sort_keys=True,
                     default=str)
    return os.path.join(root, hashlib.sha1(key.encode()).hexdigest()[:12])


def write_splits(specs: list[dict[str, Any]], size: int, eval_size: int, seed: int,
                 root: str = "artifacts/reasoning_gym", instruction: str = "") -> tuple[str, str | None]:
    """Write (once) the train and held-out JSONL files for these settings; returns their paths
    (held-out None when `eval_size` is 0)."""
    from rl.data.jsonl import write_jsonl

    out = data_dir(specs, size, eval_size, seed, root, instruction)
    train_path, test_path = os.path.join(out, "train.jsonl"), os.path.join(out, "test.jsonl")
    if not os.path.exists(train_path):
        train, held = splits(specs, size, eval_size, seed, instruction)
        write_jsonl(test_path, held)
        write_jsonl(train_path, train)
    return train_path, (test_path if eval_size > 0 else None)


@lru_cache(maxsize=8)
def _scorers(specs_json: str):
    """Each named dataset built with its config, as the composite builds it (its score_answer may
    read its config)."""
    _, _, factory = _gym()
    out = {}
    for s in json.loads(specs_json):
        config = dict(s.get("config") or {})
        out[s["name"]] = factory.create_dataset(s["name"], **{"seed": 0, "size": 1, **config})
    return out


EXTRACTORS = ("tags", "final_answer")


def extract(completion: str, how: str = "tags") -> str | None:
    """A completion's answer: "tags", reasoning-gym's own (`extract_answer`: the last
    `<answer>...</answer>`); "final_answer", the last `\\boxed{}`, else the last number
    (`rl.data.answers.final_answer`, what `reward.builtin:math_answer` reads), for a model that
    does not write the tags."""
    if how == "final_answer":
        from rl.data.answers import final_answer

        return final_answer(completion)
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def score(prompts: list[str], completions: list[str], rg_entry: list[str], *, datasets: list[dict[str, Any]],
          extract_answer: str = "tags", sample_timeout_s: float = 10.0, **kwargs: Any) -> list[float | BaseException]:
    """reasoning-gym's verdict on each completion: its dataset's `score_answer(answer, entry)`
    (a number in [0, 1]; 0 when no answer is found), the dataset built with the run's config for
    it, the answer found by `extract_answer` (`extract`). `datasets`: the run's `task.datasets`
    (reward kwargs). A verdict that raises, is not a number or takes over `sample_timeout_s` is
    that sample's error (the exception, which the scorer reports), never the batch's."""
    if extract_answer not in EXTRACTORS:
        raise ValueError(f"extract_answer={extract_answer!r}: choose one of {', '.join(EXTRACTORS)}")
    from reward.scorer import RewardCallTimeout, call_with_timeout

    scorers = _scorers(json.dumps(list(datasets), sort_keys=True, default=str))
    out: list[float | BaseException] = []
    for text, raw in zip(completions, rg_entry, strict=True):
        try:
            entry = json.loads(raw)
            dataset = scorers[entry["metadata"]["source_dataset"]]
            answer = extract(text, extract_answer)
            verdict = call_with_timeout(lambda: dataset.score_answer(answer, entry), {}, sample_timeout_s)
            out.append(float(verdict))
        except RewardCallTimeout:
            out.append(TimeoutError(f"no verdict within {sample_timeout_s:g} s (reasoning-gym's score_answer)"))
        except Exception as err:  # noqa: BLE001 - the sample's error, reported by the scorer
            out.append(err)
    return out
