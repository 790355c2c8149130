"""Issue 49: the Tinker-protocol service (launch/serve.py, the command line; launch/tinker/, the service).

Pure parts with hand-computed values (the losses, the seq-id gate, the config); our protobuf
messages against the SDK's own generated ones; the update of forward_backward + optim_step against
our trainer's objective; and the real `tinker` 0.38 SDK's client against the real service (Ray, the
vLLM fleet with LoRA, AdapterTrainer actors): every supported call, and hostile requests each
answered with the SDK's error while the rest goes on."""

from __future__ import annotations

import math
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from launch.tinker.futures import SeqGate, UserError
from rl.algo.datum_losses import DatumLoss, DatumLossError, datum_loss

# ---- the losses: sums over the datum's tokens, as the Tinker docs define them -------------------------

LOGP = torch.tensor([-1.0, -0.5, -2.0])
SAMPLER = torch.tensor([-1.0, -1.0, -1.0])  # ratios exp(0)=1, exp(0.5)=1.6487, exp(-1)=0.3679
ADV = torch.tensor([1.0, 2.0, -1.0])


def _loss(name, config=None, **inputs):
    value, per_token = datum_loss(DatumLoss.of(name, config), LOGP, inputs)
    return float(value), per_token.tolist()


def test_cross_entropy_is_minus_the_weighted_logprob_sum():
    value, per_token = _loss("cross_entropy", weights=torch.tensor([0.0, 1.0, 2.0]))
    assert per_token == pytest.approx([0.0, 0.5, 4.0])
    assert value == pytest.approx(4.5)


def test_importance_sampling_is_minus_ratio_times_advantage_unclipped():
    value, _ = _loss("importance_sampling", logprobs=SAMPLER, advantages=ADV)
    r = [1.0, math.exp(0.5), math.exp(-1.0)]
    assert value == pytest.approx(-(r[0] * 1 + r[1] * 2 + r[2] * -1), rel=1e-6)  # -4.6653


def test_ppo_clips_the_ratio_to_the_clients_bounds():
    # token 2: ratio 1.6487 clipped to 1.2 (A > 0: min picks 1.2*2); token 3: ratio 0.3679, A < 0:
    # min(-0.3679, -0.8) = -0.8 (clipped to the lower bound 0.8)
    value, per_token = _loss("ppo", None, logprobs=SAMPLER, advantages=ADV)
    assert per_token == pytest.approx([-1.0, -2.4, 0.8], rel=1e-6)
    assert value == pytest.approx(-2.6, rel=1e-6)
    wider, _ = _loss("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, logprobs=SAMPLER, advantages=ADV)
    assert wider == pytest.approx(-(1.0 + 2 * math.exp(0.5)) + 0.5, rel=1e-6)


def test_cispo_weighs_each_logprob_by_the_clipped_ratio():
    # weights clip(1, 1.6487, 0.3679) to [0.8, 1.2] = 1, 1.2, 0.8; loss = -sum w * A * logp
    value, _ = _loss("cispo", None, logprobs=SAMPLER, advantages=ADV)
    assert value == pytest.approx(-(1 * 1 * -1.0 + 1.2 * 2 * -0.5 + 0.8 * -1 * -2.0), rel=1e-6)


def test_gspo_uses_one_ratio_per_sequence_over_the_masked_tokens():
    # mask the first two tokens: mean log-ratio (0 + 0.5) / 2 = 0.25, s = 1.2840 for every token;
    # clipped to 1.2 where A > 0, kept at 1.2840 where A < 0 (min(-1.284, -1.2) = -1.284)
    mask = torch.tensor([1.0, 1.0, 0.0])
    value, _ = _loss("gspo", None, logprobs=SAMPLER, advantages=ADV, sequence_ratio_mask=mask)
    s = math.exp(0.25)
    assert value == pytest.approx(-(1.2 * 1 + 1.2 * 2) + s, rel=1e-5)


def test_dro_is_minus_logp_times_advantage_plus_half_beta_squared_log_ratio():
    # Tinker's docs: -(logp * A - beta / 2 * (logp - q)^2); log-ratios 0, 0.5, -1
    value, per_token = _loss("dro", {"beta": 0.1}, logprobs=SAMPLER, advantages=ADV)
    assert per_token == pytest.approx([1.0, 1.0 + 0.05 * 0.25, -2.0 + 0.05 * 1.0], rel=1e-6)
    assert value == pytest.approx(0.0625, rel=1e-5)
    assert _loss("dro", {"beta": 0.0}, logprobs=SAMPLER, advantages=ADV)[0] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name,config,words", [
    ("custom", None, "forward_backward_custom"),
    ("stable_reinforce", None, "stability information"),
    ("dro", None, r"needs loss_fn_config \['beta'\]"),
    ("dro", {"beta": -1.0}, "beta=-1.0 must be >= 0"),
    ("nonsense", None, "choose one of"),
    ("ppo", {"clip_eps": 0.2}, "clip_eps"),
    ("cross_entropy", {"clip_low_threshold": 0.8}, "takes none"),
    ("ppo", {"clip_low_threshold": 1.5}, "0 <= low <= 1 <= high"),
    ("ppo", {"clip_high_threshold": float("nan")}, "finite"),
])
def test_a_loss_the_service_cannot_compute_is_refused_naming_it(name, config, words):
    with pytest.raises(DatumLossError, match=words):
        DatumLoss.of(name, config)


