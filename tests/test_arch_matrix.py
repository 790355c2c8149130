"""The architecture matrix: each family users bring (tests/arch_zoo.py: Llama, Qwen2, Qwen3,
Qwen3-MoE, Mistral, Gemma 2, Phi-3, OLMo 2), built once per session with random weights, goes
through the whole stack: vLLM (CPU) loads it, GRPO runs 2 steps with full weights and with LoRA,
and after the weight sync the learner's log-probs of the sampled tokens equal vLLM's (mean |diff|
< 1e-3 in fp32, and at most a tenth of how far the update moved the policy, so a sync that did
nothing would fail). Llama and the MoE run their full-weight case with
`rollout.tensor_parallel_size=2`, the MoE with its routers' load-balancing loss on. Mistral's
tokenizer has tokens past its embedding (the run must not mind). The padding-free check's verdict
is compared with the truth on rows longer than the sliding windows.

Time: ~25 s per run, 16 runs, ~7 min in all on 2 cores (the stated figure is in docs/models-and-data.md). The
default lane runs the MoE's two; the full lane (`pytest -m full`) the other 14. The
bf16 figures: `python -m bench.arch_matrix`.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.arch_zoo import FAMILIES, LORA_TARGETS, MOE, build, run_grpo
from tests.conftest import shared_ray

TP2 = ("llama", "qwen3_moe")  # a dense model and the MoE: their full-weight runs shard over 2 vLLM workers


@pytest.fixture(scope="module")
def zoo(tiny_untrained, tmp_path_factory) -> dict[str, str]:
    """Every family's model folder, built once (about a second each)."""
    root = tmp_path_factory.mktemp("zoo")
    return {name: str(build(name, root / name, f"{tiny_untrained}/model")) for name in FAMILIES}


# The default lane keeps one run, the MoE at TP=2 with a LoRA sync (the family that found the most;
# its full-weights sync is the other ~70 s of the default lane's budget); the full lane all.
IN_DEFAULT_LANE = (("qwen3_moe", "lora"),)


@pytest.mark.slow
@pytest.mark.parametrize("family, sync", [pytest.param(f, s, id=f"{f}-{s}",
                                                       marks=() if (f, s) in IN_DEFAULT_LANE else pytest.mark.full)
                                          for f in FAMILIES for s in ("full", "lora")])
def test_grpo_runs_and_the_learner_agrees_with_vllm_after_the_sync(family, sync, zoo, tiny_dir, tmp_path):
    shared_ray()
    full = sync == "full"
    tp = 2 if full and family in TP2 else 1
    # the MoE's full-weight run trains its routers with the load-balancing loss on
    aux = ("algorithm.router_aux_loss_coef=0.01",) if full and family in MOE else ()
    metrics = run_grpo(zoo[family], f"{tiny_dir}/data/train.jsonl", tmp_path / "run",
                       lora=None if full else LORA_TARGETS[family], tensor_parallel=tp, extra=aux)
    assert len(metrics) == 2
    first, second = metrics
    assert first["actor/grad_norm"] > 0 and first["actor/updates_count"] == 1
    # step 1 samples from the weights vLLM read from disk; step 2 from the ones the sync sent
    diff, moved = second["sync/logprob_abs_diff"], math.sqrt(2 * second["actor/kl_nats"])
    print(f"{family} {sync} tp={tp}: |diff| before the sync {first['sync/logprob_abs_diff']:.2e}, after {diff:.2e} "
          f"(max {second['sync/logprob_max_abs_diff']:.2e}); the update moved the policy {moved:.2e}")
    assert first["sync/logprob_abs_diff"] < 1e-3, first["sync/logprob_abs_diff"]
    assert diff < 1e-3 and diff < moved / 10, (family, sync, diff, moved)
    assert ("actor/router_aux_loss" in first) == bool(aux)
    if aux:
        assert first["actor/router_aux_loss"] > 0


def _right_padded_rows(vocab: int, lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of real token ids (clear of the vocabulary's special ends), right-padded: ids, mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    am = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(5, vocab - 64, (n,), generator=g)
        am[row, :n] = 1
    return ids, am


@pytest.mark.parametrize("family", FAMILIES)
def test_the_padding_free_verdict_matches_what_packing_does_to_the_values(family, zoo):
    """`packing_matches` decides whether the learner packs rows. Its verdict must be the truth on
    other rows than its own probe: rows longer than Mistral's and Gemma's sliding window (32), of
    real token ids, where packed and padded log-probs are compared."""
    from transformers import AutoModelForCausalLM

    from trainer.layouts import plan_layout
    from trainer.logprobs import packing_matches, token_logprobs
    from trainer.packing import pack_rows

    model = AutoModelForCausalLM.from_pretrained(zoo[family], dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().num_embeddings
    verdict = packing_matches(model, vocab)
    ids, am = _right_padded_rows(vocab, [60, 36, 22, 12], seed=3)
    assert pack_rows(ids, am) is not None  # the rows do pack (36 + 22 share a bin, 12 fills another)
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, am)
        packed, _ = token_logprobs(model, ids, am, layout=plan_layout(ids, am, pack=True))
    truth = torch.allclose(packed, padded, atol=1e-5)
    assert verdict == truth, (family, verdict, (packed - padded).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cpu_learners_bf16_attention_trains_every_family_as_sdpa_does(family, zoo):
    """trainer/cpu_attention.py on each family (GQA, sliding windows, QK norms, MoE, fused
    projections): the training pass's log-probs and every gradient as SDPA gives them, packed
    rows, bf16 (or it leaves the family on SDPA, e.g. for soft-capping)."""
    from transformers import AutoModelForCausalLM

    from trainer.cpu_attention import NAME, use_training_attention
    from trainer.layouts import plan_layout
    from trainer.logprobs import token_logprobs

    def run(plain: bool):
        model = AutoModelForCausalLM.from_pretrained(zoo[family], dtype=torch.bfloat16)
        switched = use_training_attention(model, torch.device("cpu"), torch.bfloat16) if plain else False
        model.train()
        ids, am = _right_padded_rows(model.get_input_embeddings().num_embeddings, [30, 18, 11, 7], seed=5)
        lp, _ = token_logprobs(model, ids, am, layout=plan_layout(ids, am, pack=True))
        lp.float().sum().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return switched, lp.detach().float(), grads, model.config._attn_implementation

    _, base_lp, base_grads, _ = run(False)
    switched, lp, grads, impl = run(True)
    assert switched == (impl == NAME)
    assert torch.allclose(lp, base_lp, atol=0.1), (family, (lp - base_lp).abs().max().item())
    if family in MOE:  # bf16 rounding may flip a token's top-k experts, moving every gradient upstream
        norm = math.sqrt(sum(float(g.square().sum()) for g in base_grads.values()))
        other = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        assert abs(other - norm) <= 0.1 * norm, (family, norm, other)
        return
    for name, g in base_grads.items():
        assert (g - grads[name]).abs().max().item() <= 0.05 * (g.abs().max().item() + 1e-6), (family, name)
