"""The GPU paths, on a real GPU: `pytest -m gpu` on a machine with CUDA and the CUDA build
(`RLPOST_EXTRA=cuda bash launch/install.sh`). Without CUDA every test here is skipped (reported as
skipped, never passed). Placement logic that needs no CUDA is tested on CPU with Ray's logical
GPUs (tests/test_gpu_placement.py).

On the real model (tests/conftest.py `smollm2`): vLLM's CUDA build answers like transformers;
GRPO steps on the GPU keep learner and rollout log-probs together after every weight sync (NCCL
between two GPUs, or through the object store when one GPU holds both roles: NCCL refuses two
ranks of a group on one device); LoRA adapter syncs; sleep mode between steps; the hybrid
placement (learner and engine on one GPU in turns, CUDA IPC sync) with the GPU's peak memory
measured; an NCCL sync whose receiver is stopped mid-run recovers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pytest -m gpu on a GPU machine)")]

FP32_TOLERANCE = 1e-3
BF16_TOLERANCE = 0.05


def _gpus() -> int:
    return torch.cuda.device_count()


def _placement() -> list[str]:
    """Learner and rollout worker on a GPU each when there are two, else sharing the one."""
    if _gpus() >= 2:
        return ["cluster.gpus_per_learner=1", "cluster.gpus_per_rollout_worker=1"]
    return ["cluster.gpus_per_learner=0.5", "cluster.gpus_per_rollout_worker=0.5", "trainer.weight_sync=object_store",
            "rollout.gpu_memory_utilization=0.4"]


def _run(smollm2: str, math_data: str, run_dir: str, *overrides: str) -> list[dict]:
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config

    cfg = compose_config(["model=smollm2", "task=math_chat", f"model.path={smollm2}",
                          f"task.train_files=[{math_data}/train.jsonl]", "eval.files=[]", "task.prompts_per_step=4",
                          "rollout.n=4", "rollout.max_new_tokens=32", "run.save_every=0",
                          "run.save_final_model=false", "run.progress=false", f"run.dir={run_dir}", *_placement(),
                          *overrides])
    train(cfg)
    return [m for m in read_metrics(cfg.run.dir) if "time/step_s" in m]


def test_vllm_cuda_answers_like_transformers(smollm2):
    """The CUDA build of vLLM in a rollout worker given a GPU gives transformers' greedy tokens."""
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.config.schema import ModelConfig, RolloutConfig
    from rl.data.types import GenerationRequest
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from tests.conftest import own_ray

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3? Reply with just the number."}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False)
    hf_ids = out[0, len(prompt):].tolist()
    del model
    torch.cuda.empty_cache()
    spec = RolloutSpec(ModelConfig(path=smollm2, dtype="float32"), RolloutConfig(max_new_tokens=16, max_model_len=128),
                       seed=0, gpu=True)
    own_ray()
    try:
        fleet = RolloutFleet(spec, num_cpus=1, num_gpus=1)
        (sample,) = fleet.generate([GenerationRequest(prompt, "", 0, 0, seed=0, temperature=0.0)])
        where = fleet.where[0]
    finally:
        ray.shutdown()
    assert where["device"] == "cuda" and len(where["gpus"]) == 1
    assert sample.completion_ids == hf_ids[: len(sample.completion_ids)]


@pytest.mark.parametrize("dtype,tolerance", [("float32", FP32_TOLERANCE), ("bfloat16", BF16_TOLERANCE)])
def test_grpo_steps_on_the_gpu_keep_learner_and_rollout_together(smollm2, math_data, tmp_path, dtype, tolerance):
    metrics = _run(smollm2, math_data, str(tmp_path / "run"), f"model.dtype={dtype}", "run.steps=3")
    diffs = [m["sync/logprob_abs_diff"] for m in metrics]
    print(dtype, "learner-rollout mismatch per step:", diffs)
    assert len(metrics) == 3 and all(d < tolerance for d in diffs)


