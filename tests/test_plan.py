"""The preflight planner (rl/plan/memory_plan.py, launch/plan.py): its arithmetic written out by hand for
three configurations, the refusal of a run that cannot fit (before Ray starts, naming the fix).
Its estimate against the peak memory of a real run is checked on the real model
(tests/test_smollm2.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl.plan.memory_plan import GIB, RUNTIME_GIB, ModelShape, Settings, make_plan
from test_bad_inputs import RAY_STARTED
from tests.conftest import imported_packages

ROOT = Path(__file__).resolve().parent.parent

# Llama-3.2-1B's shape (config.json keys as transformers writes them).
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": True}
# A 3B one (Llama-3.2-3B's shape).
LLAMA_3B = {**LLAMA_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
            "head_dim": 128}

# Parameters of LLAMA_1B, by hand:
EMBED = 128256 * 2048                                  # 262,668,288 (tied: the LM head is the same matrix)
LAYER = (2048 * 2048      # q_proj: 32 heads x 64
         + 2 * 2048 * 512  # k_proj, v_proj: 8 KV heads x 64
         + 2048 * 2048    # o_proj
         + 3 * 2048 * 8192  # gate, up, down
         + 2 * 2048)      # two RMSNorms  -> 60,821,504
P = EMBED + 16 * LAYER + 2048                           # + final norm = 1,235,814,400


def act_per_token_layer(seq: int) -> int:
    """Activation elements one LLAMA_1B layer keeps per token (50,336 at 128 tokens)."""
    return (6 * 2048     # two RMSNorms: input, normalised input, output
            + 2 * 2048   # q and the attention output (32 x 64)
            + 2 * 512    # k, v (8 x 64)
            + 4 * 8192   # gate, up, SiLU(gate), product
            + 32 + seq)  # log-sum-exp per head, mask ~ sequence length


def test_parameter_count_by_hand():
    assert P == 1_235_814_400  # Llama-3.2-1B's published count
    shape = ModelShape.from_config(LLAMA_1B)
    assert shape.params() == P
    # LoRA rank 16 on q,k,v,o: 16 layers x 16 x ((2048+2048) + 2 x (2048+512) + (2048+2048))
    assert shape.lora_params(16) == 16 * 16 * (4096 + 2 * 2560 + 4096) == 3_407_872


def test_zero0_fp32_one_rank_by_hand():
    """Full fine-tune in float32 with the client optimizer as it is (ZeRO-0), no reference model."""
    s = Settings(dtype="float32", zero_stage=0, learners=1, prompts_per_step=1, n=4, micro_batch_size=4,
                 max_new_tokens=64, max_model_len=128, kl_coef=0.0, entropy=False, memory_gib=0)
    plan = make_plan(ModelShape.from_config(LLAMA_1B), s, host_bytes=24 * GIB)
    parts = plan.role("learner").parts
    tokens = 4 * 128                                   # one micro-batch: 4 rows of 128 tokens
    expected = {
        "policy weights": 4 * P,                       # fp32
        "policy gradients": 4 * P,                     # whole, fp32
        "policy AdamW m, v (fp32)": 8 * P,             # two moments, not partitioned at ZeRO-0
        "activations": act_per_token_layer(128) * tokens * 16 * 4 + 3 * 2048 * tokens * 4,  # + final norm
        # the LM head sees only the 4 x 64 completion tokens: three fp32 copies + its fp32 output
        "logits": 4 * 64 * 128256 * (3 * 4 + 4),
        "process runtime (torch, DeepSpeed, Ray)": RUNTIME_GIB["learner"] * GIB,
    }
    assert parts == pytest.approx(expected)
    assert plan.role("learner").per_process == pytest.approx(16 * P + expected["activations"] + expected["logits"]
                                                             + RUNTIME_GIB["learner"] * GIB)
    assert expected["activations"] == 1_661_992_960  # 50,336 x 512 x 16 x 4 + 12,582,912: 1.55 GiB
    # 16 x P = 18.42 GiB of weights, gradients and AdamW state (its fused step adds no temporary):
    # with activations, logits and the runtime the learner needs 21.1 GiB; with the rollout worker's
    # fp32 copy, its KV cache and the driver, 29.0 GiB, more than the 24 GiB machine has
    assert plan.role("learner").per_process / GIB == pytest.approx(21.1, abs=0.05)
    assert plan.checks[0].need / GIB == pytest.approx(29.0, abs=0.05)
    assert plan.fits is False


def test_zero2_bf16_two_ranks_by_hand():
    """bfloat16, ZeRO-2 over 2 ranks, a reference model (kl_coef > 0), gradient checkpointing."""
    s = Settings(dtype="bfloat16", zero_stage=2, learners=2, prompts_per_step=4, n=4, micro_batch_size=8,
                 max_new_tokens=128, max_model_len=128, kl_coef=0.001, gradient_checkpointing=True, entropy=True)
    plan = make_plan(ModelShape.from_config(LLAMA_1B), s, host_bytes=64 * GIB)
    parts = plan.role("learner").parts
    assert plan.micro_batch_rows == 8                  # 16 samples / 2 ranks = 8 rows, one micro-batch
    tokens = 8 * 128
    expected = {
        "policy weights": 2 * P,                       # bf16, whole on each rank
        "policy gradients": 500_000_000 * 2,           # bf16, through one reduce bucket (5e8 elements)
        "policy fp32 gradient partition": 4 * P / 2,   # this rank's half
        "policy fp32 master copy": 4 * P / 2,
        "policy AdamW m, v (fp32)": 8 * P / 2,
        # checkpointed: each layer's input, one layer's activations while it recomputes (bf16 on
        # CPU: with the plain attention's bf16 probabilities, 32 heads x 128 slots), final norm
        "activations (checkpointed)": (tokens * 2048 * 16 * 2 + (act_per_token_layer(128) + 32 * 128) * tokens * 2
                                       + 3 * 2048 * tokens * 2),
        # three fp32 copies + the bf16 output, + exp() and its product for the entropy metric
        "logits": tokens * 128256 * (3 * 4 + 2) + tokens * 128256 * 8,
        "reference weights": 2 * P,                    # bf16, not sharded below ZeRO-3
        "process runtime (torch, DeepSpeed, Ray)": RUNTIME_GIB["learner"] * GIB,
    }
    assert parts == pytest.approx(expected)
    assert plan.role("learner").count == 2


def test_zero3_offload_on_gpus_by_hand():
    """float32, ZeRO-3 over 4 GPU ranks, optimizer offloaded to the host, 80 GiB devices."""
    s = Settings(dtype="float32", zero_stage=3, learners=4, prompts_per_step=8, n=4, micro_batch_size=2,
                 max_new_tokens=256, max_model_len=256, kl_coef=0.001, offload_optimizer=True, entropy=False,
                 gpus_per_learner=1, gpus_per_rollout_worker=1, gpu_memory_gib=80)
    plan = make_plan(ModelShape.from_config(LLAMA_1B), s, host_bytes=0, gpu_bytes=80 * GIB)
    learner = plan.role("learner")
    tokens = 2 * 256                                   # 32 samples / 4 ranks = 8 rows, micro-batches of 2
    assert plan.micro_batch_rows == 2
    device = {
        "policy weights": 4 * P / 4,                   # partitioned over 4 ranks
        "policy gradients": 500_000_000 * 4,           # one fp32 reduce bucket
        "activations": act_per_token_layer(256) * tokens * 16 * 4 + 3 * 2048 * tokens * 4,
        "logits": tokens * 128256 * 16,
        "reference weights": 4 * P / 4,                # ZeRO-3 partitions the reference too
        "CUDA context": 1 * GIB,
    }
    host = {
        "policy fp32 gradient partition, offloaded": 4 * P / 4,
        "policy fp32 master copy, offloaded": 4 * P / 4,
        "policy AdamW m, v (fp32), offloaded": 8 * P / 4,
        "process runtime (torch, DeepSpeed, Ray)": RUNTIME_GIB["learner"] * GIB,
    }
    assert learner.parts == pytest.approx(device)
    assert learner.host_parts == pytest.approx(host)
    check = next(c for c in plan.checks if c.what.startswith("learner"))
    assert check.need == pytest.approx(sum(device.values())) and check.capacity == 80 * GIB and check.fits
    # the rollout engine gets 0.5 x 80 GiB: the KV cache is what the fp32 weights and CUDA context leave
    rollout = plan.role("rollout")
    assert rollout.parts["KV cache (what gpu_memory_utilization leaves)"] == pytest.approx(40 * GIB - 4 * P - GIB)


def test_activation_model_matches_what_autograd_saves():
    """`activation_elements` against the bytes of the tensors autograd keeps for backward
    (saved_tensors_hooks, unique storages, parameters excluded) of a real Llama: per layer the
    difference between 2 and 1 layers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.logprobs import token_logprobs

    def saved_bytes(layers: int, hidden: int, inter: int, heads: int, rows: int, seq: int) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=hidden, intermediate_size=inter,
                                             num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=heads, max_position_embeddings=256))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids, am = torch.randint(0, 16, (rows, seq)), torch.ones(rows, seq, dtype=torch.long)
        am[0, -3:] = 0  # padding, as in training batches
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_logprobs(model, ids, am)
        return sum(v for k, v in seen.items() if k not in params)

    for hidden, inter, heads, seq in ((256, 512, 4, 32), (256, 1024, 8, 64)):
        per_layer = saved_bytes(2, hidden, inter, heads, 4, seq) - saved_bytes(1, hidden, inter, heads, 4, seq)
        shape = ModelShape(hidden=hidden, layers=1, heads=heads, kv_heads=heads, head_dim=hidden // heads,
                           intermediate=inter, vocab=16)
        assert shape.activation_elements(4 * seq, seq) * 4 == pytest.approx(per_layer, rel=0.01), (hidden, seq)


