"""The weight-sync wire protocol (`rl.wire.collective`, `rl.wire.format`) between real processes: buckets arrive whole
and in order at every receiver (sent without a copy where the sender's tensors lie end to end), a
group whose peer never comes fails instead of hanging, and a receiver streams: three bucket buffers
in memory, not a second copy of the model, also when it loads into a live vLLM engine."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import pytest
import torch

from rl.wire.collective import RECEIVE_SLOTS, free_port, init_group, receive, send
from rl.wire.format import WeightMeta, buckets
from tests.members import run_members

METAS = [WeightMeta("a", (2, 3), "float32"), WeightMeta("b", (4,), "float32"), WeightMeta("c", (2,), "bfloat16")]
TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "b": -torch.arange(4.0), "c": torch.tensor([1.5, 2.5], dtype=torch.bfloat16)}
MIXED = {"n1": torch.ones(3), "w1": torch.randn(300, generator=torch.Generator().manual_seed(0)), "n2": 2 * torch.ones(5),
         "w2": torch.randn(2, 40, generator=torch.Generator().manual_seed(1))}
MIXED_METAS = [WeightMeta(n, tuple(t.shape), "float32") for n, t in MIXED.items()]


def _flat_views(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as views of one flat buffer, end to end (how DeepSpeed ZeRO-1/2 keeps them:
    `send` broadcasts a bucket of them without a copy)."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    out, offset = [], 0
    for t in tensors.values():
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _member(rank: int, port: int, world: int, out) -> None:  # (tests/members.py)
    group = init_group("127.0.0.1", port, rank, world, "gloo", timeout_s=60)
    if rank == 0:
        send(group, [[TENSORS["a"], TENSORS["b"]], [TENSORS["c"]]])  # the buckets `buckets(METAS)` makes
        send(group, [list(MIXED.values())])  # separate tensors: concatenated
        views, concatenations = _flat_views(MIXED), []
        cat = torch.cat
        torch.cat = lambda *args, **kwargs: concatenations.append(1) or cat(*args, **kwargs)
        send(group, [views])  # views of one buffer: sent as they lie, no copy
        torch.cat = cat
        out.put(pickle.dumps((0, {"concatenations": len(concatenations)})))
    else:
        got = {name: t.clone() for name, t in receive(group, METAS)}
        for layout in ("separate", "flat"):
            got.update((f"{name}/{layout}", t.clone()) for name, t in receive(group, MIXED_METAS))
        out.put(pickle.dumps((rank, got)))


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_rank0_broadcasts_every_bucket_to_every_receiver() -> None:
    results = run_members(_member, 3, free_port(), 3)
    assert buckets(METAS) == [[0, 1], [2]] and buckets(MIXED_METAS) == [[0, 1, 2, 3]]
    assert results[0] == {"concatenations": 0}
    for rank in (1, 2):
        assert list(results[rank]) == ["a", "b", "c", *(f"{n}/{layout}" for layout in ("separate", "flat") for n in MIXED)]
        for name, t in results[rank].items():
            want = TENSORS.get(name, MIXED.get(name.split("/")[0]))
            assert t.dtype == want.dtype and torch.equal(t, want)


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_a_peer_that_never_joins_fails_the_group_in_bounded_time() -> None:
    start = time.perf_counter()
    with pytest.raises(Exception):  # torch's DistStoreError: not every member joined in time
        init_group("127.0.0.1", free_port(), 0, 2, "gloo", timeout_s=2)
    assert time.perf_counter() - start < 30


def _stalled_member(rank: int, ports: tuple[int, int], out) -> None:
    """Rank 2 joins and never takes a broadcast (a stopped rollout worker). Rank 0 waits 2 s for
    a bucket, then both live members abort the group and make a new one without rank 2."""
    from datetime import timedelta

    group = init_group("127.0.0.1", ports[0], rank, 3, "gloo", timeout_s=60)
    if rank == 2:
        time.sleep(120)  # killed by the test before that
        return
    group.wait_timeout = timedelta(seconds=2)  # what CollectiveSender.send (rl/wire/collective.py) sets per sync
    if rank == 0:
        started = time.perf_counter()
        try:
            send(group, [[TENSORS["a"], TENSORS["b"]], [TENSORS["c"]]])
            failed = "no error"
        except RuntimeError as err:
            failed = f"{time.perf_counter() - started:.1f} {err}"
        group.abort()
        again = init_group("127.0.0.1", ports[1], 0, 2, "gloo", timeout_s=60)
        send(again, [[TENSORS["a"], TENSORS["b"]], [TENSORS["c"]]])
        out.put(pickle.dumps((0, failed)))
    else:
        try:  # rank 2 takes no part: whether this receive completes depends on gloo's algorithm
            for _ in receive(group, METAS):
                pass
        except RuntimeError:
            pass
        group.abort()
        again = init_group("127.0.0.1", ports[1], 1, 2, "gloo", timeout_s=60)
        out.put(pickle.dumps((1, {name: t.clone() for name, t in receive(again, METAS)})))


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_a_stopped_receiver_fails_the_senders_broadcast_in_bounded_time_and_a_new_group_works() -> None:
    """The defect NCCL would hide (its plain wait() only queues the broadcast): rank 0 must learn
    that a receiver stopped, within its per-sync wait, so the driver can rebuild the group."""
    ctx = mp.get_context("spawn")
    ports, out = (free_port(), free_port()), ctx.Queue()
    procs = [ctx.Process(target=_stalled_member, args=(rank, ports, out)) for rank in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict(pickle.loads(out.get(timeout=120)) for _ in range(2))
    finally:
        procs[2].kill()
        for p in procs:
            p.join(timeout=30)
    seconds, _, error = results[0].partition(" ")
    assert seconds != "no" and 1.5 <= float(seconds) < 20, results[0]
    assert list(results[1]) == list(TENSORS)
    for name, t in results[1].items():
        assert torch.equal(t, TENSORS[name])


# ---- streaming: three bucket buffers in turn ----------------------------------------------------

FIVE = [torch.full((4,), float(k)) for k in range(5)]
FIVE_METAS = [WeightMeta(f"t{k}", (4,), "float32") for k in range(5)]


def _holding_member(rank: int, port: int, out) -> None:
    """Five one-tensor buckets (16 bytes each). Rank 1 keeps the tensor of bucket 0, as a loader
    keeps a layer it has not finished, and a view of its own of bucket 1's tensor. Buckets go to
    buffers 0, 1, 2, 0, 1; a bucket's broadcast is posted when the consumer asks for the one
    before it, so buffer 0 takes bucket 3 as bucket 2 is handed out."""
    group = init_group("127.0.0.1", port, rank, 2, "gloo", timeout_s=60)
    if rank == 0:
        send(group, [[t] for t in FIVE])
        return
    stats: dict[str, float] = {}
    it = receive(group, FIVE_METAS, limit=16, stats=stats)
    _, t0 = next(it)
    slot0 = t0.untyped_storage().data_ptr()
    _, t1 = next(it)
    own_view = t1.view(2, 2)  # not handed out by `receive`: it cannot give it a copy
    slot1 = t1.untyped_storage().data_ptr()
    del t1
    _, t2 = next(it)  # bucket 3 is now arriving in buffer 0: t0 first got its own copy
    t0_moved = t0.untyped_storage().data_ptr() != slot0
    t2_new_slot = t2.untyped_storage().data_ptr() not in (slot0, slot1)
    _, t3 = next(it)  # buffer 1 is still viewed by `own_view`: a new buffer takes bucket 4
    t3_in_slot0 = t3.untyped_storage().data_ptr() == slot0
    _, t4 = next(it)
    t4_new = t4.untyped_storage().data_ptr() != slot1
    out.put(pickle.dumps((t0.clone(), own_view.clone(), t2.clone(), t3.clone(), t4.clone(), t0_moved, t2_new_slot,
                          t3_in_slot0, t4_new, list(it), stats)))


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_receive_streams_three_buffers_in_turn_and_copies_what_the_consumer_keeps() -> None:
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_holding_member, args=(rank, port, out)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        (t0, own_view, t2, t3, t4, t0_moved, t2_new_slot, t3_in_slot0, t4_new, rest,
         stats) = pickle.loads(out.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=30)
    assert buckets(FIVE_METAS, 16) == [[0], [1], [2], [3], [4]]
    assert torch.equal(t0, FIVE[0]) and t0_moved and t2_new_slot and t3_in_slot0  # copied out, buffer reused
    assert torch.equal(own_view.reshape(-1), FIVE[1]) and t4_new  # buffer left to the view
    assert all(torch.equal(t, FIVE[k]) for k, t in ((2, t2), (3, t3), (4, t4))) and rest == []
    assert stats["bytes"] == 5 * 16 and stats["receive_s"] > 0


# ---- a real sync into vLLM: peak extra memory vs the model's size ------------------------------

def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _sync_sender(port: int, model_dir: str, new_dir: str, limit: int, to_receiver) -> None:
    """Learner side: new weights (the model's, perturbed; saved to `new_dir` for checking),
    broadcast twice in `limit`-byte buckets as `CollectiveSender.send` (rl/wire/collective.py) does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.wire.format import WeightMeta, buckets

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(new_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(new_dir)
    named = list(model.named_parameters())  # deduplicated: a tied lm_head is not sent
    metas = [WeightMeta(n, tuple(p.shape), "float32") for n, p in named]
    to_receiver.put(metas)
    group = init_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=600)
    for _ in range(2):
        send(group, [[named[i][1].detach() for i in b] for b in buckets(metas, limit)])


def _sync_receiver(port: int, model_dir: str, new_dir: str, limit: int, from_sender, out) -> None:
    """Rollout side: a vLLM engine in this process; peak RSS growth during a streamed
    `update_weights(receive(...))`, then during one fed a materialised list (the old way)."""
    import gc

    from rl.config.schema import ModelConfig, RolloutConfig
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import VLLMEngine, vllm_env

    os.environ.update(vllm_env(1, 1))
    rollout = RolloutConfig(max_new_tokens=8, max_model_len=64, enforce_eager=True, kv_cache_gib=1)
    engine = VLLMEngine(RolloutSpec(ModelConfig(path=model_dir, dtype="float32"), rollout, seed=0, threads=1), 0)
    metas = from_sender.get(timeout=600)
    group = init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=600)
    peaks = {}
    for mode in ("streamed", "materialised"):
        gc.collect()
        before = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM, the peak RSS, to the current RSS
        tensors = receive(group, metas, limit=limit)
        engine.update_weights(tensors if mode == "streamed" else list(tensors), 1)
        peaks[mode] = _rss("VmHWM") - before
        if mode == "streamed":
            from rl.data.dataset import derive_seed
            from rl.data.types import GenerationRequest

            ids = engine.tokenizer("def add(a, b):").input_ids
            sample = engine.generate([GenerationRequest(ids, "", 0, 0, derive_seed(0, 0, 0, 0))])[0]
    # the engine samples from the new weights: its log-probs are those of the new model in HF
    from transformers import AutoModelForCausalLM

    from trainer.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    full = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, full, torch.ones_like(full))
    diff = (lp[0, len(sample.prompt_ids) - 1 :] - torch.tensor(sample.logprobs)).abs().max().item()
    model_bytes = sum(m.nbytes for m in metas)
    out.put({"peaks": peaks, "model_bytes": model_bytes, "largest_tensor": max(m.nbytes for m in metas),
             "logprob_max_diff": diff, "tokens": len(sample.completion_ids)})


