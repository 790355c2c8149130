"""reasoning-gym's procedural tasks, as its authors wrote them: rows from any of its datasets,
mixed the way its `CompositeDataset` mixes them, each completion scored by its own dataset's
`score_answer` on the answer between `<answer>` tags (reasoning-gym's `extract_answer`), or on its
last number (`extract_answer: final_answer`, for a model that does not write the tags).

`task=reasoning_gym task.datasets=[{name: basic_arithmetic, weight: 1, config: {...}}, ...]`:
before Ray starts, `launch.checks` refuses an unknown dataset or config key (`spec_errors`), an
extraction under which a perfect answer cannot score (`extraction_errors`: word answers and the
last number) and a config reasoning-gym cannot generate from (`RowsError`, naming the entry), and
writes the rows (`write_splits`; each keeps its entry exactly, `encode_entry`); `score` is the
reward function. Needs the `reasoning-gym` extra
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


class RowsError(ValueError):
    """A dataset of `task.datasets` that reasoning-gym cannot make rows from (its constructor or
    its generator raised, or an entry holds a value a row cannot keep); the message names the
    entry, its config and the fix."""


def _described(spec: dict[str, Any]) -> str:
    config = dict(spec.get("config") or {})
    return f"{spec['name']} ({', '.join(f'{k}={v!r}' for k, v in config.items()) or 'its default config'})"


def _fix(spec: dict[str, Any]) -> str:
    """What to change in a config reasoning-gym accepts but cannot generate from."""
    config = dict(spec.get("config") or {})
    if not config:
        return (f"{spec['name']}'s default config fails here (a reasoning-gym bug): set its config, or drop "
                f"{spec['name']} from task.datasets")
    moves = [f"lower {k}" if k.startswith("min_") else f"raise {k}" if k.startswith("max_") else f"change {k}"
             for k in config]
    return (f"its config asks for entries {spec['name']} cannot make: {' or '.join(moves)} (or drop "
            f"{spec['name']} from task.datasets)")


def _composite(specs: list[dict[str, Any]], size: int, seed: int, field: str = "task.datasets"):
    """reasoning-gym's CompositeDataset over `specs`; a dataset whose constructor raises is named."""
    _, composite, factory = _gym()
    try:
        return composite.CompositeDataset(composite.CompositeConfig(size=size, seed=seed, datasets=[
            composite.DatasetSpec(name=s["name"], weight=float(s.get("weight", 1.0)),
                                  config=dict(s.get("config") or {}))
            for s in specs]))
    except Exception as err:  # noqa: BLE001 - named below, by building each dataset as the composite does
        for i, s in enumerate(specs):
            try:  # the composite's own derivation of each dataset's seed and size
                factory.create_dataset(s["name"], **{"seed": seed + i + 1, "size": size, **dict(s.get("config") or {})})
            except Exception as own:  # noqa: BLE001
                raise RowsError(f"{field}[{i}] {_described(s)}: reasoning-gym could not build the dataset: "
                                f"{type(own).__name__}: {own}; {_fix(s)}") from own
        raise RowsError(f"{field}: reasoning-gym could not build the composite of these datasets: "
                        f"{type(err).__name__}: {err}") from err


def _source(mix, specs: list[dict[str, Any]], idx: int) -> int:
    """Which of `specs` the composite draws entry `idx` from (its own weighted choice, as its
    `__getitem__` makes it): to name the dataset whose generator failed."""
    from random import Random

    picked = Random(mix.seed + idx).choices(range(len(mix.dataset_names)), weights=mix.weights, k=1)[0]
    return [s["name"] for s in specs].index(mix.dataset_names[picked])


def entry_row(mix, specs: list[dict[str, Any]], idx: int, instruction: str = "",
              field: str = "task.datasets") -> dict[str, Any]:
    """The row of the composite's entry `idx`; an entry reasoning-gym cannot generate, or one
    holding a value no row can keep, is a `RowsError` naming the dataset, its config and the fix."""
    try:
        entry = mix[idx]
    except Exception as err:  # noqa: BLE001 - any generator fault, named
        spec_i = _source(mix, specs, idx)
        s = specs[spec_i]
        raise RowsError(f"{field}[{spec_i}] {_described(s)}: reasoning-gym could not generate entry {idx}: "
                        f"{type(err).__name__}: {err}; {_fix(s)}") from err
    try:
        return row(entry, instruction)
    except TypeError as err:
        spec_i = [s["name"] for s in specs].index(entry["metadata"]["source_dataset"])
        raise RowsError(f"{field}[{spec_i}] {_described(specs[spec_i])}: entry {idx}: {err}; the rows cannot "
                        "keep it, so its score_answer could not read it back: drop the entry or report it") from err


