"""Training data: `datasets` tables read from local files, globs of shards, `save_to_disk` folders
or Hub datasets, checked for their columns, and the RL prompts visited in a seeded order.

An entry of a files list (`task.train_files`, `eval.files`, `data.train_files`...) is, in order:
a local .jsonl/.json/.parquet/.csv file; a glob of them (`data/train-*.parquet`); a folder that
`Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote; else a Hub dataset
`org/name[@revision][:config][:split]` (the split defaults to "train", "test" for evaluation
files), whose snapshot `huggingface_hub` finds in (or downloads into) the standard cache, read
with `datasets` from that folder: offline (`HF_HUB_OFFLINE=1`) a cached one works. Every entry's
table is concatenated in order.

The prompts of step s are a pure function of (seed, s), so a resumed run sees exactly the
prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from typing import Any, Callable, Iterator

import numpy as np

from rl.data.hub import bounded_waits, hub_failure, transport_errors
from rl.data.types import GenerationRequest

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def derive_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (run seed, step, index...), independent of global RNG state."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


class DataError(ValueError):
    """Training data that cannot be used (missing file or column, no rows); names the config key."""


class MissingDataFile(DataError, FileNotFoundError):
    """A data file that does not exist (a DataError, and a FileNotFoundError like any other)."""


_EXAMPLE_ROW = '{"prompt": "12+30=", "answer": "42"}'
_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
               type(None): "null"}


def data_format(files: list[str], field: str) -> str:
    """The one `datasets` loader the files need ("json", "parquet" or "csv"); every file must exist."""
    if not files:
        raise DataError(f"{field} is empty: give at least one .jsonl/.json/.parquet/.csv file")
    kinds = set()
    for f in files:
        if not os.path.exists(f):
            raise MissingDataFile(f"{field}: {f} does not exist (paths are relative to the launch directory)")
        ext = os.path.splitext(f)[1]
        if ext not in _FORMATS:
            raise DataError(f"{field}: {f} has extension {ext!r}; use one of {', '.join(_FORMATS)}")
        if os.path.getsize(f) == 0:
            raise DataError(f"{field}: {f} is empty; give it rows or leave it out of {field}")
        kinds.add(_FORMATS[ext])
    if len(kinds) != 1:
        raise DataError(f"{field}: mixes file formats {sorted(kinds)}; use one format")
    return kinds.pop()


def _json_error(field: str, path: str, line: int, err: Exception) -> DataError:
    return DataError(f"{field}: {path} line {line} is not valid JSON ({err}); fix or delete that line: each line "
                     f"must be one JSON object, e.g. {_EXAMPLE_ROW}")


def json_rows(path: str, field: str) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row of a .json/.jsonl file: JSON Lines (one object per line, blank lines
    skipped; where = "line N") or one JSON array (where = "item N"). A line that is not JSON, not
    UTF-8 or not an object is a DataError naming the file, the line and the fix."""
    with open(path, "rb") as f:
        array = f.read(1024).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    if array:
        try:
            with open(path, encoding="utf-8-sig") as f:
                items = json.load(f)
        except json.JSONDecodeError as err:
            raise _json_error(field, path, err.lineno, f"{err.msg} at column {err.colno}") from None
        except UnicodeDecodeError as err:
            raise DataError(f"{field}: {path} is not UTF-8 text ({err.reason}); save it as UTF-8") from None
        numbered = ((f"item {i}", row) for i, row in enumerate(items if isinstance(items, list) else [items]))
    else:
        numbered = _json_lines(path, field)
    for where, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{field}: {path} {where} is {_JSON_TYPES.get(type(row), 'a string')}, not a JSON "
                            f"object; each row must be an object of columns, e.g. {_EXAMPLE_ROW}")
        yield where, row