def _run(module: str, overrides: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command's outcome (its import log taken out of stderr) and the packages it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    imported = imported_packages(proc.stderr)
    proc.stderr = "".join(line + "\n" for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc, imported


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_3b_full_finetune_on_24_gib_is_refused_before_anything_starts(tmp_path, tiny_dir):
    """A 3B full fine-tune (float32, the tiny task's data) on a 24 GiB machine: both launch.plan
    and launch.train exit 2 with one error line naming the memory and the override that fits; the
    model folder holds only config.json and a tokenizer (no weights), so nothing but the plan
    and the input checks could have run."""
    model = tmp_path / "llama3b"
    shutil.copytree(os.path.join(tiny_dir, "model"), model,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "config.json", "generation_config.json"))
    (model / "config.json").write_text(json.dumps(LLAMA_3B))
    overrides = [f"model.path={model}", "cluster.memory_gib=24", f"run.dir={tmp_path}/run", "run.progress=false",
                 f"task.train_files=[{tiny_dir}/data/train.jsonl]"]
    for module in ("launch.plan", "launch.train"):
        proc, imported = _run(module, overrides, tmp_path)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2, output
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, proc.stderr
        error = errors[0]
        assert "host RAM" in error and "GiB but has 24.00 GiB" in error, error
        assert "model.lora.rank=16" in error and "model.dtype=bfloat16" in error and "would fit" in error, error
        assert "Memory per role (GiB)" in proc.stdout and "DOES NOT FIT" in proc.stdout  # the table
        assert "Traceback" not in output
        assert RAY_STARTED not in output
        assert {"hydra", "launch", "rl"} <= imported, "no import log: the check below would pass vacuously"
        heavy = imported & {"ray", "vllm", "deepspeed"}
        assert not heavy, f"{module} refused only after importing {sorted(heavy)}"
    # the suggested overrides make the plan fit (the planner's own verdict, in this process)
    from launch.plan import plan_run
    from tests.conftest import compose_config

    fix = error.split("; ")[1].split(" would fit")[0].split()
    plan, _ = plan_run(compose_config(overrides + fix))
    assert plan.fits, (fix, plan.problems)


def test_preflight_can_be_skipped():
    from launch.plan import preflight
    from rl.config.compose import compose

    cfg = compose("train", ["cluster.preflight=false", "cluster.memory_gib=0.5"])
    assert preflight(cfg) is None


def test_lora_rollout_counts_the_base_weights_it_merges_into():
    """A LoRA run's rollout worker keeps the targeted base weights (q/k/v/o by default, fp32) in
    host memory to merge each adapter sync into: on a GPU plan that is host memory, not the GPU's."""
    s = Settings(dtype="bfloat16", lora_rank=8, gpus_per_learner=1, gpus_per_rollout_worker=1, gpu_memory_gib=80)
    plan = make_plan(ModelShape.from_config(LLAMA_1B), s, host_bytes=64 * GIB, gpu_bytes=80 * GIB)
    kept = 16 * (2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048) * 4  # q, k, v, o of 16 layers in fp32
    rollout = plan.role("rollout")
    assert rollout.host_parts["LoRA merge source (targeted base weights, fp32)"] == kept
    assert not any("LoRA" in name for name in rollout.parts)


def test_hybrid_plan_checks_each_phase_of_the_gpu_hand_over():
    """cluster.placement_mode=hybrid: the learner rank and the engine share one GPU in turns, so
    the plan checks the learner beside a sleeping engine's CUDA context, the engine's share
    beside an offloaded learner's context, and the sync with both holding weights plus the IPC
    staging buffer; host RAM holds the offloaded learner."""
    shape = ModelShape.from_config(LLAMA_1B)
    s = Settings(dtype="bfloat16", gpus_per_learner=1, gpus_per_rollout_worker=1, hybrid=True,
                 gpu_memory_utilization=0.85, sleep_between_steps=True)
    plan = make_plan(shape, s, host_bytes=64 * GIB, gpu_bytes=80 * GIB)
    checks = {c.what: c for c in plan.checks}
    learner = plan.role("learner")
    assert checks["learner rank on the shared GPU (engine asleep)"].need == learner.per_process + GIB
    assert checks["rollout engine on the shared GPU (learner offloaded)"].need == 0.85 * 80 * GIB + GIB
    weights = shape.params() * 2
    embedding = 128256 * 2048 * 2  # the largest tensor (525 MB): the staging buffer grows to hold it
    assert embedding > 256 * 2**20
    assert checks["weight sync on the shared GPU (both hold weights)"].need == 2 * weights + embedding + 2 * GIB
    host = checks["host RAM (offloaded learner states, runtimes, CPU roles)"].need
    assert host >= learner.per_process + learner.host_per_process
    assert all(c.fits for c in plan.checks)
    greedy = make_plan(shape, Settings(**{**s.__dict__, "gpu_memory_utilization": 0.99}), 64 * GIB, 80 * GIB)
    assert not {c.what: c for c in greedy.checks}["rollout engine on the shared GPU (learner offloaded)"].fits


def test_slow_bf16_is_named_with_its_fix():
    """launch.plan warns when this CPU's bf16 matmuls are 3x or more slower than its fp32 ones (a
    CPU without AVX512-BF16 or AMX: SmolLM2's recipe in bf16 predicted 8,000 s a step on one),
    naming model.dtype=float32; a CPU whose bf16 is as fast or faster gets no warning."""
    from launch.plan import slow_bf16_note

    note = slow_bf16_note(0.001, 0.120)
    assert note is not None and "120x slower" in note and "model.dtype=float32" in note
    assert slow_bf16_note(0.05, 0.16) is not None  # 3.2x: over the threshold (3x)
    assert slow_bf16_note(0.06, 0.15) is None  # 2.5x
    assert slow_bf16_note(1.2, 0.5) is None  # AMX: bf16 the faster one
    assert slow_bf16_note(0.0, 0.5) is None  # no measurement
