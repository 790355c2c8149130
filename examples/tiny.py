"""Pieces every built-in task's tiny model is built from: a word-level tokenizer trained on the
task's own text, a small random-init Llama, and the `python -m examples.<task>` command line.

No network: the tokenizer is trained with `tokenizers` and wrapped as a `PreTrainedTokenizerFast`,
the model is a transformers `LlamaForCausalLM`, both saved with `save_pretrained`, so the real
Hugging Face loading code (and vLLM) reads them like any downloaded model.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rl.data.padding import pad_id_of
from trainer.sft import chat_example, example_logprobs, sft_train, train_examples
from trainer.supervised import torch_threads

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


# Chat models (the multi-turn tool tasks): role markers and the end-of-turn token as special
# tokens; <|end|> ends every turn, so it is the EOS that stops generation at the end of the model's
# turn. The tool-call tags (rl.data.tools) are ordinary added tokens: they stay in decoded text.
END, CHAT_ROLES, TOOL_TAGS = "<|end|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"), \
    ("<tool_call>", "</tool_call>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(
    corpus: list[str],
    *,
    pre_tokenizer: Any = None,
    decoder: Any = None,
    model_max_length: int = 64,
    chat: bool = False,
) -> PreTrainedTokenizerFast:
    """Word-level tokenizer trained on `corpus`: one token per digit and per symbol.

    Special ids are fixed (pad 0, bos 1, eos 2, unk 3). Encoding a text prepends BOS and never
    appends EOS, so `tokenizer(prompt).input_ids` is exactly what the model saw in training.
    By default words are split at punctuation and into single digits and decoded by joining the
    pieces without spaces (the arithmetic task); other tasks pass their own `pre_tokenizer` and
    `decoder` (e.g. `word_tokenizer` below: whitespace-separated words, joined with spaces).
    `chat`: EOS is `<|end|>` (id 2), the role markers are special tokens, the tool-call tags
    ordinary ones, and `CHAT_TEMPLATE` renders conversations (`apply_chat_template`).
    """
    eos = END if chat else EOS
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizer if pre_tokenizer is not None else pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    specials = [PAD, BOS, eos, UNK, *(CHAT_ROLES if chat else ())]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    if chat:
        tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    # default: join pieces without spaces: ["6", "2"] -> "62"
    tok.decoder = decoder if decoder is not None else decoders.Fuse()
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=eos,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # for batched generation; the SFT collator pads on its own
        model_max_length=model_max_length,
        **({"additional_special_tokens": list(CHAT_ROLES)} if chat else {}),
    )
    if chat:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def word_tokenizer(corpus: list[str], model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Word-level tokenizer for texts whose words are separated by single spaces (e.g. C tokens).

    Each whitespace-separated word of `corpus` is one token; decoding joins tokens with one space,
    so decoded text re-encodes to the same ids. Special tokens as in `build_tokenizer`.
    """
    return build_tokenizer(
        corpus,
        pre_tokenizer=pre_tokenizers.WhitespaceSplit(),
        decoder=decoders.WordPiece(prefix="##", cleanup=False),  # no word starts with "##": joins with " "
        model_max_length=model_max_length,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 64,
) -> LlamaForCausalLM:
    """A random-init Llama (head_dim 32, which vLLM's CPU attention supports), fixed by `seed`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.float().eval()




@dataclass(frozen=True)
class Recipe:
    """How a task's tiny model is made: its size and its SFT warm-up. Each task keeps its own
    defaults (`RECIPE`); its `build()` takes any field as a keyword argument (`Recipe.with_`)."""

    steps: int = 1000  # most SFT steps (the task's probe usually stops the warm-up earlier)
    batch_size: int = 64
    lr: float = 3e-3
    probe_every: int = 10  # steps between checks of the task's stopping probe
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    threads: int | None = 1  # torch CPU threads while building (None or 0: leave them); restored after
    log_every: int = 100  # print the SFT loss every N steps (0: never)
    # the sizes of the generated splits (the tasks that draw problems: arith, calculator)
    n_train: int = 5000
    n_test: int = 500
    n_eval: int = 300  # held-out rows the summary's figures are measured on
    n_probe: int = 256  # training rows of the warm-up's stopping probe

    def with_(self, **changes: Any) -> Recipe:
        """A copy with `changes`; an unknown name is a TypeError naming it."""
        return dataclasses.replace(self, **changes)


class TaskBuild(contextlib.ExitStack):
    """What every task's `build` does around its own part, as a `with` block: the recipe with the
    caller's changes, torch's threads for the build, the clock; `model` makes the recipe's tiny
    model and `finish` saves it and writes the summary (its files, the task's own figures, the
    total time)."""

    def __init__(self, out_dir: str | Path, seed: int, base: Recipe, changes: dict[str, Any]):
        super().__init__()
        self.out, self.seed, self.recipe = Path(out_dir), seed, base.with_(**changes)

    def __enter__(self) -> TaskBuild:
        super().__enter__()
        self.enter_context(torch_threads(self.recipe.threads))
        self.t0 = time.perf_counter()
        return self

    def model(self, tokenizer: PreTrainedTokenizerFast, **shape: Any) -> LlamaForCausalLM:
        """`build_model` at the recipe's size (`shape`: e.g. max_positions)."""
        r = self.recipe
        return build_model(tokenizer, self.seed, hidden=r.hidden, layers=r.layers, heads=r.heads, **shape)

    def finish(self, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, train: list[Any],
               test: list[Any], *figures: dict[str, Any]) -> dict[str, Any]:
        """Save the model; the summary is its files, the task's `figures` (merged in order) and the time."""
        saved = save_model(self.out, model, tokenizer, self.seed, train, test)
        merged = {k: v for part in figures for k, v in part.items()}
        return write_summary(self.out, {**saved, **merged, "total_s": round(time.perf_counter() - self.t0, 2)})