def _json_lines(path: str, field: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{field}: {path} line {number} is not UTF-8 text ({err.reason}); "
                                "save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                yield f"line {number}", json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise _json_error(field, path, number, f"{err.msg} at column {err.colno}") from None


def text_problem(value: Any) -> str | None:
    """Why `value` is not a usable text (a non-empty string), or None when it is one."""
    if isinstance(value, str):
        return None if value.strip() else f"an empty string {value!r}"
    if value is None or (isinstance(value, float) and value != value):  # JSON null, a blank CSV cell
        return "no value"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{shown} ({_JSON_TYPES.get(type(value), type(value).__name__)}), not a string"


def _bad_text(key: str, column: str, where: str, problem: str) -> DataError:
    return DataError(f"{key}={column!r}: {where} has {problem}; every row needs a non-empty string in column "
                     f"{column!r}: fix or delete that row (or set {key} to the column that holds the text)")


def check_json_file(path: str, field: str, texts: dict[str, str]) -> None:
    """Read every row of a JSON file: it must have rows, each a JSON object, and for each config key
    of `texts` (e.g. "task.prompt_key") its column must hold a non-empty string in every row.
    The first problem is a DataError naming the file, the line and the fix."""
    columns: dict[str, None] = {}
    first_bad: dict[str, tuple[str, str]] = {}  # key -> (where, problem): the first row that fails it
    rows = 0
    for where, row in json_rows(path, field):
        rows += 1
        columns.update(dict.fromkeys(row))
        for key, column in texts.items():
            if key not in first_bad:
                problem = text_problem(row[column]) if column in row else f"no {column!r} column"
                if problem:
                    first_bad[key] = (where, problem)
    if rows == 0:
        raise DataError(f"{field}: {path} holds no rows (only blank lines); give it rows or leave it out of {field}")
    for key, column in texts.items():
        if column not in columns:
            raise DataError(f"{key}={column!r} is not a column of {path} ({field}); its columns are "
                            f"{list(columns)}; set {key} to the right column")
        if key in first_bad:
            where, problem = first_bad[key]
            raise _bad_text(key, column, f"{path} {where}", problem)


def default_split(field: str) -> str:
    """The split a Hub dataset entry without one means: evaluation and test files read "test"."""
    return "test" if field in ("eval.files", "data.test_files") else "train"


def _globbed(entry: str) -> list[str] | None:
    """The files a glob entry names (sorted), or None when `entry` is no glob."""
    return sorted(glob.glob(os.path.expanduser(entry))) if glob.has_magic(entry) else None


def is_saved_dataset(path: str) -> bool:
    """A folder `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json) wrote."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def hub_dataset(entry: str) -> tuple[str, str, str | None, str | None] | None:
    """`org/name[@revision][:config][:split]` -> (repo id, revision, config, split), or None when
    `entry` is a local path, a glob or not shaped like a Hub dataset."""
    if os.path.exists(entry) or glob.has_magic(entry) or entry.startswith((".", "/", "~")):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, *rest = entry.split(":")
    if len(rest) > 2:
        return None
    repo_id, _, revision = repo.partition("@")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    if os.path.splitext(repo_id)[1] in _FORMATS:  # data/train.jsonl that does not exist: a missing file
        return None
    config, split = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0] if rest else None)
    return repo_id, revision, config or None, split or None


def _load_hub_dataset(entry: str, field: str):
    """One Hub dataset entry's split, read from its snapshot in the Hugging Face cache."""
    import datasets
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo_id, revision, config, split = hub_dataset(entry)
    split = split or default_split(field)
    bounded_waits()
    try:
        folder = snapshot_download(repo_id, repo_type="dataset", revision=revision or None)
    except RevisionNotFoundError:
        raise DataError(f"{field}: the Hub dataset {repo_id} has no revision {revision!r}") from None
    except (GatedRepoError, RepositoryNotFoundError):
        raise DataError(f"{field}: {entry!r} is neither a local file nor a Hub dataset this machine can see (a "
                        "private or gated one needs `hf auth login` or HF_TOKEN); give a .jsonl/.json/.parquet/.csv "
                        "file, a glob of them, a save_to_disk folder or org/name[:config][:split]") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached from here"
        raise DataError(f"{field}: {entry!r} is not a local file, and the Hub dataset {repo_id} is not in the Hugging "
                        f"Face cache ({constants.HF_HUB_CACHE}) while {why}; download it where there is network "
                        f"(`hf download {repo_id} --repo-type dataset`), or give local files") from None
    except transport_errors() as err:
        raise DataError(f"{field}: {entry!r}: {hub_failure(err)}") from None
    try:
        return datasets.load_dataset(folder, config, split=split)
    except ValueError as err:  # an unknown split or config: datasets names the ones there are
        detail = " ".join(str(err).split())
        raise DataError(f"{field}: {entry!r}: {detail}; write it as {repo_id}[:config][:split]") from None


def _load_saved(path: str, field: str):
    """A save_to_disk folder: a Dataset, or the field's split of a DatasetDict."""
    import datasets

    table = datasets.load_from_disk(path)
    if isinstance(table, datasets.DatasetDict):
        split = default_split(field)
        if split not in table:
            raise DataError(f"{field}: {path} is a DatasetDict without a {split!r} split (it has {list(table)}); "
                            f"save that split alone (table[name].save_to_disk) and name its folder")
        table = table[split]
    return table


def is_local_entry(entry: str) -> bool:
    """A local file (existing or not: a missing one is reported as such) or a glob of them."""
    return glob.has_magic(entry) or (not is_saved_dataset(entry) and hub_dataset(entry) is None)


def local_files(files: list[str], field: str) -> list[str]:
    """The local entries' files, globs expanded in sorted order (a glob matching nothing is an error)."""
    out = []
    for entry in filter(is_local_entry, files):
        matched = _globbed(entry)
        if matched is not None and not matched:
            raise MissingDataFile(f"{field}: {entry} matches no file (paths are relative to the launch directory)")
        out += [entry] if matched is None else matched
    return out


def _root_cause(err: BaseException) -> BaseException:
    """The innermost exception of a chain (`datasets` wraps the reader's own error)."""
    for _ in range(20):
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None:
            break
        err = inner
    return err


def load_table(files: list[str], field_name: str = "task.train_files", texts: dict[str, str] | None = None):
    """A `datasets` table of the entries of `files` (the module's docstring says which kinds), in
    order. JSON files are read row by row first (`check_json_file`), so a malformed line or an
    empty file is reported with its file and line, never as a `datasets`/pyarrow traceback; any
    other problem reading the files is a DataError naming them."""
    if not files:
        raise DataError(f"{field_name} is empty: give at least one .jsonl/.json/.parquet/.csv file")
    import datasets

    tables = []
    for local, run in itertools.groupby(files, key=is_local_entry):  # a run of local files loads together
        if local:
            tables.append(_load_local(local_files(list(run), field_name), field_name, texts))
        else:
            tables += [_load_saved(entry, field_name) if is_saved_dataset(entry) else
                       _load_hub_dataset(entry, field_name) for entry in run]
    if len(tables) == 1:
        return tables[0]
    try:
        return datasets.concatenate_datasets(tables)
    except ValueError as err:
        raise DataError(f"{field_name}: its entries do not have the same columns, so they cannot be read as one "
                        f"table ({' '.join(str(err).split())[:200]}); give entries with the same columns") from None


def _load_local(files: list[str], field_name: str, texts: dict[str, str] | None):
    kind = data_format(files, field_name)
    if kind == "json":
        for path in files:
            check_json_file(path, field_name, texts or {})
    import datasets

    try:
        return datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as err:  # datasets and pyarrow have many error types for "this file cannot be read"
        cause = _root_cause(err)
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise DataError(f"{field_name}: cannot read {files} as {kind} ({type(cause).__name__}: {detail}); "
                        "check the files are valid and hold one row per record") from None


def load_columns(files: list[str], columns: dict[str, str | None], field: str, *, optional: tuple[str, ...] = (),
                 texts: tuple[str, ...] = ()):
    """A `datasets` table from local jsonl/json/parquet/csv files, checked for its columns.

    `columns` maps config keys (e.g. "data.chosen_key") to the column each names; a missing one
    is a DataError naming the column, the key to change and the columns that exist. Keys in
    `optional` may name no column (None). The columns of the keys in `texts` must hold a non-empty
    string in every row (checked over the whole of every file, with the file and line at fault).
    """
    wanted = {key: columns[key] for key in texts if columns[key] is not None}
    table = load_table(list(files), field_name=field, texts=wanted)
    if len(table) == 0:
        raise DataError(f"{field}={list(files)} holds no rows")
    for key, column in columns.items():
        if key in optional and column is None:
            continue
        if column not in table.column_names:
            raise DataError(
                f"{key}={column!r} is not a column of {field}={list(files)}; columns are "
                f"{table.column_names}; set {key} to the right column"
            )
    json_checked = all(map(is_local_entry, files)) and all(  # line by line, in load_table
        _FORMATS.get(os.path.splitext(f)[1]) == "json" for f in local_files(list(files), field))
    for key, column in {} if json_checked else wanted.items():
        for i, value in enumerate(table[column]):
            problem = text_problem(value)
            if problem:
                raise _bad_text(key, column, f"row {i} (from 0) of {list(files)}", problem)
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
    """The RL prompts: every row of `files` is read and checked at construction (`load_columns`); the
    `tokenizer` may be set after (`.tokenizer`), before `check_lengths` or `requests`."""

    def __init__(self, files: list[str], prompt_key: str, tokenizer: Any, seed: int, max_prompt_tokens: int,
                 chat_template: bool = False, field: str = "task.train_files", system_prompt: str = ""):
        self.table = load_columns(files, {"task.prompt_key": prompt_key}, field, texts=("task.prompt_key",))
        self.files = list(files)
        self.prompt_key, self.tokenizer, self.seed = prompt_key, tokenizer, seed
        self.max_prompt_tokens, self.chat_template, self.field = max_prompt_tokens, chat_template, field
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._perm_epoch, self._perm = -1, np.arange(0)
        self.curriculum = None  # rl.data.curriculum.Curriculum (task.curriculum_epochs > 0): draws round 0

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Prompt ids: the text as it is, or (task.chat_template) as a user message through the
        tokenizer's chat template with the generation prompt, after the system prompt if any."""
        if not self.chat_template:
            return [list(ids) for ids in self.tokenizer(texts).input_ids]
        out = []
        for text in texts:
            ids = self.tokenizer.apply_chat_template([*self.system, {"role": "user", "content": text}],
                                                     add_generation_prompt=True,
                                                     tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    def __len__(self) -> int:
        return len(self.table)

    def _too_long(self, tokens: int, where: str) -> DataError:
        return DataError(
            f"{where} has {tokens} tokens but rollout.max_model_len - rollout.max_new_tokens = "
            f"{self.max_prompt_tokens}; raise rollout.max_model_len or shorten the prompts"
        )

    def check_lengths(self, chunk: int = 1024, embedding_rows: int | None = None) -> int:
        """Tokenize every prompt once (before anything starts): one longer than the prompt budget
        is a DataError naming its row, and so is one with a token id past `embedding_rows` (a
        tokenizer with tokens added after the model was saved, its embedding never resized).
        Returns the longest prompt's length in tokens."""
        longest = 0
        for start in range(0, len(self), chunk):
            texts = self.table[start:start + chunk][self.prompt_key]
            for i, ids in enumerate(self.encode(texts)):
                shown = texts[i] if len(texts[i]) <= 60 else texts[i][:57] + "..."
                where = f"the prompt of row {start + i} (from 0) of {self.field}, {shown!r},"
                if len(ids) > self.max_prompt_tokens:
                    raise self._too_long(len(ids), where)
                if embedding_rows is not None and ids and max(ids) >= embedding_rows:
                    token = max(ids)
                    raise DataError(
                        f"{where} has token id {token} ({self.tokenizer.convert_ids_to_tokens(token)!r}) but the "
                        f"model's embedding has {embedding_rows} rows (vocab_size in model.path's config.json): the "
                        "tokenizer holds tokens the model was never given; resize the model's embeddings "
                        "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the "
                        "tokenizer it was trained with")
                longest = max(longest, len(ids))
        return longest

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(derive_seed(self.seed, epoch)).permutation(len(self))
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def requests(self, step: int, prompts_per_step: int, n: int, sampling_round: int = 0) -> list[GenerationRequest]:
        """`prompts_per_step` prompts, each repeated `n` times with its own sampling seed.

        Round 0 walks the seeded epoch permutation (with a curriculum, from its cursor, passing over
        resting prompts); a later `sampling_round` of the same step (DAPO's refill) draws prompts at random
        from a stream of its own, with group ids after those of earlier rounds, so seeds and groups
        never repeat within a step."""
        out = []
        groups = [sampling_round * prompts_per_step + i for i in range(prompts_per_step)]
        if sampling_round > 0:
            extra = np.random.default_rng(derive_seed(self.seed, step, sampling_round, 7))
            indices = [int(extra.integers(len(self))) for _ in groups]
        elif self.curriculum is not None:
            indices = self.curriculum.draw(prompts_per_step, self._index, groups)
        else:
            indices = [self._index(step * prompts_per_step + i) for i in range(prompts_per_step)]
        for group, index in zip(groups, indices):
            out.extend(self._group(index, group, n, lambda k, group=group: derive_seed(self.seed, step, group, k)))
        return out

    def _group(self, index: int, group: int, n: int, seed: Callable[[int], int],
               temperature: float | None = None) -> list[GenerationRequest]:
        row = self.table[index]
        text = row[self.prompt_key]
        (ids,) = self.encode([text])
        if len(ids) > self.max_prompt_tokens:
            raise self._too_long(len(ids), f"the prompt of row {index} (from 0) of {self.field}")
        metadata = {k: v for k, v in row.items() if k != self.prompt_key}
        return [GenerationRequest(ids, text, group, k, seed(k), metadata, temperature=temperature) for k in range(n)]

    def eval_requests(self, rows: int, n: int, temperature: float | None, seed: int) -> list[GenerationRequest]:
        """The first `rows` rows in file order, `n` requests each (group id = row), seeded by `seed`
        alone: every evaluation of a run asks the same questions with the same seeds."""
        return [r for i in range(min(rows, len(self)))
                for r in self._group(i, i, n, lambda k, i=i: derive_seed(self.seed, seed, i, k), temperature)]
