"""LoRA RL (`model.lora`): the adapter wire names and the merge the rollout side does (against
peft's own forward), and (slow) a LoRA run of the default task on vLLM: the reward rises, the
rollout's log-probs match the learner's after every adapter-only sync, the final model is saved
merged and as a peft adapter, and the two agree."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rl.wire.lora import AdapterMerger, kept_weight_names, merge, split_wire_name, stacked_targets, wire_name


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).eval()


def test_wire_names():
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.0.self_attn.q_proj.lora_A"
    assert wire_name("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight") == "model.layers.1.mlp.up_proj.lora_B"
    assert split_wire_name("model.layers.0.self_attn.q_proj.lora_B") == ("model.layers.0.self_attn.q_proj", "lora_B")
    with pytest.raises(ValueError):
        wire_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    with pytest.raises(ValueError):
        split_wire_name("model.layers.0.self_attn.q_proj.weight")


def test_stacked_siblings_are_kept():
    assert stacked_targets(["q_proj", "v_proj"]) == {"q_proj", "k_proj", "v_proj"}
    assert stacked_targets(["o_proj", "up_proj"]) == {"o_proj", "gate_proj", "up_proj"}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert kept_weight_names(names, ["q_proj"]) == names[:2]


def test_merge_in_fp32_keeps_the_weight_dtype():
    base, a, b = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2)
    assert torch.allclose(merge(base, a, b, 0.5), base + 0.5 * b @ a, atol=1e-6)
    low = merge(base.bfloat16(), a.bfloat16(), b.bfloat16(), 0.5)
    assert low.dtype == torch.bfloat16
    exact = base.bfloat16().float() + 0.5 * b.bfloat16().float() @ a.bfloat16().float()
    assert torch.equal(low, exact.bfloat16())  # one rounding, at the end
    with pytest.raises(ValueError, match="do not fit"):
        merge(base, a.T, b, 1.0)


def test_merged_weights_reproduce_the_peft_forward():
    """The rollout side's merge (base weights from the checkpoint + the adapter as sent) gives the
    same logits as peft's adapted forward on the learner, including stacked siblings sent as kept."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    config, model = _tiny_llama()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at 0; any trained value must merge the same
    ids = torch.randint(0, 40, (3, 12))
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
    adapter = [(wire_name(n), p.detach()) for n, p in peft_model.named_parameters() if p.requires_grad]
    assert len(adapter) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    merger = AdapterMerger({n: base_state[n] for n in kept_weight_names(base_state, ["q_proj", "v_proj", "up_proj"])},
                           scaling=8 / 4)
    merged = dict(merger.merged(adapter))
    assert len(merged) == 2 * 5  # q k v + gate up in each layer: k and gate as they were
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base_state["model.layers.0.self_attn.k_proj.weight"])
    rollout = LlamaForCausalLM(config).eval()
    rollout.load_state_dict({**base_state, **merged})
    with torch.no_grad():
        assert torch.allclose(rollout(input_ids=ids).logits, adapted, atol=1e-5)
    with pytest.raises(KeyError, match="target_modules"):
        list(AdapterMerger({}, 1.0).merged(adapter[:2]))


def test_bf16_engine_merges_from_the_fp32_base_rounding_once():
    """A bf16 engine gets round(W0 + delta) from the checkpoint's fp32 W0, not round(round(W0) +
    delta): an update smaller than half a bf16 step of W0 survives in the first, not the second."""
    w0 = torch.full((4, 4), 1.0 + 3 * 2**-10)  # between two bf16 values (1.0 and 1 + 2**-7): rounds to 1.0
    a, b = torch.eye(2, 4), torch.full((4, 2), 2**-9)  # B @ A adds 2**-9 to the first two columns
    merger = AdapterMerger({"m.q_proj.weight": w0, "m.k_proj.weight": w0}, scaling=1.0, dtype=torch.bfloat16)
    merged = dict(merger.merged([("m.q_proj.lora_A", a), ("m.q_proj.lora_B", b)]))
    assert merged["m.q_proj.weight"].dtype == merged["m.k_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["m.q_proj.weight"], (w0 + b @ a).to(torch.bfloat16))
    assert (merged["m.q_proj.weight"][:, :2] == 1.0 + 2**-7).all()  # 1 + 2**-8 = 1 + 5 * 2**-10 rounds up: the update survives
    twice = (w0.to(torch.bfloat16).float() + b @ a).to(torch.bfloat16)
    assert (twice[:, :2] == 1.0).all()  # rounded twice: 1.0, + 2**-9 -> 1.0 again: the update is lost


def test_lora_config_errors():
    from rl.config.schema import ConfigError
    from tests.conftest import compose_config

    for override, field in (("model.lora.rank=-1", "model.lora.rank"), ("model.lora.alpha=0", "model.lora.alpha"),
                            ("model.lora.dropout=1.5", "model.lora.dropout"),
                            ("model.lora.target_modules=[]", "model.lora.target_modules")):
        extra = [] if override.startswith("model.lora.rank") else ["model.lora.rank=8"]
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            compose_config([override, *extra])


@pytest.mark.slow
@pytest.mark.full  # a learning curve; LoRA syncs' mechanics: test_arch_matrix's qwen3_moe-lora, test_rollout_tp
def test_lora_run_learns_with_adapter_only_syncs(make_config):
    """The default task with LoRA on q and v (so vLLM's stacked qkv layer gets k as it was):
    the reward rises, the rollout's log-probs equal the learner's after every sync, each sync
    sends the adapters only, and the final model is saved merged and as a peft adapter."""
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.test_e2e import _assert_reward_rises

    cfg = make_config("run.steps=30", "model.lora.rank=8", "model.lora.alpha=16",
                      "model.lora.target_modules=[q_proj,v_proj]", "algorithm.lr=5e-3", "algorithm.kl_coef=0.001")
    summary = train(cfg)
    metrics = read_metrics(cfg.run.dir)
    _assert_reward_rises(metrics)
    # rank 8 on q and v of 2 layers of width 128: 2 * 2 * (8*128 + 128*8) fp32 numbers
    adapter_mb = 2 * 2 * (8 * 128 + 128 * 8) * 4 / 2**20
    assert all(m["sync/weights_mb"] == pytest.approx(adapter_mb) for m in metrics)
    assert all(m["sync/logprob_max_abs_diff"] < 1e-3 for m in metrics)  # after every sync
    assert metrics[-1]["actor/kl_nats"] > 0  # the reference (adapters off) is not the policy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final, adapter = summary["final_model"], summary["final_adapter"]
    full_mb = os.path.getsize(os.path.join(final, "model.safetensors")) / 2**20
    assert adapter_mb < 0.05 * full_mb
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        saved = json.load(f)
    assert saved["r"] == 8 and set(saved["target_modules"]) == {"q_proj", "v_proj"}
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(final).eval()(input_ids=ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4) and not torch.allclose(merged, before, atol=1e-3)
