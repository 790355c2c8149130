"""Unit tests for the built-in tiny task, tokenizer, SFT warm-up and `prepare_tiny` (CPU, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.arith import build as prepare_tiny
from examples.arith import expected_accuracy
from examples.tiny import build_model, build_tokenizer
from examples.arith import addition_corpus, addition_splits
from trainer.sft import (
    IGNORE_INDEX,
    build_example,
    collate_right_padded,
    completion_loss,
    sequence_logprobs,
    sft_train,
    tokenize_pair,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and two spin badly when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(addition_corpus())


def _tiny_model(tokenizer, seed: int = 0):
    return build_model(tokenizer, seed, hidden=64, layers=1, heads=2)


def test_addition_splits_are_deterministic_disjoint_and_correct() -> None:
    train, test = addition_splits(300, 50, seed=3)
    again, _ = addition_splits(300, 50, seed=3)
    assert train == again
    assert addition_splits(300, 50, seed=4)[0] != train
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    for p in train + test:
        a, b = p.prompt.rstrip("=").split("+")
        assert p.prompt.endswith("=") and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert p.answer == str(int(a) + int(b))
    with pytest.raises(ValueError, match="n_train"):
        addition_splits(8000, 200)


def test_tokenizer_round_trips_and_digits_are_single_tokens(tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded("37+25=").input_ids
    assert ids == tokenizer("37+25=").input_ids
    assert loaded.convert_ids_to_tokens(ids) == ["<bos>", "3", "7", "+", "2", "5", "="]
    assert ids[0] == loaded.bos_token_id and loaded.eos_token_id not in ids  # BOS yes, EOS never
    assert loaded.decode(ids, skip_special_tokens=True) == "37+25="
    assert loaded.decode(loaded("162", add_special_tokens=False).input_ids + [loaded.eos_token_id],
                         skip_special_tokens=True) == "162"
    for d in "0123456789":
        assert len(loaded(d, add_special_tokens=False).input_ids) == 1
    assert len({loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id, loaded.unk_token_id}) == 4


def test_build_example_and_collate_mask_the_prompt() -> None:
    ids, labels = build_example([1, 10, 11], [12, 2])
    assert ids == [1, 10, 11, 12, 2]
    assert labels == [IGNORE_INDEX] * 3 + [12, 2]
    batch = collate_right_padded([(ids, labels), build_example([1, 10], [2])], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 2], [1, 10, 2, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 12, 2], [-100, -100, 2, -100, -100]]


def test_tokenize_pair_appends_eos_to_completion_only(tokenizer) -> None:
    prompt_ids, completion_ids = tokenize_pair(tokenizer, "37+25=", "62")
    assert prompt_ids == tokenizer("37+25=").input_ids
    assert completion_ids == tokenizer("62", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def test_completion_loss_ignores_prompt_positions() -> None:
    vocab = 5
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 3, 4]])
    logits = torch.randn(1, 5, vocab, generator=torch.Generator().manual_seed(0))
    # Targets at positions 3 and 4 are predicted from logits at positions 2 and 3.
    expected = -(logits[0, 2].log_softmax(-1)[3] + logits[0, 3].log_softmax(-1)[4]) / 2
    assert torch.allclose(completion_loss(logits, labels), expected)
    scrambled = logits.clone()
    scrambled[0, :2] = 100.0 * torch.randn(2, vocab)  # prompt-only positions
    scrambled[0, 4] = -7.0  # the last position predicts nothing
    assert torch.allclose(completion_loss(scrambled, labels), expected)


def test_sft_train_lowers_loss_and_is_deterministic(tokenizer) -> None:
    train, _ = addition_splits(32, 0, seed=1)
    prompts, answers = [p.prompt for p in train], [p.answer for p in train]
    torch.manual_seed(123)  # global state must not matter
    losses = sft_train(_tiny_model(tokenizer), tokenizer, prompts, answers,
                       steps=40, batch_size=16, lr=3e-3, seed=5, log_every=0)
    torch.manual_seed(999)
    again = sft_train(_tiny_model(tokenizer), tokenizer, prompts, answers,
                      steps=40, batch_size=16, lr=3e-3, seed=5, log_every=0)
    assert len(losses) == 40
    assert losses == again
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]


def test_sft_train_stop_fn_ends_early(tokenizer) -> None:
    seen: list[int] = []

    def stop(done: int) -> bool:
        seen.append(done)
        return done == 3

    losses = sft_train(_tiny_model(tokenizer), tokenizer, ["1+2="], ["3"],
                       steps=10, batch_size=4, seed=0, log_every=0, stop_fn=stop)
    assert len(losses) == 3 and seen == [1, 2, 3]


def test_sequence_logprobs_match_a_manual_forward(tokenizer) -> None:
    model = _tiny_model(tokenizer)
    got = sequence_logprobs(model, tokenizer, ["37+25=", "1+2="], ["62", "3"])
    for value, (p, c) in zip(got.tolist(), [("37+25=", "62"), ("1+2=", "3")]):
        prompt_ids, completion_ids = tokenize_pair(tokenizer, p, c)
        ids = torch.tensor([prompt_ids + completion_ids])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].log_softmax(-1)
        manual = sum(float(logp[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(completion_ids))
        assert value == pytest.approx(manual, abs=1e-4)
    assert 0.0 <= expected_accuracy(model, tokenizer, addition_splits(8, 0)[0]) <= 1.0


def test_prepare_tiny_writes_loadable_model_tokenizer_and_data(tmp_path: Path) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = prepare_tiny(
        str(tmp_path), seed=0, n_train=200, n_test=40, n_eval=16, steps=15, n_probe=16,
        probe_every=5, batch_size=16, hidden=64, layers=1, heads=2, threads=0, log_every=0,
    )
    assert 1 <= summary["sft_steps"] <= 15
    for key in ("sampled_accuracy_t1", "greedy_accuracy", "expected_accuracy_t1"):
        assert 0.0 <= summary[key] <= 1.0
    assert json.loads((tmp_path / "prepare_summary.json").read_text()) == summary

    model_dir = tmp_path / "model"
    assert (model_dir / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    assert model.config.head_dim in (32, 64, 80, 96, 112, 128)  # vLLM CPU attention sizes
    assert not model.config.tie_word_embeddings

    ds = load_dataset("json", data_files={
        "train": str(tmp_path / "data" / "train.jsonl"),
        "test": str(tmp_path / "data" / "test.jsonl"),
    })
    assert ds["train"].num_rows == 200 and ds["test"].num_rows == 40
    assert set(ds["train"].column_names) == {"prompt", "answer"}
    row = ds["test"][0]
    ids = torch.tensor([tok(row["prompt"]).input_ids])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


_VLLM_CHECK = r"""
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=64, seed=0)
ids = tok("37+25=").input_ids
by_text = llm.generate(["37+25="], SamplingParams(max_tokens=1, temperature=0.0))[0]
outs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=8, max_tokens=8, temperature=1.0, logprobs=0))
print(json.dumps({
    "hf_ids": ids,
    "vllm_text_ids": list(by_text.prompt_token_ids),
    "samples": [
        {"ids": list(c.token_ids), "text": c.text, "finish": c.finish_reason, "n_logprobs": len(c.logprobs)}
        for c in outs[0].outputs
    ],
    "eos": tok.eos_token_id,
}))
"""


@pytest.mark.slow
@pytest.mark.full  # the full lane; every default-lane run loads it in vLLM
def test_vllm_cpu_loads_and_samples_the_prepared_model(tiny_dir: str) -> None:
    """vLLM tokenizes prompts like HF and stops on EOS (from generation_config) with logprobs: the
    session's build of the built-in model, in an engine with the rollout worker's environment."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from rollout.vllm_engine import vllm_env

    env = dict(os.environ, **vllm_env(kv_cache_gib=1, threads=0))
    proc = subprocess.run([sys.executable, "-c", _VLLM_CHECK, f"{tiny_dir}/model"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["vllm_text_ids"] == report["hf_ids"]
    samples = report["samples"]
    assert all(s["n_logprobs"] == len(s["ids"]) for s in samples)
    stopped = [s for s in samples if s["finish"] == "stop"]
    assert stopped, samples
    assert all(s["ids"][-1] == report["eos"] and "<eos>" not in s["text"] for s in stopped)