def test_lora_adapter_syncs_on_the_gpu(smollm2, math_data, tmp_path):
    metrics = _run(smollm2, math_data, str(tmp_path / "run"), "model.dtype=bfloat16", "model.lora.rank=8",
                   "algorithm.lr=5e-3", "run.steps=3")
    assert metrics[1]["sync/weights_mb"] < 5 and all(m["sync/logprob_abs_diff"] < BF16_TOLERANCE for m in metrics)


def test_engine_sleeps_between_steps_and_wakes_with_the_new_weights(smollm2, math_data, tmp_path):
    """vLLM's sleep mode (CUDA only), on a fleet driven as the loop drives it: asleep, the engine
    gives back at least its weights' memory (device-wide free memory, read by the driver); woken
    for the sync, it loads new weights (the final norm scaled by 1.5: every logit x1.5, so the
    greedy tokens stay and their log-probs sharpen), and its log-probs of those tokens are the new
    model's, not the old one's. Then GRPO steps with sleep
    mode on keep learner and rollout together."""
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.config.schema import ModelConfig, RolloutConfig
    from rl.data.types import GenerationRequest
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from tests.conftest import own_ray

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    new = {k: (v * 1.5 if k == "model.norm.weight" else v) for k, v in model.state_dict().items()}
    spec = RolloutSpec(ModelConfig(path=smollm2, dtype="bfloat16"),
                       RolloutConfig(max_new_tokens=8, max_model_len=256, sleep_between_steps=True,
                                     gpu_memory_utilization=0.3), seed=0, gpu=True)
    request = GenerationRequest(prompt, "", 0, 0, seed=0, temperature=0.0)
    own_ray()
    try:
        fleet = RolloutFleet(spec, num_cpus=1, num_gpus=1)
        before = fleet.generate([request])[0]
        awake_free = torch.cuda.mem_get_info()[0]
        fleet.sleep()
        asleep_free = torch.cuda.mem_get_info()[0]
        fleet.wake(("weights",))
        ray.get(fleet.workers[0].load_weights_from_object.remote(new, 1))
        fleet.wake()
        again = fleet.generate([request])[0]
    finally:
        ray.shutdown()
    freed = asleep_free - awake_free
    print(f"asleep: {freed / 2**20:.0f} MiB freed (weights {weight_bytes / 2**20:.0f} MiB)")
    assert freed >= weight_bytes, (freed, weight_bytes)
    # the new weights' log-probs of the tokens sampled before, by transformers
    model.load_state_dict(new)
    ids = torch.tensor([prompt + before.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    expected = logp.gather(-1, torch.tensor(before.completion_ids)[:, None])[:, 0]
    assert again.completion_ids == before.completion_ids  # x1.5 logits: the same greedy tokens
    served = torch.tensor(again.logprobs)
    old = torch.tensor(before.logprobs)
    assert (served - expected).abs().mean() < BF16_TOLERANCE < (old - expected).abs().mean(), \
        (served, expected, old)

    metrics = _run(smollm2, math_data, str(tmp_path / "run"), "model.dtype=bfloat16", "rollout.sleep_between_steps=true",
                   "run.steps=3")
    assert len(metrics) == 3 and all(m["sync/logprob_abs_diff"] < BF16_TOLERANCE for m in metrics)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs: 2 learner ranks and a rollout worker")
def test_two_learner_ranks_reduce_on_their_gpus(smollm2, math_data, tmp_path):
    """ZeRO-2 over 2 ranks with NCCL as DeepSpeed's default group: the loss normaliser and the
    token-budget micro-batches reduce over ranks (tensors on the ranks' GPUs: NCCL has no CPU)."""
    metrics = _run(smollm2, math_data, str(tmp_path / "run"), "model.dtype=bfloat16", "trainer.num_workers=2",
                   "trainer.max_tokens_per_micro_batch=2048", "run.steps=2")
    assert len(metrics) == 2 and all(m["sync/logprob_abs_diff"] < BF16_TOLERANCE for m in metrics)


class PeakGpuMemory:
    """The most memory in use on GPU 0 (every process), sampled from the driver while a run goes."""

    def __init__(self, every_s: float = 0.05):
        import threading

        self.peak, self.total, self._stop = 0, torch.cuda.mem_get_info(0)[1], threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)

    def _sample(self, every_s: float) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(0)
            self.peak = max(self.peak, total - free)
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


HYBRID = ["cluster.placement_mode=hybrid", "cluster.gpus_per_learner=1", "cluster.gpus_per_rollout_worker=1",
          "trainer.weight_sync=ipc", "rollout.sleep_between_steps=true", "rollout.gpu_memory_utilization=0.85"]


@pytest.mark.parametrize("dtype,tolerance", [("float32", FP32_TOLERANCE), ("bfloat16", BF16_TOLERANCE)])
def test_hybrid_placement_shares_one_gpu_in_turns(smollm2, math_data, tmp_path, dtype, tolerance):
    """cluster.placement_mode=hybrid on one GPU: the engine takes 85% of the card while it
    generates and sleeps (level 2) while the learner trains; the learner offloads its states
    (DeepSpeed offload_states) before the engine wakes; weights move by CUDA IPC (vLLM's ipc
    engine). Several steps and a checkpoint stay below the card, and learner and rollout
    log-probs agree after every IPC sync."""
    with PeakGpuMemory() as memory:
        metrics = _run(smollm2, math_data, str(tmp_path / "run"), *HYBRID, f"model.dtype={dtype}", "run.steps=4",
                       "run.save_every=2")
    diffs = [m["sync/logprob_abs_diff"] for m in metrics]
    print(f"hybrid {dtype}: peak GPU memory {memory.peak / 2**30:.2f} of {memory.total / 2**30:.2f} GiB; "
          f"mismatch {diffs}; step s {[round(m['time/step_s'], 2) for m in metrics]}; "
          f"sync s {[round(m['time/sync_s'], 3) for m in metrics]}")
    assert len(metrics) == 4 and all(d < tolerance for d in diffs)
    assert memory.peak < memory.total


STOP_RECEIVER = '''
import json, os, signal

from reward.builtin import math_answer


def stop_the_rollout_worker(prompts, completions, run_dir, at_call, **kwargs):
    """At the `at_call`-th call (after that step's rollout, before its weight sync) SIGSTOP the
    rollout worker: the sync that follows finds its receiver stopped."""
    count = os.path.join(run_dir, "reward_calls")
    calls = int(open(count).read()) + 1 if os.path.exists(count) else 1
    open(count, "w").write(str(calls))
    if calls == at_call:
        actors = json.load(open(os.path.join(run_dir, "actors.json")))
        os.kill(next(a["pid"] for a in actors if a["role"] == "rollout"), signal.SIGSTOP)
    return math_answer(prompts, completions, **kwargs)
'''


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: an NCCL sync between two processes")
def test_nccl_sync_recovers_from_a_stopped_receiver(smollm2, math_data, tmp_path, capsys):
    """A rollout worker SIGSTOPped right before a weight sync over NCCL: learner rank 0's
    broadcast raises at its per-sync wait (NCCL's plain wait would only queue it and the next
    kernels would hang behind it), the worker is replaced, the group made again (the old
    communicator aborted) and the run completes."""
    reward = tmp_path / "stop_receiver.py"
    reward.write_text(STOP_RECEIVER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = _run(smollm2, math_data, str(run_dir), "model.dtype=bfloat16", "run.steps=4", "run.call_timeout_s=20",
                   f'reward.functions=[{{fn: "{reward}:stop_the_rollout_worker", '
                   f'kwargs: {{run_dir: "{run_dir}", at_call: 2}}}}]')
    out = capsys.readouterr().out
    print(out[-3000:])
    assert "rollout worker 0" in out and "failed during weight sync" in out and "replacing it" in out
    assert len(metrics) == 4 and all(m["sync/logprob_abs_diff"] < BF16_TOLERANCE for m in metrics)