# ---- calls in seq-id order ------------------------------------------------------------------------------

def test_seq_gate_runs_calls_in_number_order_whatever_order_they_arrive_in():
    gate, order = SeqGate(wait_s=10), []

    def call(n):
        gate.turn(n)
        order.append(n)
        gate.done(n)

    for n in (3, 2, 1):  # the SDK sends a split forward_backward's first chunk last
        gate.claim(n)
    threads = [threading.Thread(target=call, args=(n,)) for n in (3, 2, 1)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(10)
    assert order == [1, 2, 3]
    with pytest.raises(UserError, match="already used"):
        gate.claim(2)
    with pytest.raises(UserError, match="numbered from 1"):
        gate.claim(0)


def test_seq_gate_a_number_given_up_lets_the_next_call_in_at_once():
    """Issue 60.2: a call refused before it was queued (or not served: a 404) gives its number up,
    so the model's next call runs at once instead of failing after serve.seq_wait_s; a number a
    queued call holds is not taken from it."""
    gate = SeqGate(wait_s=30)
    gate.claim(2)
    gate.skip(1)  # seq 1 refused
    started = time.monotonic()
    gate.turn(2)
    assert time.monotonic() - started < 1
    gate.skip(2)  # a second request naming seq 2 (refused as a reuse) leaves it to the call holding it
    assert gate.next == 2
    gate.done(2)
    assert gate.next == 3
    for bad in (True, "3", None):
        gate.skip(bad)
    assert gate.next == 3


def test_seq_gate_close_ends_every_wait_at_once():
    """Issue 60.3: a stopping service leaves no thread waiting out serve.seq_wait_s."""
    gate, errors = SeqGate(wait_s=300), []
    gate.claim(5)

    def wait():
        try:
            gate.turn(5)
        except RuntimeError as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    started = time.monotonic()
    gate.close()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - started < 2
    assert "stopping" in str(errors[0])


def test_seq_gate_fails_a_call_whose_predecessor_never_comes():
    gate = SeqGate(wait_s=0.2)
    gate.claim(2)
    started = time.monotonic()
    with pytest.raises(UserError, match="seq_id=1, which never came"):
        gate.turn(2)
    assert time.monotonic() - started < 2


# ---- a sampler serves the weights saved last under its path (issue 60.1) -----------------------------------

def test_a_folder_saved_again_under_its_name_gets_a_new_lora_id_and_the_old_one_is_retired(tmp_path):
    """vLLM caches a loaded adapter by its integer id: a second save under the same name (same
    sizes, new numbers) must get a new id, or the engine samples the first save's weights."""
    pytest.importorskip("vllm")
    from rl.data.types import GenerationRequest
    from rollout.vllm_engine import AdapterRequests
    from trainer.adapter_trainer import swap_in

    folder = str(tmp_path / "sampler_weights" / "same-name")
    os.makedirs(os.path.dirname(folder))

    def save(payload: bytes) -> None:  # as AdapterTrainer.save_adapter writes one
        tmp = folder + "~tmp"
        os.makedirs(tmp)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(payload)
        swap_in(tmp, folder)

    adapters = AdapterRequests()
    req = GenerationRequest(prompt_ids=[1, 2], prompt_text="", group_id=0, sample_index=0, seed=0, adapter=folder)
    save(b"first save")
    first = adapters(req)
    assert adapters(req).lora_int_id == first.lora_int_id  # the same save: the same id (vLLM's cached copy)
    save(b"other bytes")  # the same sizes: only the files' identity tells the saves apart
    second = adapters(req)
    assert second.lora_int_id != first.lora_int_id and second.lora_path == folder
    assert adapters(req).lora_int_id == second.lora_int_id
    assert adapters.take_stale() == [first.lora_int_id] and adapters.take_stale() == []  # the engine unloads it
    assert sorted(os.listdir(os.path.dirname(folder))) == ["same-name"]  # nothing left beside it
    other = GenerationRequest(prompt_ids=[1], prompt_text="", group_id=0, sample_index=0, seed=0, adapter=str(tmp_path))
    assert adapters(other).lora_int_id not in (first.lora_int_id, second.lora_int_id)
    assert adapters(GenerationRequest(prompt_ids=[1], prompt_text="", group_id=0, sample_index=0, seed=0)) is None


# ---- a sampler's adapter merged into the engine's weights for its batch (issue 60.7) ---------------------

def _peft_adapter(model_dir: str, folder: str, seed: int):
    """A peft adapter on every linear layer, the LM head too, saved as AdapterTrainer saves one (rank 4,
    alpha 32), its B matrices random (a trained adapter's are not zero); returns the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.adapter_trainer import LORA_ALPHA, lora_targets, swap_in

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                            target_modules=lora_targets(base, True, True, True)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(folder + "~tmp")
    swap_in(folder + "~tmp", folder)  # a folder saved again: new files, as the service's saves are
    return model.eval()


def _peft_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp.tolist()


def _merged_engine_figures(model_dir: str, work: str, out) -> None:
    """(in a process of its own: a vLLM engine) Samples of the base model and of two adapters in one
    batch, the same after one adapter is saved again under its name, a missing adapter; each
    adapter's log-probs against its peft model's forward."""
    from rl.config.schema import ModelConfig, RolloutConfig
    from rl.data.types import GenerationRequest
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import VLLMEngine, vllm_env

    try:
        os.environ.update(vllm_env(1, 1))
        a_dir, b_dir = os.path.join(work, "a"), os.path.join(work, "b")
        a, b = _peft_adapter(model_dir, a_dir, 1), _peft_adapter(model_dir, b_dir, 2)
        rollout = RolloutConfig(max_new_tokens=6, max_model_len=64, enforce_eager=True, kv_cache_gib=1, max_loras=0)
        engine = VLLMEngine(RolloutSpec(ModelConfig(path=model_dir, dtype="float32"), rollout, seed=0, threads=1), 0)
        prompt = [1, 5, 6, 11, 7, 8, 10]

        def requests(adapters, prompt_logprobs=False):
            return [GenerationRequest(prompt_ids=prompt, prompt_text="", group_id=0, sample_index=i, seed=i,
                                      temperature=1.0, adapter=adapter, prompt_logprobs=prompt_logprobs and i == 0)
                    for i, adapter in enumerate(adapters)]

        def figures(samples, model):
            worst = 0.0
            for s in samples:
                theirs = _peft_logprobs(model, prompt, s.completion_ids)[-len(s.completion_ids):]
                worst = max(worst, float(np.max(np.abs(np.asarray(theirs) - np.asarray(s.logprobs)))))
            return worst

        base = engine.generate(requests([None] * 4))
        mixed = engine.generate(requests([a_dir, None, b_dir, a_dir, None, b_dir]))
        prompt_lp = engine.generate(requests([b_dir], prompt_logprobs=True))[0].prompt_logprobs  # b: kept merged
        base_after = engine.generate(requests([None] * 4))
        a_again = _peft_adapter(model_dir, a_dir, 3)  # the same name, other weights
        newer = engine.generate(requests([a_dir, a_dir]))
        gone = engine.generate(requests([os.path.join(work, "missing"), None]))
        out.put({
            "base_same": [(s.completion_ids, s.logprobs) for s in base] == [(s.completion_ids, s.logprobs)
                                                                            for s in base_after],
            "base_in_mixed": (mixed[1].completion_ids == base[1].completion_ids  # seed 1 in both
                              and np.allclose(mixed[1].logprobs, base[1].logprobs, atol=1e-5)),
            "a": figures([mixed[0], mixed[3]], a), "b": figures([mixed[2], mixed[5]], b),
            "a_vs_base": figures(base[:2], a), "newer": figures(newer, a_again), "newer_vs_old": figures(newer, a),
            "prompt_lp": float(np.max(np.abs(np.asarray(prompt_lp[1:]) - np.asarray(_peft_logprobs(b, prompt, [])))))
            if prompt_lp else None,
            "gone": [s.error for s in gone], "merges": engine._merged.merges,
        })
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        import traceback

        out.put({"error": traceback.format_exc() or repr(err)})


@pytest.mark.slow
def test_a_merged_adapter_samples_its_own_logprobs_and_leaves_the_base_exactly(tiny_untrained, tmp_path):
    """rollout.max_loras=0 (the service on CPU): requests of two adapters and of the base model in one
    batch each get their own weights (log-probs = peft's forward with that adapter, within 1e-4); the
    base model's samples are bit for bit those of a batch with no adapter, before and after; an adapter
    saved again under its name is served fresh; a missing folder is that request's error only."""
    pytest.importorskip("vllm")
    from bench.tinker_adapter_sampling import in_spawned_process

    got = in_spawned_process(_merged_engine_figures, f"{tiny_untrained}/model", str(tmp_path), timeout_s=600)
    assert got["base_same"] and got["base_in_mixed"], got
    assert got["a"] < 1e-4 and got["b"] < 1e-4 and got["a_vs_base"] > 1e-3, got
    assert got["newer"] < 1e-4 and got["newer_vs_old"] > 1e-3, got  # the second save, not the first
    assert got["prompt_lp"] is not None and got["prompt_lp"] < 1e-4, got
    assert got["gone"][0] and "missing" in got["gone"][0] and got["gone"][1] is None, got
    assert got["merges"] == 3, got  # a, b, then a's second save (b's next batch reused its merged layers)


# ---- what a sample call may ask, named with the numbers it broke (issue 60.5) ------------------------------

@pytest.fixture
def submit_only_service(tiny_untrained, tmp_path):
    """A TinkerService over the tiny model's tokenizer with no fleet and no trainers: only what is
    checked at submission, before anything would reach them (a refused call never does)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from launch.tinker.service import TinkerService
    from rl.config.compose import compose

    model = f"{tiny_untrained}/model"
    cfg = OmegaConf.to_object(compose("serve", [f"model.path={model}"]))
    service = TinkerService(cfg, None, AutoTokenizer.from_pretrained(model), model, str(tmp_path), None, log=lambda _: None)
    yield service
    service.close()


def test_a_prompt_over_the_context_is_refused_naming_its_length_and_the_context(submit_only_service):
    service = submit_only_service
    sid = service.registry.create_session()
    sampler = service.create_sampler(sid, 0, service.model_name, None)

    def refusal(tokens, **params):
        with pytest.raises(UserError) as err:
            service.sample({"sampling_session_id": sampler, "prompt": {"chunks": [{"tokens": tokens}]},
                            "num_samples": 1, "sampling_params": params})
        return str(err.value)

    long = refusal([5] * 80, max_tokens=8)
    assert "80 tokens" in long and "context of 64 tokens" in long and "at most 63" in long
    assert "[1, 0]" not in long
    over = refusal([5] * 60, max_tokens=8)
    assert "max_tokens=8" in over and "60 tokens" in over and "64" in over and "at most 4" in over
    assert "positive integer" in refusal([5] * 4, max_tokens=0)
    with pytest.raises(UserError, match="stability information"):
        service.sample({"sampling_session_id": sampler, "prompt": {"chunks": [{"tokens": [5, 6]}]},
                        "sampling_params": {"max_tokens": 2}, "record_stability_info": True})


def test_the_http_app_serves_its_routes_in_process(submit_only_service):
    """The FastAPI app over a service, called in process (no Ray, no fleet): the app is built, the
    key is checked, and the calls that need no model answer. (A renamed service attribute once
    broke every start of `launch.serve` and only the full lane's SDK tests saw it.)"""
    from fastapi.testclient import TestClient

    from launch.tinker.app import make_app

    service = submit_only_service
    service.serve.api_key = "tml-k"
    client = TestClient(make_app(service))
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}
    assert client.post("/api/v1/create_session", json={}).status_code == 401  # no key
    assert client.post("/api/v1/create_session", json={}, headers={"x-api-key": "tml-other"}).status_code == 401
    key = {"x-api-key": "tml-k"}
    models = client.get("/api/v1/get_server_capabilities", headers=key).json()["supported_models"]
    assert models[0]["model_name"] == service.model_name and models[0]["max_context_length"] == service.max_len
    session = client.post("/api/v1/create_session", json={}, headers=key).json()
    assert session["type"] == "create_session" and session["session_id"]
    runs = client.get("/api/v1/training_runs", headers=key).json()
    assert runs["training_runs"] == [] and runs["cursor"]["total_count"] == 0
    assert client.get("/api/v1/training_runs/nope", headers=key).status_code == 404


# ---- the config, before Ray ------------------------------------------------------------------------------

@pytest.mark.parametrize("override,field", [
    ("serve.host=example.org", "serve.host"),
    ("serve.host=0.0.0.0", "serve.api_key"),
    ("serve.api_key=secret", "serve.api_key"),
    ("serve.poll_s=60", "serve.poll_s"),
    ("serve.port=70000", "serve.port"),
    ("rollout.backend=hf", "rollout.backend"),
    ("rollout.max_loras=0", "rollout.max_loras"),
    ("serve.adapter_sampling=fast", "serve.adapter_sampling"),
    ("serve.adapter_sampling=lora rollout.max_loras=0", "rollout.max_loras"),
    ("rollout.max_lora_rank=8", "rollout.max_lora_rank"),
    ("model.lora.rank=8", "model.lora.rank"),
    ("serve.max_models=0", "serve.max_models"),
    ("cluster.worker_niceness=20", r"cluster.worker_niceness=20: must be in [0, 19]"),
])
def test_bad_serve_config_is_refused_naming_the_field(override, field):
    from rl.config.compose import compose
    from rl.config.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape(field)):
        compose("serve", override.split())


def test_the_default_serve_config_is_valid():
    from rl.config.compose import compose
    from rl.config.serve import adapters_merged

    cfg = compose("serve")
    assert cfg.serve.host == "127.0.0.1" and cfg.rollout.max_loras >= 1
    # adapters merged into the engine's weights on CPU (issue 60.7), vLLM's LoRA where CUDA is
    assert cfg.serve.adapter_sampling == "auto"
    assert adapters_merged("auto", cuda=False) and not adapters_merged("auto", cuda=True)
    assert adapters_merged("merged", cuda=True) and not adapters_merged("lora", cuda=False)
    assert compose("serve", ["serve.adapter_sampling=merged", "rollout.max_loras=0"]).rollout.max_loras == 0


# ---- the binary messages against the SDK's own -----------------------------------------------------------

def test_our_protobuf_messages_read_and_write_what_the_sdk_does():
    pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from launch.tinker import proto

    request = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=3, loss_fn="ppo", forward_only=True)
    request.loss_fn_config["clip_low_threshold"] = 0.7
    request.loss_fn_config_v2["clip_high_threshold"].number = 1.3
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7], "<i4").tobytes()
    t = datum.loss_fn_inputs["target_tokens"]
    t.dense, t.dtype = np.array([6, 7, 8], "<i8").tobytes(), pb.DTYPE_INT64
    t.shape.append(3)
    m = proto.decode_forward_backward(request.SerializeToString())
    assert (m.model_id, m.seq_id, m.loss_fn, m.forward_only) == ("s:train:0", 3, "ppo", True)
    assert proto.loss_config_of(m) == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    assert proto.tokens_of(m.data[0].model_input, "d") == [5, 6, 7]
    assert proto.tensor_from_proto(m.data[0].loss_fn_inputs["target_tokens"], "t").tolist() == [6, 7, 8]
    with pytest.raises(proto.WireError):
        proto.decode_forward_backward(b"\xff\xff\xff not a message")

    out = deserialize_forward_backward_output(proto.encode_forward_backward(
        [{"logprobs": torch.tensor([-1.0, -2.0])}, {"logprobs": torch.tensor([-3.0])}], {"loss:sum": 6.0}))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert out.metrics == {"loss:sum": 6.0}
    sample = deserialize_sample_response(proto.encode_sample([([4, 5], [-0.25, -0.5], "stop"), ([6], [-1.0], "length")],
                                                             [None, -1.5]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == \
        [([4, 5], [-0.25, -0.5], "stop"), ([6], [-1.0], "length")]
    assert sample.prompt_logprobs == [None, -1.5]


# ---- numbers agree: the service's update is our trainer's objective's ---------------------------------------

@pytest.mark.slow
def test_forward_backward_and_optim_step_make_our_objectives_update(tiny_untrained):
    """forward_backward + optim_step of AdapterTrainer, for ppo, cispo and importance_sampling in
    turn, against the same batch through rl.algo.objective.policy_objective (seq_mean_token_sum:
    Tinker's sum over tokens and data is 3 rows x ours) and torch AdamW on a peft copy holding the
    same adapters: the loss, the returned log-probs, the gradients (x 3) and the adapters after the
    step agree within fp32 noise, and the step moved them."""
    import copy

    from trainer.adapter_trainer import AdapterSpec, AdapterTrainer, Datum
    from trainer.engine import restored_dist_env

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 16, (n,), generator=gen).tolist() for n in (9, 7, 11)]
    data = []
    for seq in rows:
        n = len(seq) - 1
        adv = torch.zeros(n)
        adv[3:] = torch.randn(n - 3, generator=gen)
        data.append(Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:]), "advantages": adv,
                                     "logprobs": -2.5 + 0.3 * torch.randn(n, generator=gen)}))
    with restored_dist_env():
        trainer = AdapterTrainer(AdapterSpec(base_path=f"{tiny_untrained}/model", base_model="tiny", rank=4,
                                             train_unembed=False, seed=3))
        for i, (loss, policy_loss) in enumerate((("ppo", "ppo_clip"), ("cispo", "cispo"),
                                                  ("importance_sampling", None))):
            # the step itself is compared on the first (later ones start from Adam's moments)
            _same_update(trainer, copy.deepcopy(trainer.engine.module), rows, data, loss, policy_loss, step=i == 0)


