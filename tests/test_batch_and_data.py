"""Building the learner's batch, the prompt order, metric reduction and weight-sync buckets."""

import json

import pytest
import torch

from rl.data.batch import build_train_batch, shard_rows
from rl.data.dataset import DataError, PromptDataset, derive_seed
from rl.data.types import Sample, ScoredSample
from trainer.group import reduce_metrics
from rl.wire.format import WeightMeta, buckets


def _scored(prompt, completion, logprobs, reward=1.0, error=None, group=0, version=0):
    s = Sample(prompt, completion, logprobs, "stop", version, "p", "c", group, 0)
    return ScoredSample(s, None if error else reward, {}, error)


def test_train_batch_alignment_and_masking():
    scored = [
        _scored([5, 6], [7, 8], [-0.1, -0.2]),
        _scored([5], [9], [-0.3], error="boom"),
    ]
    batch = build_train_batch(scored, pad_id=0, version=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # logits at position t predict token t+1: tokens 7, 8 are predicted at positions 1, 2
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2])
    assert batch.rollout_logprobs[1].tolist() == pytest.approx([-0.3, 0, 0])
    assert batch.advantages.abs().sum() == 0  # filled by rl.algo.estimate after the learner scores
    sub = batch.select([1])
    assert sub.input_ids.tolist() == [[5, 9]] and sub.loss_mask.shape == (1, 1)


def test_stale_samples_are_refused():
    with pytest.raises(RuntimeError, match="policy versions"):
        build_train_batch([_scored([1], [2], [-1.0], version=3)], 0, version=4)
    # a failed sample has no tokens to date (an agent that crashed before its first call): a row, no loss
    empty = Sample([], [], [], "stop", 0, "p", "", 1, 0, error="task.agent=m:f: raised")
    batch = build_train_batch([_scored([1], [2], [-1.0], version=4), ScoredSample(empty, None, error=empty.error)],
                              0, version=4)
    assert batch.loss_mask.tolist() == [[1.0], [0.0]] and batch.input_ids.shape == (2, 2)


def test_truncated_completions_can_be_masked():
    s = Sample([5], [7, 8], [-0.1, -0.2], "length", 0, "p", "c", 0, 0)
    scored = [ScoredSample(s, 1.0, {}), _scored([5], [9], [-0.3])]
    assert build_train_batch(scored, 0, 0).loss_mask.tolist() == [[1, 1], [1, 0]]
    assert build_train_batch(scored, 0, 0, mask_truncated=True).loss_mask.tolist() == [[0, 0], [1, 0]]


class _CharTokenizer:
    def __call__(self, text):
        ids = [[ord(c) for c in t] for t in text] if isinstance(text, list) else [ord(c) for c in text]
        return type("Enc", (), {"input_ids": ids})()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    return str(path)


def test_prompt_order_and_seeds_are_functions_of_seed_and_step(prompt_file):
    a = PromptDataset([prompt_file], "prompt", _CharTokenizer(), seed=3, max_prompt_tokens=32)
    b = PromptDataset([prompt_file], "prompt", _CharTokenizer(), seed=3, max_prompt_tokens=32)
    b.requests(5, 4, 2)  # visiting other steps first changes nothing
    ra, rb = a.requests(1, 4, 2), b.requests(1, 4, 2)
    assert [(r.prompt_text, r.seed) for r in ra] == [(r.prompt_text, r.seed) for r in rb]
    assert len(ra) == 8 and ra[0].prompt_text == ra[1].prompt_text and ra[0].seed != ra[1].seed
    assert ra[0].metadata == {"answer": str(int(ra[0].prompt_text.split("+")[0]) + 1)}
    # one epoch (steps 0..1 of 5 prompts... here 10 rows / 5 per step) visits every row once
    seen = [r.prompt_text for s in range(2) for r in a.requests(s, 5, 1)]
    assert sorted(seen) == sorted(f"{i}+1=" for i in range(10))
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2) != derive_seed(0, 1, 3)


def test_prompt_dataset_errors_name_the_field(prompt_file, tmp_path):
    with pytest.raises(ValueError, match="task.prompt_key='question'"):
        PromptDataset([prompt_file], "question", _CharTokenizer(), 0, 32)
    with pytest.raises(FileNotFoundError, match="task.train_files"):
        PromptDataset([str(tmp_path / "missing.jsonl")], "prompt", _CharTokenizer(), 0, 32)
    with pytest.raises(ValueError, match="rollout.max_model_len"):
        PromptDataset([prompt_file], "prompt", _CharTokenizer(), 0, 2).requests(0, 1, 1)
    # every prompt is measured up front, not only those of the first step
    rows = [{"prompt": "1+1=", "answer": "2"}] * 5 + [{"prompt": "123456789+1=", "answer": "x"}]
    long_file = tmp_path / "long.jsonl"
    long_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert PromptDataset([str(long_file)], "prompt", _CharTokenizer(), 0, 32).check_lengths(chunk=4) == 12
    with pytest.raises(DataError, match=r"row 5 \(from 0\).*has 12 tokens.*rollout.max_model_len"):
        PromptDataset([str(long_file)], "prompt", _CharTokenizer(), 0, 8).check_lengths(chunk=4)


_GOOD = '{"prompt": "1+1=", "answer": "2"}'


