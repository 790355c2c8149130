"""The CPU learner's bf16 training attention (trainer/cpu_attention.py): when it takes the plain
matmul path, that it gives SDPA's values and gradients for the learner's masks (a shared-prefix
tree's additive mask, packed rows' boolean one), and that the planner counts what it keeps."""

import pytest
import torch

from rl.plan.memory_plan import EAGER_MAX_SLOTS, ModelShape, eager_attention_applies
from trainer.cpu_attention import NAME, takes_plain_path, use_training_attention


def _qk(slots: int, dtype=torch.bfloat16, grad: bool = True):
    q = torch.zeros(1, 4, slots, 8, dtype=dtype, requires_grad=grad)
    return q, torch.zeros(1, 2, slots, 8, dtype=dtype)


@pytest.mark.parametrize("case, expected", [
    ("bf16 training bin", True),
    ("float32", False),
    ("no grad (scoring)", False),
    ("bin past the limit", False),
    ("no mask (causal SDPA)", False),
    ("dropout", False),
    ("soft-capping", False),
])
def test_plain_path_only_where_it_pays(case, expected):
    slots, mask, dropout, kwargs = 16, torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16), 0.0, {}
    q, k = _qk(slots)
    if case == "float32":
        q, k = _qk(slots, torch.float32)
    elif case == "no grad (scoring)":
        q, k = _qk(slots, grad=False)
    elif case == "bin past the limit":
        slots = EAGER_MAX_SLOTS + 1
        q, k = _qk(slots)
        mask = torch.zeros(1, 1, slots, slots, dtype=torch.bfloat16)
    elif case == "no mask (causal SDPA)":
        mask = None
    elif case == "dropout":
        dropout = 0.1
    elif case == "soft-capping":
        kwargs = {"softcap": 30.0}
    assert takes_plain_path(q, k, mask, dropout, kwargs) is expected
    with torch.no_grad():  # grad mode off: never, whatever the tensor says
        assert not takes_plain_path(q, k, mask, dropout, kwargs)


def test_applies_on_cpu_bf16_only():
    assert eager_attention_applies("cpu", torch.bfloat16, EAGER_MAX_SLOTS)
    assert eager_attention_applies("cpu", "bfloat16", 1)
    assert not eager_attention_applies("cuda", torch.bfloat16, 16)
    assert not eager_attention_applies("cpu", torch.float32, 16)
    assert not eager_attention_applies("cpu", torch.bfloat16, EAGER_MAX_SLOTS + 1)


def _tiny(dtype=torch.bfloat16, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(dtype)


def _loss_and_grads(model, **inputs):
    model.zero_grad()
    logits = model(**inputs).logits.float()
    loss = torch.log_softmax(logits, -1)[..., 0].mean()
    loss.backward()
    return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(inputs):
    sdpa = _tiny()
    plain = _tiny()
    assert use_training_attention(plain, torch.device("cpu"), torch.bfloat16)
    assert plain.config._attn_implementation == NAME
    a_logits, a_grads = _loss_and_grads(sdpa, **inputs)
    b_logits, b_grads = _loss_and_grads(plain, **inputs)
    assert torch.allclose(a_logits, b_logits, atol=0.05, rtol=0.02)
    for name, g in a_grads.items():
        scale = g.abs().max().item() + 1e-6
        assert (g - b_grads[name]).abs().max().item() <= 0.05 * scale, name


def test_tree_mask_values_and_gradients_match_sdpa():
    """A prefix tree's 4D additive mask (trainer/prefix_tree.py): two branches off a shared prompt."""
    torch.manual_seed(1)
    slots = 12  # prompt 0-3, branch A 4-7, branch B 8-11
    visible = torch.zeros(slots, slots, dtype=torch.bool)
    for i in range(slots):
        visible[i, : min(i + 1, 4)] = True
        start = 4 if 4 <= i < 8 else 8 if i >= 8 else None
        if start is not None:
            visible[i, start : i + 1] = True
    blocked = torch.finfo(torch.bfloat16).min
    mask = torch.where(visible, 0.0, blocked).to(torch.bfloat16)[None, None].expand(2, 1, slots, slots)
    depth = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])
    _compare({"input_ids": torch.randint(0, 64, (2, slots)), "attention_mask": mask,
              "position_ids": depth[None].expand(2, slots)})


def test_packed_rows_values_and_gradients_match_sdpa():
    """Rows packed end to end (restarting position ids, no mask): transformers builds a boolean
    block-causal mask for both implementations."""
    torch.manual_seed(2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    _compare({"input_ids": torch.randint(0, 64, (2, 10)), "position_ids": positions})


def test_not_switched_where_it_does_not_pay():
    assert not use_training_attention(_tiny(torch.float32), torch.device("cpu"), torch.float32)
    assert not use_training_attention(_tiny(), torch.device("cuda"), torch.bfloat16)


def test_activation_model_counts_the_kept_probabilities():
    """What `activation_elements(plain_attention=True)` adds to SDPA's count against what autograd
    keeps per layer more than under SDPA (bf16, a tree's additive mask): its softmax's bf16
    probabilities."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def saved_bytes(layers: int, rows: int, seq: int, plain: bool) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=256, attn_implementation="sdpa")).to(torch.bfloat16)
        if plain:
            assert use_training_attention(model, torch.device("cpu"), torch.bfloat16)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        mask = torch.zeros(rows, 1, seq, seq, dtype=torch.bfloat16)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, 16, (rows, seq)), attention_mask=mask).logits.sum()
        return sum(v for k, v in seen.items() if k not in params)

    shape = ModelShape(hidden=128, layers=1, heads=4, kv_heads=4, head_dim=32, intermediate=256, vocab=16)
    for seq in (64, 96):
        def per_layer(plain: bool) -> int:
            return saved_bytes(2, 4, seq, plain) - saved_bytes(1, 4, seq, plain)

        kept = per_layer(True) - per_layer(False)
        planned = (shape.activation_elements(4 * seq, seq, plain_attention=True)
                   - shape.activation_elements(4 * seq, seq)) * 2
        assert kept > 0 and kept <= planned <= 1.06 * kept, (seq, kept, planned)
