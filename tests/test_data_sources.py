"""Every kind of data entry (rl/data/dataset.py): Hub datasets from a Hugging Face cache laid out on
disk (offline, through huggingface_hub and datasets' real code), globs of shards, save_to_disk
folders, and local files mixed with them."""

from __future__ import annotations

import json

import pytest

from rl.data.dataset import DataError, MissingDataFile, PromptDataset, hub_dataset, load_columns
from tests.hub_cache import add_snapshot, offline_cache

COLUMNS = {"task.prompt_key": "question"}


def _parquet(path, questions):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question": questions, "answer": [str(len(q)) for q in questions]}), path)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """`org/gsm` (config `main`: train 2 rows, test 1 row) as the Hub writes a dataset repo, cached offline."""
    src = tmp_path / "src"
    _parquet(src / "main" / "train-00000-of-00001.parquet", ["1+1", "2+2"])
    _parquet(src / "main" / "test-00000-of-00001.parquet", ["3+3"])
    (src / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                   "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n")
    add_snapshot(tmp_path / "hub", "org/gsm", src, "d" * 40, refs=("main", "v1"), kind="datasets")
    offline_cache(monkeypatch, tmp_path / "hub")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("entry, parsed", [
    ("org/gsm:main:train", ("org/gsm", "", "main", "train")),
    ("org/gsm:test", ("org/gsm", "", None, "test")),
    ("org/gsm", ("org/gsm", "", None, None)),
    ("org/gsm@v1:main:train", ("org/gsm", "v1", "main", "train")),
    ("data/train.jsonl", None),  # a missing local file stays a missing file
    ("data/shard-*.parquet", None), ("/abs/x", None), ("a/b/c", None), ("org/gsm:a:b:c", None),
])
def test_which_entries_are_hub_datasets(entry, parsed):
    assert hub_dataset(entry) == parsed


def test_a_hub_dataset_in_the_cache_is_read_by_config_and_split(hub):
    train = load_columns(["org/gsm:main:train"], COLUMNS, "task.train_files")
    assert train["question"] == ["1+1", "2+2"]
    assert load_columns(["org/gsm@v1:main:test"], COLUMNS, "eval.files")["question"] == ["3+3"]
    assert load_columns(["org/gsm"], COLUMNS, "eval.files")["question"] == ["3+3"]  # its one config; eval: "test"
    data = PromptDataset(["org/gsm:main:train"], "question", None, 0, 64)
    assert len(data) == 2 and set(data.table.column_names) == {"question", "answer"}


def test_local_files_and_a_hub_dataset_are_one_table_in_order(hub):
    (hub / "extra.jsonl").write_text(json.dumps({"question": "9+9", "answer": "18"}) + "\n")
    table = load_columns(["extra.jsonl", "org/gsm:main:train"], COLUMNS, "task.train_files")
    assert table["question"] == ["9+9", "1+1", "2+2"]
    (hub / "other.jsonl").write_text(json.dumps({"prompt": "9+9"}) + "\n")
    with pytest.raises(DataError, match=r"task.prompt_key='prompt': row 1 \(from 0\) of \['other.jsonl', "
                                        r"'org/gsm:main:train'\] has no value"):  # columns filled with nulls
        load_columns(["other.jsonl", "org/gsm:main:train"], {"task.prompt_key": "prompt"}, "task.train_files",
                     texts=("task.prompt_key",))


def test_a_glob_of_shards_reads_every_shard_in_order(hub):
    _parquet(hub / "shards" / "train-00001.parquet", ["c"])
    _parquet(hub / "shards" / "train-00000.parquet", ["a", "b"])
    assert load_columns(["shards/train-*.parquet"], COLUMNS, "task.train_files")["question"] == ["a", "b", "c"]
    with pytest.raises(MissingDataFile, match=r"task.train_files: nothing/\*.parquet matches no file"):
        load_columns(["nothing/*.parquet"], COLUMNS, "task.train_files")


def test_save_to_disk_folders_a_dataset_or_the_split_of_a_dataset_dict(hub):
    import datasets

    rows = datasets.Dataset.from_dict({"question": ["x", "y"], "answer": ["1", "2"]})
    rows.save_to_disk(str(hub / "saved"))
    datasets.DatasetDict({"train": rows, "test": rows.select([1])}).save_to_disk(str(hub / "saved_dict"))
    assert load_columns(["saved"], COLUMNS, "task.train_files")["question"] == ["x", "y"]
    assert load_columns(["saved_dict"], COLUMNS, "eval.files")["question"] == ["y"]
    datasets.DatasetDict({"validation": rows}).save_to_disk(str(hub / "no_train"))
    with pytest.raises(DataError, match=r"no_train is a DatasetDict without a 'train' split \(it has \['validation'\]\)"):
        load_columns(["no_train"], COLUMNS, "task.train_files")


@pytest.mark.parametrize("entry, columns, message", [
    ("org/missing:train", COLUMNS, r"task.train_files: 'org/missing:train' is not a local file, and the Hub dataset "
                                   r"org/missing is not in the Hugging Face cache \(.*hub\) while HF_HUB_OFFLINE is set"),
    ("org/gsm:main:validation", COLUMNS, r"task.train_files: 'org/gsm:main:validation': Unknown split \"validation\".*"
                                         r"\['train', 'test'\]"),
    ("org/gsm:nope:train", COLUMNS, r"BuilderConfig 'nope' not found. Available: \['main'\]"),
    ("org/gsm:main:train", {"task.prompt_key": "prompt"}, r"task.prompt_key='prompt' is not a column of "
                                                          r"task.train_files=\['org/gsm:main:train'\]; columns are "
                                                          r"\['question', 'answer'\]"),
])
def test_a_bad_hub_dataset_entry_names_the_field_and_the_fix(hub, entry, columns, message):
    with pytest.raises(DataError, match=message):
        load_columns([entry], columns, "task.train_files")


def test_paths_are_made_absolute_but_hub_datasets_are_left_as_named(hub):
    from launch.checks import resolve_paths
    from rl.config.compose import compose

    cfg = compose("train", ["task.train_files=[org/gsm:main:train,local.jsonl]"])
    resolve_paths(cfg)
    assert cfg.task.train_files == ["org/gsm:main:train", str(hub / "local.jsonl")]