@pytest.mark.parametrize("text,expected", [
    ("", r"bad.jsonl is empty"),
    ("\n \n", r"bad.jsonl holds no rows"),
    (f'{_GOOD}\n{_GOOD}\n{{"prompt": "2+2=", \n', r"bad.jsonl line 3 is not valid JSON"),
    (f'{_GOOD}\n\n{_GOOD}\n"2+2="\n', r"bad.jsonl line 4 is a string, not a JSON object"),
    (f'{_GOOD}\n{{"prompt": "  ", "answer": "4"}}\n', r"task.prompt_key='prompt': .*bad.jsonl line 2 has an empty"),
    (f'{_GOOD}\n{_GOOD}\n{{"prompt": ["2+2="]}}\n', r"line 3 has \['2\+2='\] \(a list\), not a string"),
    (f'{_GOOD}\n{{"prompt": false}}\n', r"line 2 has False \(a boolean\)"),
    (f'{_GOOD}\n{{"question": "2+2="}}\n', r"line 2 has no 'prompt' column"),
    ('{"question": "2+2="}\n', r"task.prompt_key='prompt' is not a column of .*bad.jsonl.*\['question'\]"),
    (f'[{_GOOD}, {{"prompt": 3}}]', r"bad.jsonl item 1 has 3 \(a number\)"),
    (f'[\n{_GOOD},\n{_GOOD}\n', r"bad.jsonl line 4 is not valid JSON"),
])
def test_every_json_row_is_checked_naming_file_and_line(tmp_path, text, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=expected):
        PromptDataset([str(path)], "prompt", _CharTokenizer(), 0, 32)


def test_json_arrays_and_non_utf8_lines(tmp_path):
    good = tmp_path / "rows.json"
    good.write_text(json.dumps([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)], indent=1))
    assert len(PromptDataset([str(good)], "prompt", _CharTokenizer(), 0, 32)) == 3
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(f"{_GOOD}\n".encode() + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="latin.jsonl line 2 is not UTF-8"):
        PromptDataset([str(latin)], "prompt", _CharTokenizer(), 0, 32)


def test_csv_and_parquet_prompts_are_checked_too(tmp_path):
    import pandas as pd

    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n1+1=,2\n,4\n")
    with pytest.raises(DataError, match=r"task.prompt_key='prompt': row 1 \(from 0\).*has no value"):
        PromptDataset([str(csv)], "prompt", _CharTokenizer(), 0, 32)
    parquet = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}).to_parquet(parquet)
    assert len(PromptDataset([str(parquet)], "prompt", _CharTokenizer(), 0, 32)) == 2
    pd.DataFrame({"prompt": [1, 2]}).to_parquet(parquet)
    with pytest.raises(DataError, match=r"row 0 .* has 1 \(a number\), not a string"):
        PromptDataset([str(parquet)], "prompt", _CharTokenizer(), 0, 32)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"task.train_files: cannot read .*broken.parquet"):
        PromptDataset([str(broken)], "prompt", _CharTokenizer(), 0, 32)


def test_reduce_metrics_means_over_tokens_and_updates():
    ranks = [
        {"_tokens": 10, "_loss_tokens": 10, "_updates": 2, "sync/logprob_abs_diff": 1.0, "actor/loss_nats": 0.4,
         "actor/grad_norm": 6.0, "_max/sync/logprob_max_abs_diff": 0.3},
        {"_tokens": 30, "_loss_tokens": 30, "_updates": 2, "sync/logprob_abs_diff": 3.0, "actor/loss_nats": 0.6,
         "actor/grad_norm": 6.0, "_max/sync/logprob_max_abs_diff": 0.5},
    ]
    out = reduce_metrics(ranks)
    assert out["sync/logprob_abs_diff"] == pytest.approx(0.1)
    assert out["actor/loss_nats"] == pytest.approx(0.5)  # (0.4 + 0.6) over 2 updates
    assert out["actor/grad_norm"] == pytest.approx(3.0)
    assert out["sync/logprob_max_abs_diff"] == 0.5
    assert [r.tolist() for r in shard_rows(5, 2)] == [[0, 2, 4], [1, 3]]


def test_weight_buckets_respect_size_and_dtype():
    metas = [WeightMeta("a", (4,), "float32"), WeightMeta("b", (4,), "float32"),
             WeightMeta("c", (2,), "bfloat16"), WeightMeta("d", (8,), "float32")]
    assert buckets(metas, limit=32) == [[0, 1], [2], [3]]
    assert buckets(metas, limit=16) == [[0], [1], [2], [3]]


def test_a_system_prompt_comes_before_every_chat_prompt(prompt_file):
    """task.system_prompt: the chat template renders it as the first message of every prompt."""
    from examples.tiny import build_tokenizer

    tok = build_tokenizer(["What is 1+2? Be brief."], chat=True, model_max_length=256)
    with_system = PromptDataset([prompt_file], "prompt", tok, seed=0, max_prompt_tokens=200, chat_template=True,
                                system_prompt="Be brief.")
    plain = PromptDataset([prompt_file], "prompt", tok, seed=0, max_prompt_tokens=200, chat_template=True)
    [ids], [bare] = with_system.encode(["What is 1+2?"]), plain.encode(["What is 1+2?"])
    assert ids == tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What is 1+2?"}],
                                          add_generation_prompt=True, tokenize=True)["input_ids"]
    system, user = tok.convert_tokens_to_ids(["<|system|>", "<|user|>"])
    assert system not in bare and ids.index(system) < ids.index(user)
    assert ids[ids.index(user):] == bare[bare.index(user):]  # the user turn as without it