def _same_update(trainer, peft_model, rows, data, loss, policy_loss, step):
    from rl.algo.losses import LossNormalizer
    from rl.algo.objective import policy_objective
    from rl.config.schema import AlgorithmConfig
    from trainer.logprobs import token_logprobs

    initial = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    out = trainer.forward_backward(data, loss, {})
    grads = {n: p.grad.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}
    trainer.optim_step(learning_rate=1e-2, eps=1e-12)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    adam = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    width = max(len(s) for s in rows)
    ids, am = torch.zeros((3, width), dtype=torch.long), torch.zeros((3, width), dtype=torch.long)
    old, adv, mask = (torch.zeros((3, width - 1)) for _ in range(3))
    for i, (seq, d) in enumerate(zip(rows, data)):
        ids[i, :len(seq)], am[i, :len(seq)] = torch.tensor(seq), 1
        old[i, :len(seq) - 1], adv[i, :len(seq) - 1] = d.inputs["logprobs"], d.inputs["advantages"]
        mask[i, :len(seq) - 1] = 1
    logp, _ = token_logprobs(peft_model, ids, am)
    algo = AlgorithmConfig(policy_loss=policy_loss or "ppo_clip", loss_agg="seq_mean_token_sum",
                           importance_correction="none", kl_coef=0.0,
                           **({"clip_eps_low": 0.2, "clip_eps_high": 0.2} if policy_loss else
                              {"clip_eps_low": math.inf, "clip_eps_high": math.inf}))
    ours = policy_objective(logp, old, old, adv, mask, algo, LossNormalizer.of(mask), kl_coef=0.0)
    assert float(ours.loss.detach()) * 3 == pytest.approx(out["metrics"]["loss:sum"], rel=1e-4, abs=1e-5), loss
    for d, o, row in zip(data, out["outputs"], logp):  # the returned log-probs are the targets'
        assert torch.allclose(o["logprobs"], row[:len(d.tokens)].detach(), atol=1e-5), loss
    ours.loss.backward()
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            scale = float(p.grad.abs().max()) * 3
            assert float((grads[name] - 3 * p.grad).abs().max()) <= 1e-4 * scale + 1e-8, (loss, name)
    if not step:
        return
    adam.step()
    trained = {n: p for n, p in trainer.engine.module.named_parameters() if p.requires_grad}
    moved = 0.0
    for name, p in peft_model.named_parameters():
        if p.requires_grad:  # where the gradient is not ~0 (there Adam's first step is the sign of noise)
            real = grads[name].abs() > 1e-4 * grads[name].abs().max()
            assert torch.allclose(trained[name][real], p[real], atol=1e-6), (loss, name)
            moved = max(moved, float((p - initial[name]).abs().max()))
    assert moved > 1e-3, loss  # the step moved the adapters (Adam's first step: about lr)


