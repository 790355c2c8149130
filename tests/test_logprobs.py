"""The learner's chunked log-probs (trainer/logprobs.py): the same values and gradients as a plain
full-vocabulary log-softmax, with the LM head applied a chunk of tokens at a time, and the same
first update through a DeepSpeed engine (ZeRO-2 and ZeRO-3, tied embeddings, LoRA)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.logprobs import token_logprobs

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, tie_word_embeddings=True)


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).float()


def _full_vocab(model, ids, am, temperature):
    """The reference: every position's logits at once, log-softmax in fp32."""
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.fixture(params=["linear_head", "checkpointed"])
def head_path(request, monkeypatch):
    """Both ways a chunk is computed: the written-out backward of a plain linear head, and the
    checkpointed recompute that any other head (ZeRO-3, adapters) takes."""
    if request.param == "checkpointed":
        monkeypatch.setattr("trainer.logprobs._plain_linear_weight", lambda head: None)
    return request.param


def test_chunked_values_and_gradients_equal_the_full_vocabulary_computation(head_path):
    ids = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 7:] = 0  # a right-padded row
    where = am[:, 1:].bool().clone()
    where[:, :3] = False  # the "prompt": not asked for
    weights = torch.randn(3, 9, generator=torch.Generator().manual_seed(2)) * where
    ref_model, model = _model(), _model()
    lp0, ent0 = _full_vocab(ref_model, ids, am, 0.7)
    ((lp0 * weights).sum() + (ent0 * weights).sum()).backward()
    lp, ent = token_logprobs(model, ids, am, 0.7, with_entropy=True, positions=where, chunk_tokens=4)
    ((lp * weights).sum() + (ent * weights).sum()).backward()
    assert torch.allclose(lp, lp0 * where, atol=1e-5) and torch.allclose(ent, ent0 * where, atol=1e-5)
    assert (lp[~where] == 0).all()
    grads = {n: p.grad for n, p in ref_model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], atol=1e-5), name
    # default positions: every real next token; a metric-only entropy carries no gradient
    lp_all, ent_all = token_logprobs(model, ids, am, 0.7, with_entropy=True, entropy_grad=False)
    assert torch.allclose(lp_all, lp0.detach() * am[:, 1:], atol=1e-5) and not ent_all.requires_grad


def test_no_tensor_of_the_full_vocabulary_logits_exists_in_forward_or_backward(head_path):
    """The memory property itself: with 2 rows x 80 scored tokens over an 8,192-entry vocabulary
    and chunks of 32 tokens, no tensor made in the forward or the backward pass (logits, their
    softmax, their gradient) is larger than one chunk's logits (as large as the embedding matrix
    here), a fifth of the full ones."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, t.numel())
            return out

    vocab, chunk = 8192, 32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "vocab_size": vocab, "hidden_size": 32,
                                            "intermediate_size": 64})).float()
    ids = torch.randint(0, vocab, (2, 81), generator=torch.Generator().manual_seed(3))
    full_logits = 2 * 80 * vocab
    with LargestTensor():
        lp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True, chunk_tokens=chunk)
        (lp.sum() + ent.sum()).backward()
    assert LargestTensor.largest <= chunk * vocab < full_logits / 4, (LargestTensor.largest, full_logits)
    with LargestTensor():  # the check itself sees full logits where they are made
        model(input_ids=ids).logits.float().log_softmax(-1)
    assert LargestTensor.largest >= full_logits


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_logits_the_model_reshapes_after_its_head_are_reshaped_the_same(family):
    """Gemma 2 soft-caps its logits, Granite divides them, Cohere multiplies them: the head alone
    would give other log-probs than the model (and than vLLM). A cap of 2 and scales of 4 and 0.25
    move them far; values and gradients must still equal the model's own logits'."""
    import transformers as t

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config = {"gemma2": lambda: t.Gemma2Config(**shape, final_logit_softcapping=2.0),
              "granite": lambda: t.GraniteConfig(**shape, logits_scaling=0.25),
              "cohere": lambda: t.CohereConfig(**shape, logit_scale=4.0)}[family]()
    torch.manual_seed(0)
    ref_model = t.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # logits large enough for the cap and the scales to matter
        ref_model.get_output_embeddings().weight.mul_(20)
    model = t.AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    lp0, _ = _full_vocab(ref_model, ids, am, 0.7)
    lp0.sum().backward()
    lp, _ = token_logprobs(model, ids, am, 0.7)
    lp.sum().backward()
    head_only = torch.log_softmax(model.get_output_embeddings()(
        model(input_ids=ids, output_hidden_states=True).hidden_states[-1][:, :-1]).float() / 0.7, -1)
    assert (head_only.gather(-1, ids[:, 1:, None]).squeeze(-1) - lp0).abs().mean() > 0.1  # it matters
    assert torch.allclose(lp, lp0, atol=1e-5)
    grads = {n: p.grad for n, p in ref_model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=1e-4, atol=1e-4 * grads[name].abs().max()), name


def test_a_metric_entropy_is_exact_and_adds_no_work_to_the_backward_pass(head_path):
    """The entropy as a metric (the default: no entropy bonus) equals the full-vocabulary one, and
    is computed once, in the forward: checkpointing runs each chunk again inside the backward
    pass, where the operators over vocabulary-wide tensors are the same with or without it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, chunk = 300, 4

    class VocabWideOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == vocab
                   for t in (out if isinstance(out, (tuple, list)) else (out,))):
                self.count += 1
            return out

    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(4))
    am = torch.ones_like(ids)
    _, ent0 = _full_vocab(_model(), ids, am, 0.7)
    counts = {}
    for name, with_entropy in (("metric", True), ("none", False)):
        model = _model()
        forward, backward = VocabWideOps(), VocabWideOps()
        with forward:
            lp, ent = token_logprobs(model, ids, am, 0.7, with_entropy=with_entropy, entropy_grad=False,
                                     chunk_tokens=chunk)
        with backward:
            lp.sum().backward()
        counts[name] = (forward.count, backward.count)
        if with_entropy:
            assert torch.allclose(ent, ent0.detach(), atol=1e-5) and not ent.requires_grad
    print(head_path, "vocabulary-wide ops (forward, backward):", counts)
    assert counts["metric"][0] > counts["none"][0] and counts["metric"][1] == counts["none"][1] > 0, counts


