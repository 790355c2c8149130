"""The rollout fleet on real engines: vLLM (CPU) and HF generate behind one protocol."""

from __future__ import annotations

import pytest
import torch

from rl.config.schema import ModelConfig, RolloutConfig
from rl.data.dataset import PromptDataset
from rl.data.types import GenerationRequest
from rollout.fleet import RolloutFleet, split_by_group
from rollout.protocol import RolloutSpec
from rollout.vllm_engine import vllm_env

pytestmark = pytest.mark.slow


def _requests(tiny_dir, n=4, prompts=6):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f"{tiny_dir}/model")
    data = PromptDataset([f"{tiny_dir}/data/train.jsonl"], "prompt", tok, seed=0, max_prompt_tokens=32)
    return tok, data.requests(0, prompts, n)


def test_split_keeps_groups_whole(tiny_dir):
    _, reqs = _requests(tiny_dir, n=4, prompts=5)
    chunks = split_by_group(reqs, 2)
    assert sum(map(len, chunks)) == 20 and all(chunks)
    assert not {r.group_id for r in chunks[0]} & {r.group_id for r in chunks[1]}


# vLLM's case is the full lane's (24 s): every default-lane run checks vLLM's log-probs against the learner's
@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=pytest.mark.full), "hf"])
def test_fleet_generates_groups_with_logprobs(ray_local, tiny_dir, backend):
    tok, reqs = _requests(tiny_dir)
    env = {"OMP_NUM_THREADS": "1"}
    if backend == "vllm":
        env.update(vllm_env(1, 1))
    rollout = RolloutConfig(backend=backend, num_workers=2, temperature=1.0, top_p=1.0, max_new_tokens=6,
                            max_model_len=64, enforce_eager=True, kv_cache_gib=1)
    spec = RolloutSpec(ModelConfig(path=f"{tiny_dir}/model", dtype="float32"), rollout, seed=0, threads=1)
    fleet = RolloutFleet(spec, num_cpus=1, env_vars=env)
    try:
        samples = fleet.generate(reqs)
        again = fleet.generate(reqs)
        # requests the engine refuses (a token id outside the vocabulary, a temperature vLLM refuses)
        # are their own error samples, beside good ones; no worker is lost
        bad = [GenerationRequest([10**9, 1], "", 99, 0, seed=1),
               GenerationRequest(list(reqs[0].prompt_ids), "", 98, 0, seed=1, temperature=3.0)]
        mixed = fleet.generate(reqs[:2] + bad)
        fleet.submit(reqs[:2])  # a stream: every engine has submit/drain
        streamed = []
        while len(streamed) < 2:
            streamed += fleet.drain(0.5)
        restarts = fleet.restarts
    finally:
        fleet.shutdown()
    assert all(s.error and s.error.startswith("the rollout engine refused this request") for s in mixed[2:]), mixed[2:]
    assert mixed[2].completion_ids == [] and restarts == 0 and all(s.error is None for s in mixed[:2] + streamed)
    assert sorted((s.group_id, s.sample_index) for s in streamed) == [(r.group_id, r.sample_index) for r in reqs[:2]]
    if backend == "vllm":  # per-request seeds: the same tokens whatever the batch (HF seeds a whole batch)
        assert [s.completion_ids for s in mixed[:2]] == [s.completion_ids for s in samples[:2]]
        assert sorted(s.completion_ids for s in streamed) == sorted(s.completion_ids for s in samples[:2])
    assert [(s.group_id, s.sample_index) for s in samples] == [(r.group_id, r.sample_index) for r in reqs]
    eos = tok.eos_token_id
    for s in samples:
        assert 1 <= len(s.completion_ids) <= 6 and len(s.logprobs) == len(s.completion_ids)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.finish_reason == ("stop" if s.completion_ids[-1] == eos else "length")
        assert s.completion_text == tok.decode(s.completion_ids, skip_special_tokens=True)
        assert s.policy_version == 0 and "answer" in s.metadata
    # sampling is stochastic across a group, yet reproducible from the per-request seeds
    assert len({tuple(s.completion_ids) for s in samples}) > 1
    assert [s.completion_ids for s in samples] == [s.completion_ids for s in again]
    # the reported log-probs are those of the model that sampled them
    from transformers import AutoModelForCausalLM

    from trainer.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(f"{tiny_dir}/model").eval()
    s = samples[0]
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    assert lp[0, len(s.prompt_ids) - 1 :].tolist() == pytest.approx(s.logprobs, abs=1e-4)


class _TransferRounds:
    """What vLLM 0.32's workers do with weight-transfer rounds (v1/worker/gpu_worker.py): a round
    must be finished before the next starts, and a chunk that fails to load ends the round."""

    def __init__(self):
        self.active, self.calls, self.fail_next_chunk = False, [], False

    def start_weight_update(self):
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.active = True
        self.calls.append("start")

    def update_weights(self, info):
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights")
        if self.fail_next_chunk:
            self.fail_next_chunk, self.active = False, False
            raise RuntimeError("chunk failed")
        self.calls.append("chunk")

    def finish_weight_update(self):
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self.active = False
        self.calls.append("finish")

    def reset_prefix_cache(self):
        self.calls.append("reset")


def test_weight_transfer_rounds_cut_short_by_the_trainer_or_by_vllm_both_resume():
    """A round the trainer left open (a peer died mid-sync) is finished before the next; a round
    vLLM closed itself (a chunk failed to load) is not finished twice."""
    from rl.wire.ipc import IpcReceiver
    from rollout.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)  # the round bookkeeping only: no model loaded
    engine.llm, engine._ipc, engine._needs_fixup, engine.version = _TransferRounds(), IpcReceiver(), False, 0
    engine._merged = None  # no adapter merged (the Tinker service's merged sampling)
    rounds = engine.llm
    engine.weight_transfer("start_weight_update")
    engine.weight_transfer("update_weights", {"chunk": 0})  # ...then the trainer's side is lost
    engine.weight_transfer("start_weight_update")            # the next round closes that one first
    rounds.fail_next_chunk = True
    with pytest.raises(RuntimeError, match="chunk failed"):
        engine.weight_transfer("update_weights", {"chunk": 0})
    engine.weight_transfer("start_weight_update")            # vLLM closed it: nothing to finish
    engine.weight_transfer("update_weights", {"chunk": 0})
    engine.weight_transfer("finish_weight_update", version=3)
    assert rounds.calls == ["start", "chunk", "finish", "start", "start", "chunk", "finish", "reset"]
    assert engine.version == 3 and not engine._ipc.open
