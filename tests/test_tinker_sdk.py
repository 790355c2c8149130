"""Issue 49: the real `tinker` 0.38 SDK client against the real service (`python -m launch.serve` in
its own process: Ray, the vLLM fleet with LoRA, one AdapterTrainer actor per training model), on
the untrained tiny model. Every supported call; two clients training at once stay isolated; hostile
requests each get the SDK's error and harm nothing else. Full lane: the service and its training
models start in ~60 s each on 2 cores (the default lane's budget, issue 45)."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from tests.serve_proc import serving

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.full
KEY = "tml-test-key"


@pytest.fixture(scope="module")
def service(tiny_untrained, tmp_path_factory):
    """(base URL, model path, run.dir) of a service started as its users start it, stopped after the module."""
    model = os.path.join(tiny_untrained, "model")
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    os.environ["TINKER_API_KEY"] = KEY
    stopped: dict = {}
    with serving([f"model.path={model}", f"serve.api_key={KEY}", "serve.seq_wait_s=5",
                  "serve.max_tokens_per_request=4000", "serve.max_models=6", f"run.dir={run_dir}"],
                 run_dir.parent / "serve.log", stopped=stopped) as url:
        yield url, model, run_dir
    # stopped (SIGTERM): within seconds, and the run directory holds what launch.train's does
    assert stopped["returncode"] == 0 and stopped["seconds"] < 30, stopped
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["service"]["forward_backward_tokens"] > 0 and summary["service"]["sample_tokens"] > 0
    assert (run_dir / "report.png").exists() and (run_dir / "report.md").exists() and (run_dir / "tb").is_dir()


def _datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


SEQ = [1, 5, 6, 11, 7, 8, 10, 9, 12, 2]  # "<bos> 1 2 + 3 4 = ..." in the tiny tokenizer's ids


def _ce(tokens=SEQ):
    return _datum(tokens, weights=[0.0] * 5 + [1.0] * (len(tokens) - 6))


def test_the_sdk_trains_samples_saves_and_restores(service):
    url, model, run_dir = service
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
    info = tc.get_info()
    assert info.model_id.endswith(":train:0") and info.lora_rank == 4 and info.model_data.model_name == model
    assert tc.get_tokenizer() is not None  # loaded by the name the service reports
    before = tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]
    assert tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == before  # no update
    losses = []
    for _ in range(5):
        fb = tc.forward_backward([_ce()] * 4, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=300)
        out = fb.result(timeout=300)
        assert list(out.loss_fn_outputs[0]["logprobs"].shape) == [len(SEQ) - 1]
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.8, losses

    saved = tc.save_weights_for_sampler("step-4").result(timeout=300)
    assert saved.path.startswith("tinker://") and saved.path.endswith("/sampler_weights/step-4")
    sampler = sc.create_sampling_client(model_path=saved.path).result(timeout=600)
    prompt = types.ModelInput.from_ints(SEQ[:7])
    res = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=7),
                         include_prompt_logprobs=True).result(timeout=300)
    assert len(res.sequences) == 3 and all(1 <= len(s.tokens) <= 6 for s in res.sequences)
    again = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=7)) \
        .result(timeout=300)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # seeded
    # the sampler's log-probs are the learner's forward on the same tokens
    for seq in res.sequences:
        full = SEQ[:7] + list(seq.tokens)
        lp = tc.forward([_datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result(timeout=300) \
            .loss_fn_outputs[0]["logprobs"].tolist()
        assert np.allclose(lp[-len(seq.tokens):], seq.logprobs, atol=1e-4), (lp, seq.logprobs)
        assert seq.stop_reason == ("stop" if seq.tokens[-1] == 2 else "length")
    assert res.prompt_logprobs[0] is None
    assert np.allclose(res.prompt_logprobs[1:], lp[:6], atol=1e-4)
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=7, stop=[res.sequences[0].tokens[0]])) \
        .result(timeout=300)
    assert stopped.sequences[0].tokens == res.sequences[0].tokens[:1] and stopped.sequences[0].stop_reason == "stop"

    # issue 60.1: saved again under the same name, the path serves the newer weights, to a sampler made
    # after the second save and to the one made before it alike (vLLM caches an adapter by its id)
    at_first_save = tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]
    for _ in range(2):
        tc.forward_backward([_ce()] * 4, "cross_entropy").result(timeout=300)
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=300)
    moved = tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]
    assert abs(moved - at_first_save) > 0.1  # the second save is other weights
    assert tc.save_weights_for_sampler("step-4").result(timeout=300).path == saved.path
    again_sampler = sc.create_sampling_client(model_path=saved.path).result(timeout=600)
    for client in (again_sampler, sampler):
        newer = client.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=7)).result(timeout=300)
        for seq in newer.sequences:
            _same_as_the_trainer(tc, SEQ[:7], seq)
    # dro (issue 60.4): Tinker's formula on the log-probs the forward returns
    q, adv = [-2.0] * 9, [0.0] * 5 + [1.0, -1.0, 2.0, 0.5]
    dro = tc.forward([_datum(SEQ, logprobs=q, advantages=adv)], "dro", {"beta": 0.1}).result(timeout=300)
    lp = np.asarray(dro.loss_fn_outputs[0]["logprobs"].tolist())
    assert dro.metrics["loss:sum"] == pytest.approx(-(lp * adv - 0.05 * (lp - q) ** 2).sum(), rel=1e-4)

    ephemeral = tc.save_weights_and_get_sampling_client().result(timeout=600)  # the cookbook's RL loop samples like this
    assert len(ephemeral.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result(timeout=300).sequences) == 1
    base = sc.create_sampling_client(base_model=model).result(timeout=600)
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=300)
    assert base_lp[0] is None and not np.allclose(base_lp[1:7], lp[:6], atol=1e-3)  # the base is not the adapter

    state = tc.save_state("state-4").result(timeout=300)
    restored = sc.create_training_client_from_state_with_optimizer(state.path).result(timeout=300)
    assert restored.model_id.endswith(":train:1")
    mine = tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]
    assert restored.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == pytest.approx(mine)

    custom = tc.forward_backward_custom([_ce()], lambda data, logprobs: (-(logprobs[0] * 0.5).sum(), {}))
    assert "loss:sum" in custom.result(timeout=300).metrics  # the SDK's client-side loss, over our cross_entropy

    rest = tinker.RestClient(base_url=url)
    info = rest.get_weights_info_by_tinker_path(state.path).result(timeout=60)
    assert info.base_model == model and info.is_lora and info.lora_rank == 4 and info.train_unembed is False
    caps = rest.get_server_capabilities().result(timeout=60)
    assert [m.model_name for m in caps.supported_models] == [model]
    paths = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints]
    assert saved.path in paths and state.path in paths
    sc.close("success")
    calls = [json.loads(line) for line in (run_dir / "calls.jsonl").read_text().splitlines()]
    fb_calls = [c for c in calls if c["call"] == "forward_backward" and c["of"] == tc.model_id]
    assert [round(c["loss:sum"], 4) for c in fb_calls[:5]] == [round(x, 4) for x in losses]  # the run's log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["tinker/model"] == 0]  # the service's first model: this test's
    assert [round(r["tinker/loss_sum"], 4) for r in mine[:5]] == [round(x, 4) for x in losses]
    assert [r["tinker/model_step"] for r in mine[:5]] == [1, 2, 3, 4, 5] and all(r["time/step_s"] > 0 for r in mine)


def _same_as_the_trainer(tc, prompt, seq):
    """A sampled sequence's log-probs are the training model's forward on the same tokens."""
    full = list(prompt) + list(seq.tokens)
    lp = tc.forward([_datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result(timeout=300) \
        .loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(lp[-len(seq.tokens):], seq.logprobs, atol=1e-4), (lp[-len(seq.tokens):], seq.logprobs)


def test_two_clients_train_at_once_and_never_see_each_others_weights(service):
    url, model, run_dir = service
    a, b = tinker.ServiceClient(base_url=url), tinker.ServiceClient(base_url=url)
    ta = a.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
    tb = b.create_lora_training_client(base_model=model, rank=8, train_unembed=False).result(timeout=600)
    b_before = tb.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]
    pending = [(ta.forward_backward([_ce()] * 2, "cross_entropy"), ta.optim_step(types.AdamParams(learning_rate=5e-2)))
               for _ in range(3)]
    other = [tb.forward([_ce(SEQ[:6] + [3, 4, 2])], "cross_entropy") for _ in range(3)]  # meanwhile, on B
    for fb, op in pending:
        fb.result(timeout=300), op.result(timeout=300)
    assert all(f.result(timeout=300) for f in other)
    assert tb.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == b_before
    assert ta.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] < b_before
    sa = ta.save_weights_and_get_sampling_client().result(timeout=600)
    sb = tb.save_weights_and_get_sampling_client().result(timeout=600)
    prompt = types.ModelInput.from_ints(SEQ[:7])
    lp_a = sa.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=3)).result(timeout=300).sequences[0]
    lp_b = sb.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=3)).result(timeout=300).sequences[0]
    assert lp_a.tokens != lp_b.tokens or not np.allclose(lp_a.logprobs, lp_b.logprobs, atol=1e-3)
    a.close("success")  # A's session ends: its model is gone, B's trains on
    with pytest.raises(tinker.NotFoundError, match="no such training model"):
        httpx_post(url, "/api/v1/get_info", {"model_id": ta.model_id})
    tb.forward_backward([_ce()], "cross_entropy").result(timeout=300)
    b.close("success")


def httpx_post(url, path, body, key=KEY, raw=None, headers=None):
    """A request the SDK would never send (malformed, aimed elsewhere), raising the SDK's error
    for its status as the SDK's own client does."""
    r = httpx.post(url + path, json=body if raw is None else None, content=raw,
                   headers={"x-api-key": key, **(headers or {})}, timeout=60)
    if r.status_code == 404:
        raise tinker.NotFoundError(r.text, response=r, body=r.json())
    if r.status_code >= 400:
        raise tinker.APIStatusError(r.text, response=r, body=r.json() if r.content else None)
    return r