# An entry is kept as JSON that keeps what plain JSON loses: a tuple, a set or frozenset, a dict
# with keys other than strings. Plain JSON turned arc_agi's and rearc's `metadata["output"]` (a
# tuple of tuples, which their score_answer compares with the answer parsed as tuples) into lists,
# so a correct answer scored 0.05. Kept rather than regenerated at scoring time because it is
# faithful by construction (the very entry whose question was asked, whatever the dataset's
# generator does in another process: no reliance on every generator being deterministic across
# processes and hash seeds) and cheap (microseconds to decode, where regenerating some entries
# takes half a second or more, inside the per-sample deadline, in every reward worker).
_TAGS = ("__tuple__", "__set__", "__frozenset__", "__dict__")
ROWS_FORMAT = 2  # 1: plain JSON (tuples lost); part of the rows' folder name, so old rows are not reused


def _plain(x: Any, path: str) -> Any:
    """`x` as JSON values, its tuples, sets and non-string-keyed dicts tagged (`_TAGS`)."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, str):  # numpy.str_ and other str subclasses: the same text
        return str(x)
    if type(x) is list:
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if type(x) is tuple:
        return {"__tuple__": [_plain(v, f"{path}[{i}]") for i, v in enumerate(x)]}
    if type(x) in (set, frozenset):
        return {f"__{type(x).__name__}__": [_plain(v, f"{path}{{}}") for v in x]}
    if type(x) is dict:
        if all(type(k) is str for k in x) and not (len(x) == 1 and next(iter(x)) in _TAGS):
            return {k: _plain(v, f"{path}[{k!r}]") for k, v in x.items()}
        return {"__dict__": [[_plain(k, f"{path} key"), _plain(v, f"{path}[{k!r}]")] for k, v in x.items()]}
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        return _plain(x.item(), path)  # a numpy scalar: the Python number (or str) it equals
    raise TypeError(f"{path} is a {type(x).__module__}.{type(x).__qualname__} ({str(x)[:60]!r}), which a row "
                    "(JSON with tuples, sets and dicts kept) cannot hold")


def _tagged(d: dict[str, Any]) -> Any:
    if len(d) == 1:
        (key, value), = d.items()
        if key == "__tuple__":
            return tuple(value)
        if key == "__set__":
            return set(value)
        if key == "__frozenset__":
            return frozenset(value)
        if key == "__dict__":
            return {k: v for k, v in value}
    return d


def encode_entry(entry: dict[str, Any]) -> str:
    """A reasoning-gym entry as the text of a row's `rg_entry`; `decode_entry` gives it back equal,
    tuples as tuples (a value no row can hold is a TypeError naming where it is)."""
    return json.dumps(_plain(entry, "entry"))


def decode_entry(text: str) -> dict[str, Any]:
    """The entry `encode_entry` wrote (rows of the plain-JSON format 1 decode as they were)."""
    return json.loads(text, object_hook=_tagged)


def row(entry: dict[str, Any], instruction: str = "") -> dict[str, Any]:
    """One of our rows for one reasoning-gym entry: the question (then `instruction`, if any) as
    the prompt, its answer, its dataset (for per-dataset evaluation) and the whole entry, which
    `score_answer` reads (`encode_entry`: kept as it was, tuples included)."""
    prompt = f"{entry['question']} {instruction}" if instruction else entry["question"]
    return {"prompt": prompt, "answer": str(entry["answer"]),
            "dataset": entry["metadata"]["source_dataset"], ENTRY: encode_entry(entry)}


def splits(specs: list[dict[str, Any]], size: int, eval_size: int, seed: int,
           instruction: str = "") -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows: one composite of `size + eval_size` entries drawn with `seed`;
    the first `eval_size` (by index) are held out, and a training entry whose question is also
    held out is dropped, so no held-out question is trained on (small datasets repeat questions).
    A dataset reasoning-gym cannot build or generate from is a `RowsError` naming it."""
    mix = _composite(specs, size + eval_size, seed)
    held = [entry_row(mix, specs, i, instruction) for i in range(eval_size)]
    seen = {r["prompt"] for r in held}
    train = [r for r in (entry_row(mix, specs, i, instruction) for i in range(eval_size, eval_size + size))
             if r["prompt"] not in seen]
    return train, held