def _model_27m(tied: bool, tmp_root) -> str:
    from bench.models import SHAPES, build, build_model, tokenizer

    if not tied:
        return str(build("27m").resolve())
    build("27m")  # the shared tokenizer
    tok = tokenizer()
    model = build_model(tok, SHAPES["27m"])
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    out = tmp_root / "27m-tied"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.full)], ids=["untied", "tied"])
def test_sync_into_vllm_holds_its_bucket_buffers_not_a_second_model(tmp_path, monkeypatch, tied) -> None:
    """The 27m shape (104 MiB of float32; 88 MiB tied) synced into a live vLLM engine: with the
    stream the peak extra RSS is the receiver's three bucket buffers plus vLLM's own work on the
    layer being loaded, below the model's size; fed a materialised list (the old code) it grows
    by most of the model. The engine then samples from the new weights, tied embeddings included.
    Buckets of 4 MiB here (the default is 16), so that the receiver's buffers stay small beside
    this small model and the two modes differ by most of it.
    Measured: 68 MiB streamed vs 115 MiB materialised (untied), 40 vs 96 MiB (tied)."""
    limit = 4 * 1024 * 1024
    model_dir = _model_27m(tied, tmp_path)
    new_dir = str(tmp_path / "new")
    ctx = mp.get_context("spawn")
    port, to_receiver, out = free_port(), ctx.Queue(), ctx.Queue()
    # Large buffers are mmapped and given back on free, so RSS follows what is really live
    # (glibc otherwise may keep freed heap pages and reuse them, hiding or inflating peaks).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1024 * 1024))
    procs = [ctx.Process(target=_sync_sender, args=(port, model_dir, new_dir, limit, to_receiver)),
             ctx.Process(target=_sync_receiver, args=(port, model_dir, new_dir, limit, to_receiver, out))]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    mib = 1024 * 1024
    peaks, model_bytes, largest = result["peaks"], result["model_bytes"], result["largest_tensor"]
    print(f"model {model_bytes / mib:.1f} MiB, bucket {limit / mib:.0f} MiB, largest tensor "
          f"{largest / mib:.1f} MiB: peak extra RSS streamed {peaks['streamed'] / mib:.1f} MiB, "
          f"materialised {peaks['materialised'] / mib:.1f} MiB; logprob diff {result['logprob_max_diff']:.2e}")
    assert result["tokens"] == 8 and result["logprob_max_diff"] < 1e-4
    assert model_bytes > 80 * mib and limit < largest < model_bytes / 4  # the embedding: a bucket of its own
    buffers = (RECEIVE_SLOTS - 1) * limit + largest  # the receiver's, one grown to the largest tensor
    # its buffers, plus vLLM's own work on the layer it is loading: it materialises the layer and
    # packs its GEMM weights, about twice the largest layer (the 16 MiB embedding or head)
    assert peaks["streamed"] <= buffers + 2.5 * largest + 8 * mib
    assert peaks["streamed"] < model_bytes
    # the measurement does see a second copy: the list holds the weights (those of the last
    # buckets in the receiver's kept buffers, which the first sync allocated)
    assert peaks["materialised"] > peaks["streamed"] + (model_bytes - buffers) / 2


