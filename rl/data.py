"""Training data: `datasets` tables read from local files and checked for their columns, and the
RL prompts visited in a seeded order.

The prompts of step s are a pure function of (seed, s), so a resumed run sees exactly the
prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from rl.types import GenerationRequest

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def derive_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (run seed, step, index...), independent of global RNG state."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def load_table(files: list[str], field_name: str = "task.train_files"):
    import datasets

    if not files:
        raise ValueError(f"{field_name} is empty: give at least one .jsonl/.json/.parquet/.csv file")
    kinds = set()
    for f in files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"{field_name}: {f} does not exist (paths are relative to the launch directory)")
        ext = os.path.splitext(f)[1]
        if ext not in _FORMATS:
            raise ValueError(f"{field_name}: {f} has extension {ext!r}; use one of {', '.join(_FORMATS)}")
        kinds.add(_FORMATS[ext])
    if len(kinds) != 1:
        raise ValueError(f"{field_name}: mixes file formats {sorted(kinds)}; use one format")
    return datasets.load_dataset(kinds.pop(), data_files=list(files), split="train")


class DataError(ValueError):
    """Training data that cannot be used (missing file or column, no rows); names the config key."""


class MissingDataFile(DataError, FileNotFoundError):
    """A data file that does not exist (a DataError, and a FileNotFoundError like any other)."""


def load_columns(files: list[str], columns: dict[str, str | None], field: str, *, optional: tuple[str, ...] = ()):
    """A `datasets` table from local jsonl/json/parquet/csv files, checked for its columns.

    `columns` maps config keys (e.g. "data.chosen_key") to the column each names; a missing one
    is a DataError naming the column, the key to change and the columns that exist. Keys in
    `optional` may name no column (None).
    """
    try:
        table = load_table(list(files), field_name=field)
    except FileNotFoundError as err:
        raise MissingDataFile(str(err)) from None
    except ValueError as err:
        raise DataError(str(err)) from None
    for key, column in columns.items():
        if key in optional and column is None:
            continue
        if column not in table.column_names:
            raise DataError(
                f"{key}={column!r} is not a column of {field}={list(files)}; columns are "
                f"{table.column_names}; set {key} to the right column"
            )
    if len(table) == 0:
        raise DataError(f"{field}={list(files)} holds no rows")
    return table


def split_table(train, test_files: list[str], test_fraction: float, seed: int, load_test: Callable[[], Any]):
    """The (train, test) tables: test from its own files, else `test_fraction` of train held out
    (seeded), else no test set (None)."""
    if test_files:
        return train, load_test()
    if test_fraction > 0:
        parts = train.train_test_split(test_size=test_fraction, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    return train, None


def load_encoded(data: Any, seed: int, columns: dict[str, str | None], encode: Callable[[Any], Any],
                 length: Callable[[Any], int], *, optional: tuple[str, ...] = (), noun: str = "row"):
    """The supervised trainers' data: the train and test rows of a config's `data` section
    (`data.train_files`; `data.test_files`, else `data.test_fraction` of train held out), checked
    for `columns`, each turned into an example by `encode(row)`. Examples longer than
    `data.max_length` tokens (`length(example)`) are dropped and counted. A row `encode` rejects
    (ValueError, TypeError) is a DataError naming its file and index, and so is a training set
    with nothing left. Returns (train, test or None, dropped)."""
    d = data
    train = load_columns(d.train_files, columns, "data.train_files", optional=optional)
    train, test = split_table(train, list(d.test_files), d.test_fraction, seed,
                              lambda: load_columns(d.test_files, columns, "data.test_files", optional=optional))
    dropped = 0

    def encode_all(table, files: list[str]) -> list[Any]:
        nonlocal dropped
        out = []
        for i, row in enumerate(table):
            try:
                example = encode(row)
            except (ValueError, TypeError) as err:
                raise DataError(f"row {i} of {list(files)}: {err}") from None
            if length(example) > d.max_length:
                dropped += 1
                continue
            out.append(example)
        return out

    train_examples = encode_all(train, d.train_files)
    if not train_examples:
        raise DataError(f"every training {noun} is longer than data.max_length={d.max_length} tokens; raise it")
    return train_examples, encode_all(test, d.test_files or d.train_files) if test is not None else None, dropped


class PromptDataset:
    def __init__(self, files: list[str], prompt_key: str, tokenizer: Any, seed: int, max_prompt_tokens: int):
        self.table = load_columns(files, {"task.prompt_key": prompt_key}, "task.train_files")
        self.prompt_key, self.tokenizer, self.seed = prompt_key, tokenizer, seed
        self.max_prompt_tokens = max_prompt_tokens
        self._perm_epoch, self._perm = -1, np.arange(0)

    def __len__(self) -> int:
        return len(self.table)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(derive_seed(self.seed, epoch)).permutation(len(self))
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def requests(self, step: int, prompts_per_step: int, n: int, round: int = 0) -> list[GenerationRequest]:
        """`prompts_per_step` prompts, each repeated `n` times with its own sampling seed.

        Round 0 walks the seeded epoch permutation; a later `round` of the same step (DAPO's
        refill) draws prompts at random from a stream of its own, with group ids after those
        of earlier rounds, so seeds and groups never repeat within a step."""
        out = []
        extra = None if round == 0 else np.random.default_rng(derive_seed(self.seed, step, round, 7))
        for i in range(prompts_per_step):
            group = round * prompts_per_step + i
            index = self._index(step * prompts_per_step + i) if extra is None else int(extra.integers(len(self)))
            row = self.table[index]
            text = row[self.prompt_key]
            ids = self.tokenizer(text).input_ids
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"a prompt has {len(ids)} tokens but rollout.max_model_len - rollout.max_new_tokens = "
                    f"{self.max_prompt_tokens}; raise rollout.max_model_len or shorten the prompts"
                )
            metadata = {k: v for k, v in row.items() if k != self.prompt_key}
            out.extend(
                GenerationRequest(ids, text, group, k, derive_seed(self.seed, step, group, k), metadata)
                for k in range(n)
            )
        return out
