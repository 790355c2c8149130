"""The architecture matrix's models (tests/arch_zoo.py) are what they claim: each family's class and
its distinguishing parts, head_dim 32, an embedding padded past the tokenizer, and the family's chat
format rendered by its template."""

from __future__ import annotations

import pytest

from tests.arch_zoo import EOS, FAMILIES, SHORT_EMBEDDING, build

PARTS = {  # a weight name only that family's layout has
    "qwen2": "model.layers.0.self_attn.q_proj.bias", "qwen3": "model.layers.0.self_attn.q_norm.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.gate_up_proj", "phi3": "model.layers.0.self_attn.qkv_proj.weight",
    "gemma2": "model.layers.0.pre_feedforward_layernorm.weight", "olmo2": "model.layers.0.self_attn.k_norm.weight",
    "llama": "lm_head.weight", "mistral": "lm_head.weight",
}
RENDERED = {
    "llama": "<|start_header_id|>user<|end_header_id|>\n\n1+2=<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n",
    "mistral": "[INST]1+2=[/INST]", "gemma2": "<start_of_turn>user\n1+2=<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|user|>\n1+2=<|end|>\n<|assistant|>\n", "olmo2": "<|user|>\n1+2=\n<|assistant|>\n",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_with_its_parts_and_chat_format(family, tiny_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build(family, tmp_path / family, f"{tiny_dir}/model")
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    config = model.config
    assert config.model_type == family and config.hidden_size // config.num_attention_heads == 32
    rows = model.get_input_embeddings().weight.shape[0]
    if family in SHORT_EMBEDDING:  # tokens added past the embedding, never resized
        assert rows < len(tok)
    else:  # padded, as Qwen's and Gemma's are
        assert rows > len(tok)
    if EOS[family]:  # the end-of-turn token is EOS, as in the family's instruct models
        assert tok.eos_token == EOS[family] and model.generation_config.eos_token_id == tok.eos_token_id
    assert PARTS[family] in dict(model.named_parameters()) or PARTS[family] in model.state_dict()
    if family == "gemma2":
        assert config.final_logit_softcapping and config.sliding_window and config.tie_word_embeddings
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert text.endswith(RENDERED.get(family, RENDERED["qwen2"])), text
    with torch.no_grad():
        logits = model(torch.tensor([tok("1+2=").input_ids])).logits
    assert torch.isfinite(logits).all()
