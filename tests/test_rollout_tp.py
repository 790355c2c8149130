"""Tensor-parallel rollouts on CPU. vLLM's CPU build runs `rollout.tensor_parallel_size=2` with its
"mp" executor: the two TP workers are subprocesses of a `RolloutWorker` Ray actor placed in a
placement group (where vLLM left to itself would pick its "ray" executor and wait for resources).
The TP=2 engine generates what a TP=1 one does; in a weight sync each TP worker joins the group
itself at rank first_rank + its TP rank, takes the whole broadcast and loads its shard, tied
embeddings included; an object-store sync crosses to both TP workers as a list."""

from __future__ import annotations

import shutil

import pytest
import torch

from rl.config.schema import ModelConfig, RolloutConfig
from rl.data.types import GenerationRequest
from rl.wire.collective import free_port, init_group, send
from rl.wire.format import WeightMeta, buckets
from rollout.protocol import RolloutSpec
from rollout.vllm_engine import vllm_env
from rollout.worker import RolloutWorker

pytestmark = [pytest.mark.slow, pytest.mark.full]  # TP=2 in the default lane: the matrix's qwen3_moe runs


def _tied_tiny(tiny_dir: str, out: str):
    """The tiny model with its LM head tied to the embeddings (a twin vLLM's reload leaves stale
    unless each TP worker restores it), saved to `out`; returns the HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{tiny_dir}/model", dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_dir}/model/{name}", out)
    return model.eval()


def _greedy(worker, prompts: list[list[int]]):
    import ray

    reqs = [GenerationRequest(ids, "", i, 0, seed=i, temperature=0.0) for i, ids in enumerate(prompts)]
    return ray.get(worker.generate.remote(reqs), timeout=120)


def _hf_logprobs(model, samples) -> list[list[float]]:
    from trainer.logprobs import token_logprobs

    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        out.append(lp[0, len(s.prompt_ids) - 1 :].tolist())
    return out


def _assert_same(a, b) -> None:
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_tp2_matches_tp1_before_and_after_weight_syncs(ray_local, tiny_dir, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    model_dir = str(tmp_path / "tied")
    model = _tied_tiny(tiny_dir, model_dir)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}  # tied head: not sent
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    env = {"OMP_NUM_THREADS": "1", **vllm_env(1, 1)}

    def start(tp: int, bundle: int):
        rollout = RolloutConfig(max_new_tokens=8, max_model_len=64, kv_cache_gib=1, tensor_parallel_size=tp)
        spec = RolloutSpec(ModelConfig(path=model_dir, dtype="float32"), rollout, seed=0, threads=1)
        return ray.remote(RolloutWorker).options(
            num_cpus=1, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(spec, 0)

    tp1, tp2 = start(1, 0), start(2, 1)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p).input_ids for p in ("12+3=", "7+8=", "40+2=", "9+9=")]
        before = _greedy(tp2, prompts)
        _assert_same(before, _greedy(tp1, prompts))
        assert all(len(s.completion_ids) >= 1 for s in before)

        # rank 0 (this process) broadcasts perturbed weights; group ranks: 1 (TP=1), 2 and 3 (TP=2)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        named = list(model.named_parameters())
        metas = [WeightMeta(n, tuple(p.shape), "float32") for n, p in named]
        port = free_port()
        joins = [w.join_weight_sync.remote("127.0.0.1", port, first, 4, "gloo", metas)
                 for w, first in ((tp1, 1), (tp2, 2))]
        group = init_group("127.0.0.1", port, 0, 4, "gloo", timeout_s=120)
        ray.get(joins, timeout=120)
        receives = [w.receive_weights.remote(1) for w in (tp1, tp2)]
        send(group, [[named[i][1].detach() for i in b] for b in buckets(metas)])
        stats1, stats2 = ray.get(receives, timeout=120)
        model_bytes = sum(m.nbytes for m in metas)
        assert stats1["bytes"] == model_bytes and stats2["bytes"] == 2 * model_bytes  # every TP rank got all

        after = _greedy(tp2, prompts)
        _assert_same(after, _greedy(tp1, prompts))
        assert [s.completion_ids for s in after] != [s.completion_ids for s in before]
        assert all(s.policy_version == 1 for s in after)
        # the log-probs are those of the new weights, the tied LM head included
        for s, want in zip(after, _hf_logprobs(model, after)):
            assert s.logprobs == pytest.approx(want, abs=1e-4)

        # object store: the original weights cross to both TP workers as a list
        ray.get(tp2.load_weights_from_object.remote(original, 2), timeout=120)
        restored = _greedy(tp2, prompts)
        _assert_same(restored, before)
        assert all(s.policy_version == 2 for s in restored)
    finally:
        for w in (tp1, tp2):
            ray.kill(w)
        remove_placement_group(pg)


def test_tp2_lora_sync_merges_in_each_tp_worker(ray_local, tiny_dir, tmp_path):
    """With `model.lora` a sync carries only adapters: each TP worker keeps the targeted base
    weights (q/k/v here: v_proj is stacked with q and k) and merges them itself before loading
    its shard; the engine then samples from W0 + alpha/rank * B @ A."""
    import ray

    from rl.config.schema import LoraConfig

    model_dir = str(tmp_path / "tied")
    model = _tied_tiny(tiny_dir, model_dir)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    rollout = RolloutConfig(max_new_tokens=8, max_model_len=64, kv_cache_gib=1, tensor_parallel_size=2)
    spec = RolloutSpec(ModelConfig(path=model_dir, dtype="float32", lora=lora), rollout, seed=0, threads=1)
    worker = ray.remote(RolloutWorker).options(
        num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **vllm_env(1, 1)}}).remote(spec, 0)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p).input_ids for p in ("12+3=", "7+8=", "40+2=")]
        before = _greedy(worker, prompts)
        g = torch.Generator().manual_seed(2)
        adapters: list[tuple[str, torch.Tensor]] = []
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in lora.target_modules:
                out_features, in_features = module.weight.shape
                a = torch.randn(lora.rank, in_features, generator=g) * 0.3
                b = torch.randn(out_features, lora.rank, generator=g) * 0.3
                adapters += [(f"{name}.lora_A", a), (f"{name}.lora_B", b)]
                with torch.no_grad():  # the expected model: the merge done here, on HF weights
                    module.weight.add_(lora.alpha / lora.rank * b @ a)
        metas = [WeightMeta(n, tuple(t.shape), "float32") for n, t in adapters]
        port = free_port()
        join = worker.join_weight_sync.remote("127.0.0.1", port, 1, 3, "gloo", metas)
        group = init_group("127.0.0.1", port, 0, 3, "gloo", timeout_s=120)
        ray.get(join, timeout=120)
        received = worker.receive_weights.remote(1)
        send(group, [[adapters[i][1] for i in b] for b in buckets(metas)])
        ray.get(received, timeout=120)
        after = _greedy(worker, prompts)
        assert [s.completion_ids for s in after] != [s.completion_ids for s in before]
        for s, want in zip(after, _hf_logprobs(model, after)):
            assert s.logprobs == pytest.approx(want, abs=1e-4)
    finally:
        ray.kill(worker)