def _next_seq_id(tc) -> int:
    """The seq_id the SDK would give `tc`'s next call, taken for a request sent by hand: the SDK
    numbers its own calls after it (and, as after each call it sent, lets its next one take its turn).
    Call it with none of tc's calls in flight."""
    number = tc._get_request_id()
    assert tc._turn_counter == number and not tc._turn_waiters
    tc._turn_counter += 1
    return number + 1  # the SDK sends request id + 1


def test_hostile_requests_get_the_sdks_error_and_harm_nothing(service):
    url, model, run_dir = service
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
    good = tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]

    def refused(exc, match, call):
        with pytest.raises(exc, match=match):
            out = call()
            if hasattr(out, "result"):
                out.result(timeout=120)

    # a key that is not the service's
    refused(tinker.AuthenticationError, "not this service", lambda: tinker.ServiceClient(
        base_url=url, api_key="tml-wrong").create_lora_training_client(base_model=model, rank=4))
    # what the service does not serve
    refused(tinker.BadRequestError, "serves", lambda: sc.create_lora_training_client(base_model="org/other", rank=4))
    refused(tinker.BadRequestError, "rank", lambda: sc.create_lora_training_client(base_model=model, rank=4096))
    refused(tinker.BadRequestError, "stability information", lambda: tc.forward_backward([_ce()], "stable_reinforce"))
    refused(tinker.BadRequestError, "beta", lambda: tc.forward_backward(
        [_datum(SEQ, logprobs=[-1.0] * 9, advantages=[1.0] * 9)], "dro"))
    refused(tinker.BadRequestError, "clip_eps", lambda: tc.forward_backward(
        [_datum(SEQ, logprobs=[-1.0] * 9, advantages=[1.0] * 9)], "ppo", {"clip_eps": 0.2}))
    # out of range, malformed, huge
    refused(tinker.BadRequestError, "outside the vocabulary", lambda: tc.forward_backward(
        [_datum([1, 99999, 3], weights=[1.0, 1.0])], "cross_entropy"))
    refused(tinker.BadRequestError, "NaN", lambda: tc.forward_backward(
        [_datum(SEQ, logprobs=[-1.0] * 9, advantages=[float("nan")] * 9)], "importance_sampling"))
    refused(tinker.RequestFailedError, "needs loss_fn_inputs", lambda: tc.forward_backward(
        [_datum(SEQ, logprobs=[-1.0] * 9)], "ppo"))
    refused(tinker.RequestFailedError, "shape", lambda: tc.forward_backward(
        [_datum(SEQ, weights=[1.0] * 3)], "cross_entropy"))
    refused(tinker.APIStatusError, "max_tokens_per_request", lambda: tc.forward_backward(
        [_ce()] * 500, "cross_entropy"))
    refused(tinker.BadRequestError, "max_model_len", lambda: tc.forward_backward(
        [_datum([1] * 80, weights=[1.0] * 79)], "cross_entropy"))
    base = sc.create_sampling_client(base_model=model).result(timeout=600)
    refused(tinker.BadRequestError, "max_tokens", lambda: base.sample(
        types.ModelInput.from_ints(SEQ), 1, types.SamplingParams(max_tokens=1000)))
    refused(tinker.BadRequestError, "the prompt is 80 tokens.*served context of 64 tokens", lambda: base.sample(
        types.ModelInput.from_ints([1] * 80), 1, types.SamplingParams(max_tokens=8)))
    refused(tinker.BadRequestError, "record_stability_info is not served", lambda: sc.create_sampling_client(
        base_model=model, record_stability_info=True).result(timeout=600).sample(
        types.ModelInput.from_ints(SEQ[:4]), 1, types.SamplingParams(max_tokens=2)))
    refused(tinker.BadRequestError, "num_samples", lambda: base.sample(
        types.ModelInput.from_ints(SEQ), 100000, types.SamplingParams(max_tokens=2)))
    refused(tinker.BadRequestError, "outside the vocabulary", lambda: base.sample(
        types.ModelInput.from_ints([1, 70000]), 1, types.SamplingParams(max_tokens=2)))
    refused(tinker.BadRequestError, "not served", lambda: base.sample(
        types.ModelInput.from_ints(SEQ[:4]), 1, types.SamplingParams(max_tokens=2), topk_prompt_logprobs=3))
    # aimed at what is not there, or not this session's
    refused(tinker.NotFoundError, "no such training model", lambda: httpx_post(
        url, "/api/v1/optim_step", {"model_id": "sess-0:train:0", "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}))
    refused(tinker.NotFoundError, "no such live session", lambda: httpx_post(
        url, "/api/v1/create_model", {"session_id": "sess-none", "model_seq_id": 0, "base_model": model,
                                      "lora_config": {"rank": 4}}))
    refused(tinker.NotFoundError, "no such sampler", lambda: httpx_post(
        url, "/api/v1/asample", {"sampling_session_id": "sess-0:sample:0", "prompt": {"chunks": []}}))
    refused(tinker.NotFoundError, "no request", lambda: httpx_post(url, "/api/v1/retrieve_future",
                                                                   {"request_id": "req-0-0000"}))
    refused(tinker.APIStatusError, "already used", lambda: httpx_post(
        url, "/api/v1/optim_step", {"model_id": tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}))
    refused(tinker.APIStatusError, "not a tinker_public", lambda: httpx_post(
        url, "/api/v1/forward_backward", None, raw=b"\xff\xfe garbage", headers={"content-type": "application/x-protobuf"}))
    refused(tinker.APIStatusError, "not JSON", lambda: httpx_post(url, "/api/v1/get_info", None, raw=b"{oops"))
    refused(tinker.APIStatusError, "max_request_mib", lambda: httpx_post(
        url, "/api/v1/get_info", None, raw=b" " * (65 * 2**20), headers={"content-type": "application/json"}))
    # issue 60.2: a training call refused or not served at all gives its seq_id up: the next call runs
    # at once (before, each later call waited serve.seq_wait_s for it and failed)
    with pytest.warns(FutureWarning):  # the SDK deprecates load_state*; refused here
        refused(tinker.BadRequestError, "create_training_client_from_state", lambda: tc.load_state(
            "tinker://x/weights/y"))
    with pytest.warns(FutureWarning):
        refused(tinker.BadRequestError, "create_training_client_from_state", lambda: tc.load_state_with_optimizer(
            "tinker://x/weights/y"))
    refused(tinker.BadRequestError, "save_weights_external is not served", lambda: tc.save_weights_external("x"))
    assert tc.forward([_ce()], "cross_entropy").result(timeout=30).metrics["loss:sum"] == pytest.approx(good)
    refused(tinker.NotFoundError, "is not served", lambda: httpx_post(  # a route a newer SDK might call
        url, "/api/v1/publish_weights", {"model_id": tc.model_id, "seq_id": _next_seq_id(tc), "path": "x"}))
    refused(tinker.APIStatusError, "adam_params", lambda: httpx_post(  # refused by the route itself
        url, "/api/v1/optim_step", {"model_id": tc.model_id, "seq_id": _next_seq_id(tc), "sgd_params": {}}))
    assert tc.forward([_ce()], "cross_entropy").result(timeout=30).metrics["loss:sum"] == pytest.approx(good)
    # a call whose predecessor never comes fails at serve.seq_wait_s, and only that call
    tc2 = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
    gap = httpx_post(url, "/api/v1/optim_step", {"model_id": tc2.model_id, "seq_id": 50,
                                                 "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
    failed = httpx_post(url, "/api/v1/retrieve_future", {"request_id": gap}).json()
    assert failed["category"] == "user" and "never came" in failed["error"]
    # a call the client cancels fails as cancelled (the SDK cancels abandoned sample futures)
    doomed = httpx_post(url, "/api/v1/optim_step", {"model_id": tc2.model_id, "seq_id": 70,
                                                    "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
    httpx_post(url, "/api/v1/cancel_future", {"request_id": doomed})
    assert "cancelled" in httpx_post(url, "/api/v1/retrieve_future", {"request_id": doomed}).json()["error"]
    # a client that goes away mid-poll: the call still ends and its result waits for whoever asks
    pending = httpx_post(url, "/api/v1/optim_step", {"model_id": tc2.model_id, "seq_id": 60,
                                                     "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/api/v1/retrieve_future", json={"request_id": pending}, headers={"x-api-key": KEY}, timeout=0.5)
    assert "never came" in httpx_post(url, "/api/v1/retrieve_future", {"request_id": pending}).json()["error"]
    assert tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == pytest.approx(good)
    # nothing else was harmed: the model still trains and its sampler samples
    tc.forward_backward([_ce()], "cross_entropy").result(timeout=300)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    assert tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] < good
    s = tc.save_weights_and_get_sampling_client().result(timeout=600)
    assert s.sample(types.ModelInput.from_ints(SEQ[:7]), 2, types.SamplingParams(max_tokens=3)).result(timeout=300)
    assert tc2.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == pytest.approx(good)
    sc.close("success")


def test_a_finished_session_frees_its_models_and_a_heartbeat_after_it_is_refused(service):
    url, model, run_dir = service
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
    sid = tc.model_id.split(":")[0]
    sc.close("success")
    r = httpx.post(url + "/api/v1/session_heartbeat", json={"session_id": sid, "type": "session_heartbeat"},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 410  # the SDK stops heartbeating on 410
    r = httpx.post(url + "/api/v1/get_info", json={"model_id": tc.model_id}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 404 and "no such training model" in r.text


def test_sigterm_stops_the_service_within_seconds_whatever_its_calls_wait_for(tiny_untrained, tmp_path):
    """Issue 60.3: a call waiting for a seq_id that never comes (serve.seq_wait_s=600) and a client
    long-polling it: SIGTERM still ends the process within seconds, its report written (before, the
    service wrote its report and lived on until the waiting calls' threads gave up)."""
    import threading
    import time

    model = os.path.join(tiny_untrained, "model")
    run_dir = tmp_path / "run"
    os.environ["TINKER_API_KEY"] = KEY
    stopped: dict = {}
    with serving([f"model.path={model}", f"serve.api_key={KEY}", "serve.seq_wait_s=600", "serve.op_timeout_s=900",
                  f"run.dir={run_dir}"], tmp_path / "serve.log", stopped=stopped) as url:
        tc = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=model, rank=4,
                                                                            train_unembed=False).result(timeout=600)
        wedged = httpx_post(url, "/api/v1/optim_step", {"model_id": tc.model_id, "seq_id": 9,
                                                        "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
        polling = threading.Thread(target=lambda: httpx.post(  # a client long-polling it, as the SDK does
            url + "/api/v1/retrieve_future", json={"request_id": wedged}, headers={"x-api-key": KEY}, timeout=120),
            daemon=True)
        polling.start()
        time.sleep(1.0)
    assert stopped["returncode"] == 0 and stopped["seconds"] < 20, stopped
    assert (run_dir / "summary.json").exists() and (run_dir / "report.md").exists()
    assert "Tinker service stopped" in (tmp_path / "serve.log").read_text()


_GONE_CLIENT = """
import json, sys, time
import httpx, tinker
url, model, key = sys.argv[1:4]
tc = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=model, rank=4,
                                                                    train_unembed=False).result(timeout=600)
# calls queued behind seq_id 1 and 2, which never come: they wait for their turn when the client dies
queued = [httpx.post(url + "/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": s,
                                                      "adam_params": {"learning_rate": 1e-3}},
                     headers={"x-api-key": key}, timeout=60).json()["request_id"] for s in (3, 4, 5)]
print("QUEUED " + json.dumps({"model_id": tc.model_id, "queued": queued}), flush=True)
time.sleep(3600)
"""


def test_a_client_gone_frees_its_models_and_drops_its_calls_and_a_full_service_evicts_an_idle_model(
        tiny_untrained, tmp_path):
    """Issue 60.6: a client process killed with calls queued stops heartbeating (the SDK beats every
    10 s): within serve.session_timeout_s (+ a quarter of it) its model is freed and its queued calls fail as
    dropped, never computed. A full service (serve.max_models=1) makes room for a new model by
    evicting the idle one (its state saved); that model's next call restores it where it was."""
    import subprocess
    import sys
    import time

    model = os.path.join(tiny_untrained, "model")
    run_dir = tmp_path / "run"
    os.environ["TINKER_API_KEY"] = KEY
    with serving([f"model.path={model}", f"serve.api_key={KEY}", "serve.session_timeout_s=25", "serve.max_models=1",
                  "serve.seq_wait_s=600", f"run.dir={run_dir}"], tmp_path / "serve.log") as url:
        client = subprocess.Popen([sys.executable, "-c", _GONE_CLIENT, url, model, KEY], stdout=subprocess.PIPE,
                                  stderr=open(tmp_path / "client.log", "w"), text=True,
                                  env={**os.environ, "TINKER_API_KEY": KEY})
        try:
            line = ""
            while not line.startswith("QUEUED "):
                line = client.stdout.readline()
                assert line or client.poll() is None, (tmp_path / "client.log").read_text()[-3000:]
        finally:
            client.kill()
            client.wait(30)
        gone = json.loads(line[len("QUEUED "):])
        killed = time.monotonic()
        while httpx.post(url + "/api/v1/get_info", json={"model_id": gone["model_id"]}, headers={"x-api-key": KEY},
                         timeout=60).status_code != 404:
            assert time.monotonic() - killed < 45, "the dead client's model is still alive"
            time.sleep(0.5)
        for request_id in gone["queued"]:  # answered at once: dropped
            r = httpx.post(url + "/api/v1/retrieve_future", json={"request_id": request_id},
                           headers={"x-api-key": KEY}, timeout=10).json()
            assert r.get("category") == "user" and "dropped" in r["error"], r

        sc = tinker.ServiceClient(base_url=url)

        def step(tc):
            tc.forward_backward([_ce()] * 2, "cross_entropy").result(timeout=300)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
            return tc.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"]

        first = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
        after_one = step(first)
        # the service is full (max_models=1): the idle first model is evicted, not the new one refused.
        # The second starts as the first did (the same seed) and takes two steps with no eviction between
        second = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
        assert step(second) == pytest.approx(after_one, rel=1e-5)
        after_two = step(second)
        assert abs(after_two - after_one) > 1e-3
        # the first model's next calls: restored from its saved state (the second one evicted in turn),
        # Adam's moments too: its second step is the second model's
        assert first.forward([_ce()], "cross_entropy").result(timeout=300).metrics["loss:sum"] == \
            pytest.approx(after_one, rel=1e-5)
        assert step(first) == pytest.approx(after_two, rel=1e-4)
        sc.close("success")
    calls = [json.loads(line) for line in (run_dir / "calls.jsonl").read_text().splitlines()]
    assert not [c for c in calls if c["of"] == gone["model_id"]]  # its queued calls were never computed
    log = (tmp_path / "serve.log").read_text()
    assert f"training model {first.model_id}: evicted" in log and f"training model {first.model_id}: restored" in log


def _hf_logprobs(model, tokens):
    """log p(tokens[t+1] | tokens[:t+1]) of a transformers model, as the service's forward reports them."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def test_weights_come_out_through_the_rest_calls_and_a_resumed_service_serves_them(tiny_untrained, tmp_path):
    """Issue 60.3 and 60.4: the runs and checkpoints a model saved are listed by the SDK's RestClient
    (list/get training runs, list_checkpoints, list_user_checkpoints); the archive behind the
    cookbook's `weights.download` (a 302 to a URL fetched without the key, a tar) holds a peft folder
    that loads in peft and, merged, in transformers with the service's log-probs. Restarted with
    run.resume=true on the same run.dir, the service lists those runs and checkpoints again, samples
    from the old sampler path and makes a training model from the old state."""
    import tarfile
    import urllib.request

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = os.path.join(tiny_untrained, "model")
    run_dir = tmp_path / "run"
    os.environ["TINKER_API_KEY"] = KEY
    args = [f"model.path={model}", f"serve.api_key={KEY}", f"run.dir={run_dir}"]
    with serving(args, tmp_path / "serve.log") as url:
        sc = tinker.ServiceClient(base_url=url)
        tc = sc.create_lora_training_client(base_model=model, rank=4, train_unembed=False).result(timeout=600)
        for _ in range(2):
            tc.forward_backward([_ce()] * 2, "cross_entropy").result(timeout=300)
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=300)
        trained = tc.forward([_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))], "cross_entropy").result(timeout=300)
        lp = np.asarray(trained.loss_fn_outputs[0]["logprobs"].tolist())
        sampler_path = tc.save_weights_for_sampler("final").result(timeout=300).path
        state_path = tc.save_state("state-2").result(timeout=300).path

        rest = tinker.RestClient(base_url=url)
        assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result(timeout=60).training_runs]
        run = rest.get_training_run(tc.model_id).result(timeout=60)
        assert run.base_model == model and run.is_lora and run.lora_rank == 4
        assert run.last_sampler_checkpoint.tinker_path == sampler_path and run.last_checkpoint.tinker_path == state_path
        listed = rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints
        assert {c.tinker_path for c in listed} == {sampler_path, state_path} and all(c.size_bytes > 0 for c in listed)
        mine = rest.list_user_checkpoints().result(timeout=60)
        assert {sampler_path, state_path} <= {c.tinker_path for c in mine.checkpoints}
        assert mine.cursor.total_count == 2
        with pytest.raises(tinker.NotFoundError):
            rest.get_training_run("sess-nothere:train:0").result(timeout=60)

        # the archive, fetched as the SDK's get_checkpoint_archive_url and the cookbook's download do
        r = httpx.get(f"{url}/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/final/archive",
                      headers={"x-api-key": KEY, "accept": "application/gzip"}, follow_redirects=False, timeout=60)
        assert r.status_code == 302 and r.headers["Expires"].endswith("GMT"), r.text
        urllib.request.urlretrieve(r.headers["Location"], tmp_path / "archive.tar")  # no API key: its URL is its secret
        with tarfile.open(tmp_path / "archive.tar") as tar:
            assert not any(m.issym() or m.islnk() or m.name.startswith(("/", "..")) for m in tar.getmembers())
            tar.extractall(tmp_path / "adapter")
        assert httpx.get(r.headers["Location"].replace("/archives/", "/archives/x"), timeout=60).status_code == 404
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        assert np.allclose(_hf_logprobs(adapted, SEQ), lp, atol=1e-4)
        adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert np.allclose(_hf_logprobs(merged, SEQ), lp, atol=1e-4)
        sc.close("success")

    # restarted on the same run.dir: refused without run.resume, served again with it
    with pytest.raises(RuntimeError, match="already holds a run"):
        with serving(args, tmp_path / "refused.log"):
            pass
    with serving(args + ["run.resume=true"], tmp_path / "resumed.log") as url:
        sc = tinker.ServiceClient(base_url=url)
        rest = tinker.RestClient(base_url=url)
        assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result(timeout=60).training_runs]
        assert rest.get_training_run(tc.model_id).result(timeout=60).last_sampler_checkpoint.tinker_path == sampler_path
        assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints} == \
            {sampler_path, state_path}
        sampler = sc.create_sampling_client(model_path=sampler_path).result(timeout=600)
        again = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result(timeout=300)
        assert again[0] is None and np.allclose(again[1:], lp, atol=1e-4)
        restored = sc.create_training_client_from_state_with_optimizer(state_path).result(timeout=600)
        out = restored.forward([_datum(SEQ, weights=[1.0] * (len(SEQ) - 1))], "cross_entropy").result(timeout=300)
        assert np.allclose(np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist()), lp, atol=1e-5)
        restored.forward_backward([_ce()] * 2, "cross_entropy").result(timeout=300)
        restored.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=300)
        sc.close("success")
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the resumed service's row follows the first one's