# ---- a full service evicts the idle model; a session gone drops its queued calls (issue 60.6) ------------

class _FakeTrainers:
    """start_trainer for a TinkerService without Ray: each 'actor' records the calls it ran."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []  # (model id, method)
        self.started: list[str] = []

    def __call__(self, spec, name):
        trainers = self

        class Handle:
            def __getattr__(self, method):
                def remote(*args, **kwargs):
                    trainers.calls.append((name, method))
                    if method in ("save_state", "save_adapter"):
                        os.makedirs(args[0], exist_ok=True)
                    return {"grad_norm": 0.0, "learning_rate": kwargs.get("learning_rate", 0.0)}
                return type("Remote", (), {"remote": staticmethod(remote)})()

        class Group:
            handles = [Handle()]
            down = False

            def each(self, refs, kind, timeout_s):
                return refs

            def shutdown(self):
                Group.down = True

        self.started.append(name)
        return Group()


def test_a_full_service_evicts_the_idle_model_and_a_session_gone_drops_its_queued_calls(tiny_untrained, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from launch.tinker.service import TinkerService
    from rl.config.compose import compose

    model = f"{tiny_untrained}/model"
    cfg = OmegaConf.to_object(compose("serve", [f"model.path={model}", "serve.max_models=1", "serve.seq_wait_s=60"]))
    trainers = _FakeTrainers()
    service = TinkerService(cfg, None, AutoTokenizer.from_pretrained(model), model, str(tmp_path), trainers,
                            log=lambda _: None)
    try:
        sid = service.registry.create_session()
        result = lambda rid: service.futures.get(rid)[0].result(10)  # noqa: E731
        result(service.create_model(sid, 0, service.model_name, {"rank": 4}))
        a = service.registry.models[f"{sid}:train:0"]
        result(service.create_model(sid, 1, service.model_name, {"rank": 4}))  # full: the idle one is evicted
        b = service.registry.models[f"{sid}:train:1"]
        assert a.state == "evicted" and a.group is None and (a.id, "save_state") in trainers.calls
        assert b.state == "live"
        result(service.optim_step(a.id, 1, {"learning_rate": 1e-3}))  # a comes back from its state; b goes
        assert a.state == "live" and b.state == "evicted" and trainers.started == [a.id, b.id, a.id]
        assert trainers.calls[-2:] == [(a.id, "load_state"), (a.id, "optim_step")]
        queued = service.optim_step(a.id, 3, {"learning_rate": 1e-3})  # waits for seq_id 2: a is busy
        with pytest.raises(UserError, match="alive and busy") as full:
            service.create_model(sid, 2, service.model_name, {"rank": 4})
        assert full.value.status == 429
        service.registry.sessions[sid].last_seen -= cfg.serve.session_timeout_s + 1  # the client stopped heartbeating
        started = time.monotonic()
        assert service.expire() == [sid]
        with pytest.raises(UserError, match="dropped"):
            service.futures.get(queued)[0].result(10)
        assert time.monotonic() - started < 5 and trainers.calls.count((a.id, "optim_step")) == 1  # never computed
        assert not service.registry.models and not os.path.exists(os.path.dirname(b.evicted_to))  # its saved state removed
    finally:
        service.close()


def test_run_resume_takes_a_services_run_dir_of_the_same_base_model_only(tiny_untrained, tmp_path):
    """Issue 60.4, before Ray: a run.dir that holds a run is refused unless run.resume=true; a resumed
    one must hold a service's weights (tinker/) trained on the base model it serves now."""
    import json

    from launch.serve import check_serve
    from rl.config.compose import compose

    model = f"{tiny_untrained}/model"
    run_dir = tmp_path / "run"
    (run_dir / "tinker" / "sess-1_train_0").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    args = [f"model.path={model}", f"run.dir={run_dir}"]
    with pytest.raises(FileExistsError, match="already holds a run"):
        check_serve(compose("serve", args))
    assert check_serve(compose("serve", args + ["run.resume=true"])) == os.path.abspath(model)
    (run_dir / "tinker" / "sess-1_train_0" / "run.json").write_text(json.dumps({"base_model": "other/model"}))
    with pytest.raises(ValueError, match="other/model"):
        check_serve(compose("serve", args + ["run.resume=true"]))
    with pytest.raises(FileNotFoundError, match="no Tinker service run"):
        check_serve(compose("serve", [f"model.path={model}", f"run.dir={tmp_path / 'empty'}", "run.resume=true"]))
