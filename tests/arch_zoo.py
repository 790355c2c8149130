"""Tiny random-weight models of the architecture families users bring, built locally from their
`transformers` configs (no Hub): what the architecture matrix trains end to end.

Each family keeps what makes it break elsewhere: Qwen2's qkv bias, Qwen3's q/k norms, Mistral's
sliding window, Gemma 2's logit soft-capping, sliding window, scaled embeddings and tied head,
Phi-3's fused qkv and gate-up projections, OLMo 2's post-norms (served by vLLM's Transformers
backend), Qwen3-MoE's routed experts. All have head_dim 32 (what vLLM's CPU attention supports),
an embedding padded past the tokenizer (as Qwen's and Gemma's are) and the tokenizer of the
built-in arithmetic task with that family's chat markers added and its chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The family's chat template, in its own format (roles and markers as the family writes them).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": CHATML,
    "qwen3": CHATML,
    "qwen3_moe": CHATML,
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "gemma2": ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
               "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
               "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "olmo2": ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}
MARKERS = {
    "llama": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|im_start|>", "<|im_end|>"], "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "qwen3_moe": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "mistral": ["[INST]", "[/INST]"], "gemma2": ["<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<|user|>", "<|assistant|>", "<|system|>"], "olmo2": ["<|user|>", "<|assistant|>", "<|system|>"],
}
FAMILIES = list(TEMPLATES)
MOE = ("qwen3_moe",)
# LoRA targets by the family's projection names (Phi-3's attention is one fused qkv_proj)
LORA_TARGETS = {name: ["qkv_proj", "o_proj"] if name == "phi3" else ["q_proj", "v_proj"] for name in FAMILIES}

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.02)


def model_config(name: str, vocab: int, ids: dict[str, Any]):
    """The family's transformers config at test size (`vocab` rows of embedding)."""
    import transformers as t

    common = dict(_SHAPE, vocab_size=vocab, **ids)
    if name == "llama":
        return t.LlamaConfig(**common, tie_word_embeddings=False)
    if name == "qwen2":
        return t.Qwen2Config(**common, tie_word_embeddings=True)
    if name == "qwen3":
        return t.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)
    if name == "mistral":
        return t.MistralConfig(**common, sliding_window=32, tie_word_embeddings=False)
    if name == "gemma2":
        return t.Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=32, sliding_window=32,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True)
    if name == "phi3":
        return t.Phi3Config(**common, tie_word_embeddings=False)
    if name == "olmo2":
        return t.Olmo2Config(**common, tie_word_embeddings=False)
    raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")


def build(name: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, pad_to: int = 64) -> Path:
    """Save family `name`'s tiny model (seeded random weights, embedding padded to a multiple of
    `pad_to` rows past the tokenizer) with the tokenizer of `tokenizer_dir` plus the family's
    chat markers and template, as a Hugging Face folder; returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": MARKERS[name]})
    tok.chat_template = TEMPLATES[name]
    vocab = -(-len(tok) // pad_to) * pad_to + pad_to  # at least one padding row past the tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(name, vocab, ids), dtype=torch.float32)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
