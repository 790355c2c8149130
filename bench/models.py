"""Model shapes the benchmarks share, built locally (no download) and cached on disk.

`build(shape)` returns a Hugging Face folder (model + tokenizer, `save_pretrained`) that
transformers, TRL and vLLM load like any downloaded model; it is made once under
`artifacts/bench/<shape>/` and made again only when missing. Every shape uses one tokenizer:
byte-level BPE with an 8k vocabulary trained with `tokenizers` on a fixed local corpus (the
top-level `.py` files of this Python's standard library, in name order, plus the 2-digit addition
texts), special ids pad 0, bos 1, eos 2, unk 3; encoding prepends BOS, as `examples.tiny` does.

| shape    | model                                                        | params |
|----------|--------------------------------------------------------------|--------|
| `27m`    | random-init Llama, hidden 512, 6 layers, 8 heads, MLP 1376    | ~27.4M |
| `tiny`   | random-init Llama, hidden 64, 2 layers, 2 heads, MLP 172      | ~1.1M  |
| `varlen` | `27m` that ends completions with EOS after geometric lengths | ~27.4M |

A random-init model almost never samples EOS (1 in 8192 per token), so `27m` and `tiny`
completions run to `max_new_tokens`. `varlen` makes EOS likely at a fixed rate per token (mean
completion ~40 tokens, ~4% reach 128), so rows of one batch differ widely in length and padding
costs what it costs in real runs. It is the `27m` model with one hidden channel made a constant:
the embeddings put `CONST` in channel 0, no layer reads or writes channel 0, the lm-head reads it
only in the EOS row. The final RMSNorm turns it into a near-constant feature, so the EOS logit is
near-constant and the length is geometric; its weight is calibrated on the model's own hidden
states so the mean EOS probability per token is `1 / VARLEN_MEAN`. (Cheaper and more predictable
than fine-tuning a length distribution in: no training, and the rest of the network is the `27m`
model's.) `python -m bench.models varlen` builds it and prints the sampled length distribution.

    python -m bench.models [27m,tiny,varlen] [--root artifacts/bench] [--sample 64]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

DEFAULT_ROOT = "artifacts/bench"
SEED = 0
VOCAB = 8192
MAX_POSITIONS = 512
CORPUS_BYTES = 4_000_000  # stdlib text the BPE is trained on (the first files in name order)
VARLEN_MEAN = 40.0  # mean completion length of `varlen` (tokens, before any max_new_tokens cut)
CONST = 1.0  # value of the constant channel in `varlen`'s residual stream


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    varlen: bool = False


SHAPES: dict[str, Shape] = {
    "27m": Shape(hidden=512, layers=6, heads=8, intermediate=1376),
    "tiny": Shape(hidden=64, layers=2, heads=2, intermediate=172),
    "varlen": Shape(hidden=512, layers=6, heads=8, intermediate=1376, varlen=True),
}


# ---- tokenizer -------------------------------------------------------------------------------

def corpus_texts(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """The BPE training corpus: stdlib sources (top-level `.py` files in name order, up to
    `max_bytes`), then every `a+b=c` addition text with 2-digit operands (the prompts' alphabet)."""
    from examples.arith import addition_prompt

    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    texts += [addition_prompt(a, b) + str(a + b) for a in range(10, 100) for b in range(10, 100)]
    return texts


def build_tokenizer(vocab_size: int = VOCAB) -> Any:
    """Byte-level BPE (`vocab_size` entries) on `corpus_texts()`, wrapped as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from examples.tiny import BOS, EOS, PAD, UNK

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, UNK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, padding_side="left", model_max_length=MAX_POSITIONS)


def tokenizer(root: str | Path = DEFAULT_ROOT) -> Any:
    """The shared tokenizer, trained once and kept in ROOT/tokenizer."""
    from transformers import AutoTokenizer

    path = Path(root) / "tokenizer"
    if not (path / "tokenizer.json").exists():
        tmp = path.with_name("tokenizer.tmp")
        build_tokenizer().save_pretrained(tmp)
        os.replace(tmp, path)
    return AutoTokenizer.from_pretrained(path)


# ---- models ----------------------------------------------------------------------------------

def build_model(tok: Any, shape: Shape, seed: int = SEED) -> Any:
    """A random-init LlamaForCausalLM of `shape` (untied embeddings), fixed by `seed`, float32."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, initializer_range=0.02,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    return model.float().eval()


@torch.no_grad()
def make_varlen(model: Any, tok: Any, mean_length: float = VARLEN_MEAN, seed: int = SEED) -> float:
    """Give `model` a near-constant EOS probability of 1/`mean_length` per token (see module doc);
    returns the EOS weight on the constant channel."""
    c, eos = 0, tok.eos_token_id
    inner = model.model
    inner.embed_tokens.weight[:, c] = CONST
    for layer in inner.layers:  # nothing reads channel c, nothing writes it: it stays CONST
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            lin.weight[:, c] = 0.0
        for lin in (a.o_proj, m.down_proj):
            lin.weight[c, :] = 0.0
    head = model.lm_head.weight
    head[:, c] = 0.0
    head[eos, :] = 0.0
    # calibrate: final hidden states of random token sequences, the EOS logit is w * h[c]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(tok), (16, 128), generator=g)
    ids[:, 0] = tok.bos_token_id
    hidden = inner(input_ids=ids).last_hidden_state.float()  # after the final norm
    feature = hidden[..., c]
    others = (hidden @ head.float().T)
    others[..., eos] = float("-inf")
    rest = others.logsumexp(-1)
    target = 1.0 / mean_length
    lo, hi = 0.0, 100.0
    for _ in range(60):  # mean sigmoid(w * f - rest) is increasing in w (f > 0)
        w = (lo + hi) / 2
        p = torch.sigmoid(w * feature - rest).mean().item()
        lo, hi = (w, hi) if p < target else (lo, w)
    head[eos, c] = w
    return w


@torch.no_grad()
def sample_lengths(path: str | Path, n: int = 64, max_new_tokens: int = 128, seed: int = SEED,
                   dtype: str = "float32") -> list[int]:
    """Completion lengths (EOS included) of `n` T=1.0 samples from `path` on addition prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.arith import addition_splits

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    prompts = [p.prompt for p in addition_splits(n, 0, seed=seed)[0]]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    lengths = []
    for row in out[:, enc.input_ids.shape[1]:].tolist():
        lengths.append(row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row))
    return lengths


def length_summary(lengths: list[int], cap: int = 128) -> dict[str, Any]:
    s = sorted(lengths)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"n": len(s), "mean": sum(s) / len(s), "min": s[0], "p10": q(0.1), "p50": q(0.5), "p90": q(0.9),
            "max": s[-1], "share_at_cap": sum(x >= cap for x in s) / len(s),
            "padding_share": 1 - sum(s) / (len(s) * max(s))}


# ---- data ------------------------------------------------------------------------------------

def write_data(root: str | Path = DEFAULT_ROOT, seed: int = SEED, n_train: int = 2000, n_test: int = 200) -> Path:
    """ROOT/data/train.jsonl (and test.jsonl): 2-digit addition prompts, columns `prompt`, `answer`
    (`examples.arith.addition_splits`); returns the train file. Written once."""
    from examples.arith import addition_splits
    from rl.data.jsonl import write_jsonl

    data = Path(root) / "data"
    train_file = data / "train.jsonl"
    if not train_file.exists():
        train, test = addition_splits(n_train, n_test, seed=seed)
        write_jsonl(data / "test.jsonl", (p.to_row() for p in test))
        write_jsonl(train_file, (p.to_row() for p in train))
    return train_file


# ---- build -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One builder at a time per ROOT (other benchmarks may ask for the same shape at once)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Real pretrained models the benchmarks also run on, each a `model=` config group that builds its
# folder on first use (`rl.data.builtins.ensure_builtin`), as `launch.train` does.
REAL_MODELS = ("smollm2",)  # SmolLM2-135M-Instruct: 30 layers, 49k vocabulary, tied embeddings


def real_model(name: str) -> Path:
    """The folder of the real model `name` (see `REAL_MODELS`), built from its package when missing."""
    from rl.data.builtins import ensure_builtin
    from rl.config.compose import compose

    path = compose("train", [f"model={name}"]).model.path
    ensure_builtin([path])
    return Path(path)


def build(shape: str, root: str = DEFAULT_ROOT) -> Path:
    """ROOT/<shape>: a HF model folder (model + tokenizer) of `shape` (see `SHAPES`), built when
    missing; the folder is complete or absent (written atomically). Also writes ROOT/data. A name
    of `REAL_MODELS` gives that real model's folder instead."""
    from trainer.engine import save_pretrained_atomic
    from trainer.supervised import torch_threads

    if shape in REAL_MODELS:
        return real_model(shape)
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join([*SHAPES, *REAL_MODELS])}")
    base = Path(root)
    out = base / shape
    if (out / "build.json").exists():
        return out
    with _locked(base), torch_threads(2):
        if (out / "build.json").exists():  # built by someone else while we waited
            return out
        t0 = time.perf_counter()
        write_data(base)
        tok = tokenizer(base)
        spec = SHAPES[shape]
        model = build_model(tok, spec)
        info: dict[str, Any] = {"shape": shape, "seed": SEED, "hidden": spec.hidden, "layers": spec.layers,
                                "heads": spec.heads, "intermediate": spec.intermediate, "vocab": len(tok),
                                "params": sum(p.numel() for p in model.parameters())}
        if spec.varlen:
            info["eos_weight"] = make_varlen(model, tok)
            info["target_mean_length"] = VARLEN_MEAN
        save_pretrained_atomic(model, tok, out)
        if spec.varlen:
            info["sampled_lengths"] = length_summary(sample_lengths(out))
        info["build_s"] = round(time.perf_counter() - t0, 1)
        (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="?", default=",".join(SHAPES))
    p.add_argument("--root", default=DEFAULT_ROOT)
    p.add_argument("--sample", type=int, default=64, help="samples to draw for the length distribution")
    args = p.parse_args(argv)
    for shape in args.shapes.split(","):
        path = build(shape, args.root)
        info = json.loads((path / "build.json").read_text())
        print(f"{shape}: {path} ({info['params'] / 1e6:.1f}M params, built in {info['build_s']} s)")
        if args.sample:
            lengths = sample_lengths(path, n=args.sample)
            s = length_summary(lengths)
            print(f"  completion lengths of {s['n']} samples (max 128): mean {s['mean']:.1f}, min {s['min']}, "
                  f"p10 {s['p10']}, p50 {s['p50']}, p90 {s['p90']}, max {s['max']}, "
                  f"at cap {s['share_at_cap']:.0%}, padding {s['padding_share']:.0%}")


if __name__ == "__main__":
    main()