def test_no_position_asked_for_still_reaches_the_model():
    model = _model()
    ids = torch.randint(0, 300, (2, 6))
    lp, _ = token_logprobs(model, ids, torch.ones_like(ids), positions=torch.zeros(2, 5, dtype=torch.bool))
    assert (lp == 0).all() and lp.requires_grad
    lp.sum().backward()  # a zero gradient, but a backward pass (DeepSpeed's hooks need one)
    assert all(p.grad is not None for p in model.parameters())


# One DeepSpeed engine per process (ZeRO's global state): each case runs in its own interpreter.
ENGINE_CASE = textwrap.dedent('''
    import sys, torch
    from tests.test_logprobs import CONFIG, _full_vocab
    from transformers import LlamaConfig, LlamaForCausalLM
    from trainer.engine import build_engine, ds_config, init_single_process
    from trainer.layouts import plan_layout
    from trainer.logprobs import token_logprobs
    stage, lora, shared = int(sys.argv[1]), sys.argv[2] == "lora", sys.argv[3] == "shared"

    def load():
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(**CONFIG)).float()
        if lora:
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(3))
        return m

    ids = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(1))
    ids[1:, :5] = ids[0, :5]  # one group sharing a 5-token prompt
    am = torch.ones_like(ids)
    where = torch.ones(3, 9, dtype=torch.bool)
    where[:, :3] = False
    layout = plan_layout(ids, am, group_ids=torch.zeros(3), share="on") if shared else None
    assert not shared or layout.name == "shared"
    weights = torch.randn(3, 9, generator=torch.Generator().manual_seed(2)) * where
    # the reference: plain torch, full-vocabulary log-softmax
    ref = load()
    lp0, _ = _full_vocab(ref, ids, am, 1.0)
    (lp0 * weights).sum().backward()
    init_single_process()
    engine = build_engine(load, ds_config(micro_batch_size=3, gradient_accumulation_steps=1, zero_stage=stage,
                                          dtype="float32"), lr=1e-2, weight_decay=0.0, lr_lambda=lambda s: 1.0)
    lp, _ = token_logprobs(engine, ids, am, positions=where, chunk_tokens=4, layout=layout)
    assert torch.allclose(lp, lp0.detach() * where, atol=1e-5)
    engine.backward((lp * weights).sum())
    from deepspeed.utils import safe_get_full_grad
    after = dict(engine.module.named_parameters())
    worst, compared = 0.0, 0
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        grad = safe_get_full_grad(after[name])  # gathered and reduced as DeepSpeed holds it
        worst = max(worst, float((grad - p.grad).abs().max()))
        compared += 1
    print("compared", compared, "max |gradient difference|", worst)
    assert compared and worst < 1e-5, worst
    engine.step()
''')