def test_the_export_is_the_checkpoint_layout_vllm_loads(tmp_path) -> None:
    """transformers 5 holds a MoE's experts fused in memory (`mlp.experts.gate_up_proj`
    [experts, 2 x inner, hidden]); its checkpoint, and so vLLM's loader, has them per expert. The
    export sends exactly what `save_pretrained` writes: names, shapes and values, metas included;
    a dense model's layout needs no conversion at all."""
    import transformers as t
    from safetensors.torch import load_file

    from trainer.weights import WeightExport, checkpoint_layout

    config = t.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    export = WeightExport(list(model.named_parameters()), rank=0, zero_stage=0, convert=checkpoint_layout(model))
    sent = dict(pair for bucket in export.buckets() for pair in bucket)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    assert sent.keys() == saved.keys() and "model.layers.0.mlp.experts.3.up_proj.weight" in sent
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert [(m.name, m.shape) for m in export.metas()] == [(k, tuple(v.shape)) for k, v in sent.items()]
    assert checkpoint_layout(t.AutoModelForCausalLM.from_config(t.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32))) is None

    def joins(tensors):  # a layout that joins the two norms of a layer into one tensor
        names = sorted(tensors)
        return {"joined": torch.cat([tensors[n] for n in names])} if len(names) > 1 else dict(tensors)

    norms = [(n, p) for n, p in model.named_parameters() if "layers.0" in n and "layernorm" in n]
    with pytest.raises(ValueError, match="joins several in-memory parameters"):
        WeightExport(norms, rank=0, zero_stage=0, convert=joins)