def data_dir(specs: list[dict[str, Any]], size: int, eval_size: int, seed: int, root: str,
             instruction: str = "") -> str:
    """Where rows for exactly these settings (and this reasoning-gym version and row format) are kept."""
    from importlib.metadata import version

    _gym()
    key = json.dumps([specs, size, eval_size, seed, instruction, version("reasoning-gym"), ROWS_FORMAT],
                     sort_keys=True, default=str)
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
            entry = decode_entry(raw)
            dataset = scorers[entry["metadata"]["source_dataset"]]
            answer = extract(text, extract_answer)
            verdict = call_with_timeout(lambda: dataset.score_answer(answer, entry), {}, sample_timeout_s)
            out.append(float(verdict))
        except RewardCallTimeout:
            out.append(TimeoutError(f"no verdict within {sample_timeout_s:g} s (reasoning-gym's score_answer)"))
        except Exception as err:  # noqa: BLE001 - the sample's error, reported by the scorer
            out.append(err)
    return out


def _perfect(answer: Any, how: str) -> str:
    """A completion that gives `answer` as the run asks for it: between the tags, or (a model
    told to reply with just the number) the answer alone."""
    return f"<answer>{answer}</answer>" if how == "tags" else str(answer)


def asks_for_tags(instruction: str, system_prompt: str) -> bool:
    return "<answer>" in f"{instruction}\n{system_prompt}".lower()


TAGS_PROMPT = ("reasoning-gym's default prompt (reasoning_gym.utils.SYSTEM_PROMPTS['default']; "
               "task=reasoning_gym_tags sets it)")


def extraction_errors(specs: list[dict[str, Any]], how: str, *, instruction: str = "", system_prompt: str = "",
                      where: str = "reward.functions[0].kwargs.extract_answer", field: str = "task.datasets",
                      probes: int = 4, seed: int = 0) -> list[str]:
    """Whether answers read with `how` can score on each dataset, checked on its first `probes`
    entries before any run: a perfect completion (`_perfect`: its gold answer, as the run asks for
    it) must score what reasoning-gym gives that answer, or the run would train on rewards that
    are 0 whatever the model writes. "tags" also needs a prompt that asks for the tags. A dataset
    without a gold answer (its answers are played out, e.g. rubiks_cube) cannot use the last
    number. A dataset reasoning-gym cannot generate from is named (`RowsError`)."""
    errors: list[str] = []
    if how == "tags" and not asks_for_tags(instruction, system_prompt):
        errors.append(f"{where}=tags reads the answer between <answer> and </answer>, but neither task.instruction "
                      f"({instruction!r}) nor task.system_prompt asks for those tags, so a model writes none and every "
                      f"reward is 0: set task.system_prompt to {TAGS_PROMPT} and task.instruction='', or end "
                      "task.instruction with 'Give your answer between <answer> and </answer>.'")
    mix = _composite(specs, probes, seed, field)
    for i, spec in enumerate(specs):
        dataset = mix.datasets[spec["name"]]
        for j in range(probes):
            try:
                entry = dataset[j]
            except Exception as err:  # noqa: BLE001 - a generator fault, named
                raise RowsError(f"{field}[{i}] {_described(spec)}: reasoning-gym could not generate entry {j}: "
                                f"{type(err).__name__}: {err}; {_fix(spec)}") from err
            gold = entry["answer"]
            fix = (f"set {where}=tags with a prompt that asks for the tags (start from task=reasoning_gym_tags: "
                   f"reasoning-gym's default system prompt, task.instruction=''), or drop {spec['name']} from {field}")
            if gold is None:
                if how == "final_answer":
                    errors.append(f"{field}[{i}] {spec['name']}: {where}=final_answer reads a completion's last "
                                  f"number, but {spec['name']} has no gold answer to compare (its score_answer plays "
                                  f"the answer out), and its answers are not numbers: {fix}")
                    break
                continue
            try:
                want = float(dataset.score_answer(gold, entry))
            except Exception:  # noqa: BLE001 - reasoning-gym cannot score its own answer: nothing to compare
                continue
            try:
                got = float(dataset.score_answer(extract(_perfect(gold, how), how), entry))
            except Exception:  # noqa: BLE001 - an error sample, worth no reward
                got = 0.0
            if got < want - 1e-9:
                reads = ("a completion's last number (or \\boxed{})" if how == "final_answer"
                         else "the answer between <answer> tags")
                told = (f", and task.instruction={instruction!r} asks {spec['name']}'s questions for a number"
                        if how == "final_answer" and "number" in instruction.lower() else "")
                errors.append(f"{field}[{i}] {spec['name']}: {where}={how} reads {reads}, so a perfect answer "
                              f"({str(gold)[:60]!r}, entry {j}) scores {got:g} where reasoning-gym gives it "
                              f"{want:g}: every reward would be (near) 0 whatever the model writes{told}; "
                              + (fix if how == "final_answer" else f"drop {spec['name']} from {field}"))
                break
    return errors