@pytest.mark.slow
@pytest.mark.parametrize("stage,lora,layout", [(2, "full", "padded"), (3, "full", "padded"), (2, "lora", "padded"),
                                               (3, "lora", "padded"), (2, "full", "shared"), (3, "full", "shared"),
                                               (3, "lora", "shared")])
@pytest.mark.full  # DeepSpeed against torch per layout: the full lane
def test_deepspeed_update_through_chunked_logprobs_equals_torch(stage, lora, layout):
    """The tied embedding gets one gradient (ZeRO-1/2 refuse a second reduction), ZeRO-3 gathers
    the head when it recomputes, a frozen head (LoRA) works under both: the gradients DeepSpeed
    holds after a backward through the chunked log-probs are plain torch's with full logits, with
    the rows padded or as one shared-prefix tree (trainer/prefix_tree.py)."""
    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", ENGINE_CASE, str(stage), lora, layout], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_layouts_agree(ids, am, where, weights, layout) -> None:
    """Log-probs and entropies at temperature 0.7 (chunks of 4 tokens) and every parameter's
    gradient of their weighted sum, through `layout` (trainer/layouts.py) and padded: within
    1e-5, 0 off `where` and nonzero on it."""
    results = []
    for chosen in (None, layout):
        model = _model()
        lp, ent = token_logprobs(model, ids, am, 0.7, with_entropy=True, positions=where, chunk_tokens=4, layout=chosen)
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(ent0, ent1, atol=1e-5)
    assert (lp1[~where] == 0).all() and (lp1[where] != 0).all()
    for name, grad in g0.items():
        assert torch.allclose(grad, g1[name], atol=1e-5), name


def test_packed_rows_give_the_padded_values_and_gradients(head_path):
    """Right-padded rows of 9, 4, 3, 1 and 1 tokens packed into bins of 9 (trainer/packing.py):
    two rows instead of five, each token once, and the log-probs, entropies and every parameter's
    gradient are those of the padded batch; the model passes `packing_matches`."""
    from trainer.layouts import plan_layout
    from trainer.logprobs import packing_matches
    from trainer.packing import pack_rows

    lengths = [9, 4, 3, 1, 1]
    ids = torch.randint(1, 300, (5, 9), generator=torch.Generator().manual_seed(5))
    am = (torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * am
    packed = pack_rows(ids, am)
    assert packed is not None and packed.input_ids.shape == (2, 9)  # [9] and [4, 3, 1, 1]
    assert sorted(packed.source[packed.source >= 0].tolist()) == am.flatten().nonzero().squeeze(1).tolist()
    where = am[:, 1:].bool().clone()
    where[0, :2] = False  # a prompt not asked for
    weights = torch.randn(5, 8, generator=torch.Generator().manual_seed(6)) * where
    layout = plan_layout(ids, am, pack=True)
    assert layout.name == "packed"
    assert_layouts_agree(ids, am, where, weights, layout)
    assert packing_matches(_model(), 300)
    # left padding, or nothing to save: the padded layout
    assert pack_rows(ids.flip(1), am.flip(1)) is None and pack_rows(ids[:1], am[:1]) is None


class Misreads(torch.nn.Module):
    """A model that drops part of a layout's inputs: `rewrite(input_ids, attention_mask,
    position_ids)` gives what the real model gets. How a model whose attention ignores a layout
    looks to the learner's checks."""

    def __init__(self, inner, rewrite):
        super().__init__()
        self.inner, self.rewrite = inner, rewrite

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
        return self.inner(**self.rewrite(input_ids, attention_mask, position_ids), **kw)


def test_a_model_that_ignores_packed_positions_is_caught():
    """The check the learner makes before packing: attention that ignores position ids (here a
    model that always gets a plain causal mask) mixes the rows of a bin, and fails it."""
    from trainer.logprobs import packing_matches

    unpacked = Misreads(_model(), lambda ids, am, pos: {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert packing_matches(_model(), 300) and not packing_matches(unpacked, 300)


def test_a_moe_forward_gives_its_routers_load_balancing_loss_when_asked():
    """`router_aux` (algorithm.router_aux_loss_coef > 0): the same forward that gives the log-probs
    gives transformers' load-balancing loss of the routers, with a gradient into them; not asked,
    the routers' logits are not even computed."""
    import transformers as t

    config = t.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    aux: list[torch.Tensor] = []
    lp, _ = token_logprobs(model, ids, am, router_aux=aux)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=am, output_router_logits=True).aux_loss
    (value,) = aux
    assert value.item() > 0 and torch.allclose(value, expected)
    value.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    assert torch.allclose(token_logprobs(model, ids, am)[0], lp)  # the log-probs are the same either way
