"""Supervised fine-tuning (`launch.train_sft`): prompt masking for completion and chat data,
training on a DeepSpeed engine, and a `save_pretrained` folder transformers loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from trainer.sft import IGNORE_INDEX, chat_example, render_chat

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# Renders with special tokens only plus digits and '+', '=' (all in the tiny tokenizer's vocabulary).
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}={% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_untrained):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(f"{tiny_untrained}/model")


def _chat_rows(tiny_dir: str, n: int, turns: int = 1) -> list[dict]:
    rows = [json.loads(line) for line in open(f"{tiny_dir}/data/train.jsonl")][: n * turns]
    out = []
    for i in range(0, len(rows), turns):
        messages = []
        for r in rows[i : i + turns]:
            messages += [{"role": "user", "content": r["prompt"].rstrip("=")},
                         {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": messages})
    return out


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _labels_of(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_completion_rows_mask_the_prompt(tiny_dir, tokenizer) -> None:
    from launch.train_sft import compose_config
    from trainer.sft import load_examples

    cfg = compose_config([f"data.train_files=[{tiny_dir}/data/train.jsonl]", "data.test_files=[]",
                          "data.test_fraction=0.1", f"model.path={tiny_dir}/model"])
    train, test, dropped = load_examples(cfg, tokenizer)
    assert len(train) == 4500 and len(test) == 500 and dropped == 0
    rows = [json.loads(line) for line in open(f"{tiny_dir}/data/train.jsonl")]
    by_ids = {tuple(tokenizer(r["prompt"]).input_ids): r["answer"] for r in rows}
    for ids, labels in train[:50]:
        n_prompt = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
        assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt  # every prompt token masked
        answer = by_ids[tuple(ids[:n_prompt])]
        assert labels[n_prompt:] == tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def test_chat_fallback_template_trains_assistant_turns_only(tokenizer) -> None:
    assert not tokenizer.chat_template
    messages = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "15"},
                {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    ids, labels = chat_example(tokenizer, messages)
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    eos = tokenizer.eos_token_id
    expected = ([tokenizer.bos_token_id] + enc("user:\n12+3=\n") + enc("assistant:\n") + enc("15") + [eos]
                + enc("user:\n1+1=\n") + enc("assistant:\n") + enc("2") + [eos])
    assert ids == expected
    assert _labels_of(ids, labels) == enc("15") + [eos] + enc("2") + [eos]
    assert len(labels) == len(ids) and labels[0] == IGNORE_INDEX
    with pytest.raises(ValueError, match="no assistant"):
        chat_example(tokenizer, [{"role": "user", "content": "1+1="}])


def test_chat_template_trains_assistant_turns_only(tokenizer) -> None:
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = TINY_TEMPLATE
    messages = [{"role": "system", "content": "0"}, {"role": "user", "content": "12+3"},
                {"role": "assistant", "content": "15"}, {"role": "user", "content": "1+1"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "9+9"}]
    ids, labels = chat_example(tok, messages)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == "<bos>0=12+3=15<eos>1+1=2<eos>9+9="
    assert ids == tok(rendered, add_special_tokens=False).input_ids
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    assert _labels_of(ids, labels) == enc("15") + [tok.eos_token_id] + enc("2") + [tok.eos_token_id]
    trained = [lab != IGNORE_INDEX for lab in labels]
    assert not any(trained[: len(enc("<bos>0=12+3="))]) and not any(trained[-len(enc("9+9=")):])
    segments = render_chat(tok, messages)
    assert [trainable for _, trainable in segments] == [False, True, False, True, False]


@pytest.fixture(scope="module")
def sft_runs(tiny_trained, tmp_path_factory):
    """A completion-format run (ZeRO-3, gradient accumulation) and a chat-format run (ZeRO-0)."""
    from launch.train_sft import run

    tmp = tmp_path_factory.mktemp("sft")
    base = [f"model.path={tiny_trained}/model", "run.progress=false", "algorithm.epochs=0.5", "algorithm.lr=2e-3"]
    completion = run(base + [f"data.train_files=[{tiny_trained}/data/train.jsonl]",
                             f"data.test_files=[{tiny_trained}/data/test.jsonl]", "data.completion_key=answer",
                             "trainer.zero_stage=3", "trainer.micro_batch_size=32", f"run.dir={tmp}/completion"])
    chat_file = _write(tmp / "chat.jsonl", _chat_rows(tiny_trained, 3000))
    chat = run(base + ["data.format=chat", f"data.train_files=[{chat_file}]", "data.test_files=[]",
                       "data.test_fraction=0.1", f"run.dir={tmp}/chat"])
    return completion, chat


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.full  # a learning curve
def test_sft_lowers_the_loss_and_saves_a_loadable_model(sft_runs, tokenizer, kind) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = dict(zip(["completion", "chat"], sft_runs))[kind]
    assert summary["eval/loss"] < 0.8 * summary["eval/loss_before_training"], summary
    assert summary["train/last_loss"] < summary["train/first_loss"]
    run_dir = os.path.dirname(summary["final_model"])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["epoch"] for r in rows if "eval/loss" in r] == [0.0, pytest.approx(0.5, abs=0.02)]
    assert os.path.isdir(os.path.join(run_dir, "tb")) and os.path.exists(os.path.join(run_dir, "summary.json"))

    model = AutoModelForCausalLM.from_pretrained(summary["final_model"]).eval()
    tok = AutoTokenizer.from_pretrained(summary["final_model"])
    assert tok.get_vocab() == tokenizer.get_vocab()
    prompt = "37+25=" if kind == "completion" else "<bos>user:\n37+25\nassistant:\n"
    ids = torch.tensor([tok(prompt, add_special_tokens=kind == "completion").input_ids])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip().isdigit(), text  # answers with a number after this short training


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_sft_cli_rejects_bad_config_fast_naming_the_field(tmp_path) -> None:
    start = time.perf_counter()
    for override, expected in [("data.formatt=chat", "data.formatt"), ("data.format=dialog", "data.format='dialog'")]:
        proc = subprocess.run([sys.executable, "-m", "launch.train_sft", override, f"run.dir={tmp_path}/run"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and expected in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
    assert time.perf_counter() - start < 20


def test_old_optim_names_still_work_with_a_warning_naming_the_new_field() -> None:
    """`optim.*` (the names before SFT/RM took the RL run's) are translated before validation:
    the same config as the new names, a FutureWarning per key naming the new field, and the run's
    saved config has no `optim` section."""
    from omegaconf import OmegaConf

    from rl.config.compose import compose

    def tree(cfg):  # unresolved: run.dir holds the time of composing
        return OmegaConf.to_container(cfg, resolve=False)

    old = ["optim.epochs=0.5", "optim.lr=2e-3", "optim.warmup_steps=3", "optim.micro_batch_size=32",
           "optim.batch_size=96", "optim.weight_decay=0.1", "optim.max_grad_norm=0.5"]
    new = ["algorithm.epochs=0.5", "algorithm.lr=2e-3", "algorithm.lr_warmup_steps=3", "trainer.micro_batch_size=32",
           "algorithm.batch_size=96", "algorithm.weight_decay=0.1", "algorithm.max_grad_norm=0.5"]
    with pytest.warns(FutureWarning) as caught:
        translated = compose("train_sft", old)
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert "optim.lr is deprecated, use algorithm.lr: optim.lr=0.002 was applied as algorithm.lr=0.002" in messages[3]
    assert "optim.warmup_steps is deprecated, use algorithm.lr_warmup_steps" in messages[4]
    assert "optim.micro_batch_size is deprecated, use trainer.micro_batch_size" in messages[2]
    assert len(messages) == 7
    assert tree(translated) == tree(compose("train_sft", new)) and "optim" not in translated
    # a reward model's old micro-batch counted pairs; the new one counts sequences (2 per pair)
    with pytest.warns(FutureWarning, match=r"optim.micro_batch_size=24 was applied as trainer.micro_batch_size=48"):
        rm = compose("train_rm", ["optim.micro_batch_size=24"])
    assert tree(rm) == tree(compose("train_rm", ["trainer.micro_batch_size=48"]))


def test_sft_missing_messages_column_fails_naming_it(tiny_dir, tmp_path) -> None:
    from launch.train_sft import run
    from rl.data.dataset import DataError

    with pytest.raises(DataError, match="data.messages_key='messages'"):
        run([f"model.path={tiny_dir}/model", "data.format=chat", f"data.train_files=[{tiny_dir}/data/train.jsonl]",
             "data.test_files=[]", f"run.dir={tmp_path}/run"])
