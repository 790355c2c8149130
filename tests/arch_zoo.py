"""Tiny random-weight models of the architecture families users bring, built locally from their
`transformers` configs (no Hub): what the architecture matrix trains end to end.

Each family keeps what makes it break elsewhere: Qwen2's qkv bias, Qwen3's q/k norms, Mistral's
sliding window, Gemma 2's logit soft-capping, sliding window, scaled embeddings and tied head,
Phi-3's fused qkv and gate-up projections, OLMo 2's post-norms (served by vLLM's Transformers
backend), Qwen3-MoE's routed experts. All have head_dim 32 (what vLLM's CPU attention supports),
an embedding padded past the tokenizer (as Qwen's and Gemma's are; Mistral's tokenizer instead has
tokens past its embedding, as a tokenizer extended without resizing the model has) and the
tokenizer of the built-in arithmetic task with that family's chat markers added and its chat
template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The family's chat template, in its own format (roles and markers as the family writes them).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's thinking template, as it behaves: an assistant turn's `<think>` block is kept only in
# turns after the last user message and dropped from earlier ones, the last assistant turn gets
# an (empty) one written in, and tool answers are user turns wrapped in <tool_response> tags. A
# conversation re-rendered by it is not the prefix the model saw: the episodes must not re-render.
QWEN3_THINKING = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
TEMPLATES = {
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": CHATML,
    "qwen3": QWEN3_THINKING,
    "qwen3_moe": QWEN3_THINKING,
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
    "phi3": ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "olmo2": ["<|user|>", "<|assistant|>", "<|system|>"],
}
# The family's end-of-turn token, made the tokenizer's EOS as in the family's instruct models
# (None: the base tokenizer's EOS, which the template writes itself)
EOS = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3_moe": "<|im_end|>",
       "gemma2": "<end_of_turn>", "phi3": "<|end|>", "mistral": None, "olmo2": None}
FAMILIES = list(TEMPLATES)
# Families whose tokenizer has tokens past the model's embedding rows (no prompt uses them)
SHORT_EMBEDDING = ("mistral",)
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
        # Gemma's caps are 50 (attention) and 30 (logits), far above a random model's logits: at
        # those the cap would change nothing measurable. 0.1 caps this model's logits (std ~0.16)
        # hard, so a learner that skipped it would differ from vLLM by ~0.05 nats, not 3e-6.
        return t.Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=32, sliding_window=32,
                              attn_logit_softcapping=50.0, final_logit_softcapping=0.1, tie_word_embeddings=True)
    if name == "phi3":
        return t.Phi3Config(**common, tie_word_embeddings=False)
    if name == "olmo2":
        return t.Olmo2Config(**common, tie_word_embeddings=False)
    raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")


def build(name: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, pad_to: int = 64,
          **config: Any) -> Path:
    """Save family `name`'s tiny model (seeded random weights, embedding padded to a multiple of
    `pad_to` rows past the tokenizer) with the tokenizer of `tokenizer_dir` plus the family's
    chat markers, end-of-turn EOS and template, as a Hugging Face folder; returns it. `config`:
    fields of the family's config to set otherwise (e.g. a MoE's num_experts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": MARKERS[name]})
    tok.chat_template = TEMPLATES[name]
    if EOS[name]:
        tok.eos_token = EOS[name]
    vocab = -(-len(tok) // pad_to) * pad_to + pad_to  # at least one padding row past the tokenizer
    if name in SHORT_EMBEDDING:  # the other way round: tokens added past the embedding, never resized
        tok.add_special_tokens({"additional_special_tokens": MARKERS[name] + [f"<unused{i}>" for i in
                                                                              range(vocab - len(tok) + 2)]})
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        family_config = model_config(name, vocab, ids)
        for key, value in config.items():
            setattr(family_config, key, value)
        model = AutoModelForCausalLM.from_config(family_config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def thinking_tokenizer():
    """The arithmetic task's chat tokenizer with Qwen3's thinking template and its end-of-turn EOS."""
    from examples.tiny import build_tokenizer

    tok = build_tokenizer(["12+34 ok r 46 \n tool_response user assistant"], chat=True, model_max_length=256)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tok.eos_token, tok.chat_template = "<|im_end|>", QWEN3_THINKING
    return tok


def run_grpo(model_dir: str | Path, train_file: str, run_dir: str | Path, *, lora: list[str] | None = None,
             dtype: str = "float32", tensor_parallel: int = 1, steps: int = 2, extra: tuple[str, ...] = ()
             ) -> list[dict]:
    """A GRPO run of `steps` steps on `model_dir` through the real `launch.train` path (checks,
    Ray, vLLM rollout engine, DeepSpeed learner, weight sync), in this process's Ray; returns
    each step's metrics. `lora`: target modules (rank 4), else full weights. A small entropy
    bonus makes the update nonzero (a random model earns no reward); the KL term keeps a
    reference, so `actor/kl_nats` says how far the policy moved from where it started. `extra`:
    more overrides."""
    from launch.checks import check_inputs
    from launch.train import train
    from rl.config.compose import compose
    from rl.log.run_log import read_metrics

    overrides = [f"model.path={model_dir}", f"model.dtype={dtype}", f"task.train_files=[{train_file}]",
                 f"run.dir={run_dir}", f"run.steps={steps}", "run.progress=false", "run.save_final_model=false",
                 "run.save_every=0", "task.prompts_per_step=8", "algorithm.entropy_coef=0.01",
                 f"rollout.tensor_parallel_size={tensor_parallel}", *extra]
    if lora:
        overrides += ["model.lora.rank=4", f"model.lora.target_modules=[{','.join(lora)}]"]
    cfg = compose("train", overrides)
    inputs, _ = check_inputs(cfg, overrides)
    train(cfg, inputs)
    return read_metrics(str(run_dir))