def warm_up(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str], completions: list[str],
            recipe: Recipe, seed: int, stop_fn: Callable[[int], bool]) -> tuple[list[float], dict[str, Any]]:
    """SFT of a fresh tiny model on (prompt, completion) pairs (`trainer.sft.sft_train`, with a
    short lr warm-up) that `stop_fn(done_steps)` ends once the task's probe is reached; returns
    the losses and the summary fields every task reports about it."""
    r, t0 = recipe, time.perf_counter()
    losses = sft_train(model, tokenizer, prompts, completions, steps=r.steps, batch_size=r.batch_size, lr=r.lr,
                       seed=seed, log_every=r.log_every, warmup_steps=min(50, r.steps // 10), stop_fn=stop_fn)
    return losses, _sft_summary(model, tokenizer, r, losses, t0)


def warm_up_episodes(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                     conversations: list[list[dict[str, str]]], recipe: Recipe, seed: int,
                     stop_fn: Callable[[int], bool]) -> tuple[list[float], dict[str, Any]]:
    """`warm_up` for multi-turn tasks: SFT on whole chat episodes (lists of {"role", "content"}
    messages rendered by the tokenizer's chat template, `trainer.sft.chat_example`), the loss on
    assistant turns only (their content and end-of-turn token), so the token ids are those the RL
    runner builds for the same conversation. Same loop, schedule and summary fields as `warm_up`."""
    r, t0 = recipe, time.perf_counter()
    examples = [chat_example(tokenizer, messages) for messages in conversations]
    losses = train_examples(model, examples, pad_id_of(tokenizer), steps=r.steps, batch_size=r.batch_size, lr=r.lr,
                            seed=seed, log_every=r.log_every, warmup_steps=min(50, r.steps // 10), stop_fn=stop_fn)
    return losses, _sft_summary(model, tokenizer, r, losses, t0)


def episode_logprobs(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                     conversations: list[list[dict[str, str]]], batch_size: int = 256) -> torch.Tensor:
    """log p(every assistant turn | the rest) per conversation, by teacher forcing: exp() of it is
    the chance that sampling at temperature 1.0 writes exactly these assistant turns when the other
    turns (the environment's answers) come as in the conversation; a noise-free warm-up probe."""
    return example_logprobs(model, [chat_example(tokenizer, m) for m in conversations], pad_id_of(tokenizer),
                            batch_size)


def _sft_summary(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, r: Recipe, losses: list[float],
                 t0: float) -> dict[str, Any]:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "config": {"hidden": r.hidden, "layers": r.layers, "heads": r.heads, "vocab": len(tokenizer)},
        "sft_steps": len(losses),
        "sft_max_steps": r.steps,
        "sft_batch_size": r.batch_size,
        "sft_lr": r.lr,
        "sft_first_loss": losses[0] if losses else None,
        "sft_final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
        "sft_s": round(time.perf_counter() - t0, 2),
    }


def save_model(out_dir: str | Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int,
               train: list[Any], test: list[Any]) -> dict[str, Any]:
    """OUT/model (complete or absent); returns the summary fields every task reports about its files."""
    from trainer.engine import save_pretrained_atomic

    out = Path(out_dir)
    save_pretrained_atomic(model, tokenizer, out / "model")
    return {"seed": seed, "model_dir": str(out / "model"), "train_file": str(out / "data" / "train.jsonl"),
            "test_file": str(out / "data" / "test.jsonl"), "n_train": len(train), "n_test": len(test)}


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> dict[str, Any]:
    """OUT/prepare_summary.json: what was built, how well it does, how long it took."""
    (Path(out_dir) / "prepare_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


class ProbeStop:
    """A warm-up's early stop (`stop_fn`): every `every` steps the model is measured on its probe
    set (`measure()`, a share in [0, 1]) and the warm-up stops once that reaches `target` (0 or
    above 1: never). Stopping on a measure rather than a step count matters: when a tiny model
    picks a skill up differs a lot between seeds, and RL needs a policy right only some of the time."""

    def __init__(self, name: str, target: float, every: int, measure: Callable[[], float]):
        self.name, self.target, self.every, self.measure = name, target, every, measure
        self.probes: list[tuple[int, float]] = []

    def __call__(self, done: int) -> bool:
        if not 0 < self.target <= 1 or done % self.every:
            return False
        self.probes.append((done, self.measure()))
        return self.probes[-1][1] >= self.target

    @property
    def last(self) -> float | None:
        return self.probes[-1][1] if self.probes else None

    def figures(self) -> dict[str, float | None]:
        """The summary's record of the stop: `sft_target_probe_<name>` and the last `sft_probe_<name>`."""
        return {f"sft_target_probe_{self.name}": self.target, f"sft_probe_{self.name}": self.last}


def at_two_temperatures(sample: Callable[..., dict[str, float]], seed: int) -> dict[str, float]:
    """The summary's sampling figures: each figure `sample(temperature=, seed=)` returns (but its
    row count `n`), of T=1.0 samples as `sampled_<figure>_t1` and of greedy decoding as `greedy_<figure>`."""
    sampled, greedy = sample(temperature=1.0, seed=seed), sample(temperature=0.0, seed=seed)
    return {**{f"sampled_{k}_t1": v for k, v in sampled.items() if k != "n"},
            **{f"greedy_{k}": v for k, v in greedy.items() if k != "n"}}


def main(build: Callable[..., dict[str, Any]], default_dir: str, doc: str, argv: list[str] | None = None) -> None:
    """`python -m examples.<task> [--out DIR] [--seed N] [name=value ...]`: run a task's `build`
    with keyword arguments given as `name=value` (values are Python literals, e.g. steps=500,
    target_accuracy=0.4, overrides='["algorithm.epochs=2"]'), and print its summary."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=default_dir, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("kwargs", nargs="*", metavar="name=value", help="keyword arguments of build()")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {}
    for item in args.kwargs:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected name=value")
        try:
            kwargs[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[name] = value  # a bare word: a string
    print(json.dumps(build(args.out, args.seed, **kwargs), indent=2))
