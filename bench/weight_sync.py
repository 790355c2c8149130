"""Weight-sync benchmark: GB/s of a full learner -> rollout sync through our path vs raw torch.distributed.

For each model size (`27m` of bench/models.py, 104 MiB of float32, and `100m`, a random-init
Llama of ~98M parameters built here, 372 MiB; `--quick`: `27m` only), the same bytes go from one
process to another:

- raw: a torch.distributed gloo broadcast (`ProcessGroupGloo`, CPU) between two plain processes
  (at the CPU priority a run gives its actors, `cluster.worker_niceness`, and with the rollout
  actor's malloc settings, like the actors of `ours`),
  bucket by bucket (`rl.wire.format.buckets`, 16 MiB) into buffers allocated once: the transport
  alone, the ceiling.
- wire: our protocol alone, in the same two processes: `rl.wire.collective.send` of the model's
  tensors and `receive` on the other side, its tensors dropped (nothing loaded). The sender's
  tensors lie as DeepSpeed ZeRO-1/2 keeps a learner's parameters (views of one flat buffer: whole
  buckets go as one view); `wire (separate)`: as separate tensors (ZeRO-0/3, a plain module: each
  bucket is concatenated into a kept buffer first).
- raw+load: raw, then what a bare vLLM user does with the received buffers: the receiving process
  hosts a `vllm.LLM` with the rollout worker's engine arguments and environment and calls its
  `reload_weights` on all of them (and resets the prefix cache). The reference for the full path;
  it holds a second copy of the weights, which ours does not (it loads bucket by bucket).
- ours: a sync as a training run does it: `WeightSync.sync(version)` (rl/wire/) from a
  DeepSpeed learner (1 rank, ZeRO-2) to a `RolloutFleet` worker (vLLM), both Ray actors built as
  `launch.components.build_components` builds them, timed in the driver. Its time is split with the
  worker's own figures (`RolloutWorker.receive_weights`): receive (waiting for a bucket's
  broadcast; the next bucket arrives while vLLM loads the one before, so most of the transfer
  is hidden in load) and load (vLLM's `reload_weights`, streamed from the buckets as they
  arrive, plus our tied-weight and prefix-cache handling); the rest is the learner's side and Ray. Also the worker's peak extra
  RSS during a sync (glibc's own allocator: it may reuse freed heap; `tests/test_weight_sync.py`
  measures the peak under an allocator that returns freed buffers).

GB/s = bytes of the weights / wall time of one full sync, median of the timed repeats after one
warm-up; raw, wire and raw+load take turns, ours runs afterwards (never two at once: 2 cores).
Targets: wire >= 0.8x raw (our transport) and ours >= 0.8x raw+load (the full path). On a CPU the
load into vLLM (its in-place reload re-materialises each layer and re-packs its oneDNN GEMM
weights) takes about as long as the broadcast itself, so no full sync comes near raw's GB/s.

On GPUs (`--device cuda`, the default where torch sees one; needs two: NCCL refuses two members
of a group on one GPU) the same comparison runs as a GPU run syncs: the config is the GPU profile's
(`cluster=local_gpu`: learner rank and rollout worker on a GPU each, bf16, CUDA graphs), the bytes
are the model's in bf16, and every side moves them GPU to GPU over NCCL: raw is an NCCL broadcast
between the two plain processes (one GPU each, as Ray gives its actors: `CUDA_VISIBLE_DEVICES`) of
buffers on the GPUs, then one `torch.cuda.synchronize()` on each; wire and ours use the weight-sync
group on NCCL (`rl.wire.collective` synchronizes the stream after each bucket); raw+load reloads vLLM
from the GPU buffers. Ours also reports the rollout worker's peak extra GPU memory during a sync
(`torch.cuda.max_memory_allocated` in its process).

    python -m bench.weight_sync [--quick] [--shapes 27m,100m,smollm2] [--repeats 5] [--device cpu|cuda]
                                [--out bench/results/weight_sync.json]

`--quick`: `27m` only, 3 repeats (about 2-3 minutes on 2 cores, mostly Ray/DeepSpeed/vLLM start-up).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXTRA_ROOT = "artifacts/bench-sync"  # models of this benchmark only (bench/models.py owns artifacts/bench)
SHAPE_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12)


# ---- models -----------------------------------------------------------------------------------

def model_path(shape: str) -> str:
    """`27m`/`tiny` from bench/models.py; `smollm2`, the real model (`bench.models.REAL_MODELS`);
    `100m` built here once (the shared 8k tokenizer, random init)."""
    from bench.models import REAL_MODELS, build, real_model

    if shape in REAL_MODELS:
        return str(real_model(shape).resolve())
    if shape != "100m":
        return str(build(shape).resolve())
    out = Path(EXTRA_ROOT) / "100m"
    if not (out / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from bench.models import MAX_POSITIONS, tokenizer

        build("27m")  # makes the shared tokenizer
        tok = tokenizer()
        config = LlamaConfig(vocab_size=len(tok), num_key_value_heads=SHAPE_100M["num_attention_heads"],
                             max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **SHAPE_100M)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).float()
        tmp = out.with_name("100m.tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out.resolve())


def load_named(path: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return [(n, p.detach()) for n, p in model.named_parameters()]


# ---- raw, wire and raw+load: two plain processes ----------------------------------------------

def _pair(rank: int, port: int, wire_port: int, path: str, repeats: int, warmup: int, engine, out,
          gpus: list[str] | None = None, dtype: str = "float32", raw_port: int = 0, niceness: int = 0) -> None:
    """Rank 0 sends, rank 1 receives (and, for raw+load, hosts a bare vLLM engine: `engine` is
    (RolloutSpec, environment) of the rollout worker). `gpus`: on GPUs, the one each rank gets
    (NCCL on `raw_port` for raw); None on CPU."""
    # at the CPU priority a run's Ray gives the learner and rollout actors (`cluster.worker_niceness`),
    # so that other load on the machine weighs on both paths alike
    os.nice(niceness - os.nice(0))
    if rank == 1:
        os.environ.update(engine[1])  # before torch and vLLM are imported: threads, vLLM switches
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]  # one GPU per process, as Ray gives its actors
    import pickle
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rl.wire.collective import init_group, receive, send
    from rl.wire.format import WeightMeta, buckets

    # raw: a plain gloo group of torch.distributed. Not the default group (`init_process_group`):
    # the vLLM engine in this process makes a default group of its own.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=600))
    raw_group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=600))  # CPU: also the barriers
    device = "cuda" if gpus else "cpu"
    # GPUs: raw is an NCCL broadcast of GPU buffers, then a synchronize (NCCL's wait() only orders the stream)
    data_group = init_group("127.0.0.1", raw_port, rank, 2, "nccl") if gpus else raw_group
    sync = torch.cuda.synchronize if gpus else (lambda: None)
    named = [(n, t.to(device)) for n, t in load_named(path, dtype)] if rank == 0 else None
    if rank == 0:
        store.set("metas", pickle.dumps([WeightMeta(n, tuple(t.shape), dtype) for n, t in named]))
    metas = pickle.loads(store.get("metas"))
    group = init_group("127.0.0.1", wire_port, rank, 2, "nccl" if gpus else "gloo")
    plan = buckets(metas)
    # raw: one buffer per bucket, allocated (and touched) once, on both sides
    raw_buffers = [torch.zeros(sum(metas[i].numel for i in b), dtype=getattr(torch, dtype), device=device)
                   for b in plan]
    views = []  # raw+load: the received tensors, by name, as views of those buffers
    for buf, b in zip(raw_buffers, plan):
        offset = 0
        for i in b:
            views.append((metas[i].name, buf[offset : offset + metas[i].numel].view(metas[i].shape)))
            offset += metas[i].numel
    if rank == 0:
        for buf, b in zip(raw_buffers, plan):
            torch.cat([named[i][1].reshape(-1) for i in b], out=buf)
        # wire: the learner's parameters as DeepSpeed ZeRO-1/2 holds them (views of one flat
        # buffer, in this order); wire (separate): as separate tensors (ZeRO-0/3, a plain module)
        flat = torch.cat([t.reshape(-1) for _, t in named])
        as_zero2, offset = [], 0
        for _, t in named:
            as_zero2.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        separate = [t.clone() for _, t in named]
    llm = None
    if rank == 1:
        from vllm import LLM

        from rollout.vllm_engine import engine_kwargs

        llm = LLM(**engine_kwargs(engine[0], engine[0].seed))
    raw_group.barrier().wait()
    times: dict[str, list[float]] = {"raw": [], "wire": [], "wire (separate)": [], "raw+load": []}
    for i in range(warmup + repeats):
        for side in times:
            raw_group.barrier().wait()
            started = time.perf_counter()
            if side in ("raw", "raw+load"):
                for buf in raw_buffers:
                    data_group.broadcast(buf, root=0).wait()
                sync()
                if side == "raw+load" and rank == 1:  # what a bare vLLM user does with them
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(views)})
                    llm.reset_prefix_cache()
                    sync()
            elif rank == 0:
                tensors = as_zero2 if side == "wire" else separate
                send(group, [[tensors[j] for j in b] for b in plan])
            else:
                for _ in receive(group, metas, device):
                    pass
            elapsed = time.perf_counter() - started
            if i >= warmup:
                times[side].append(elapsed)
    if rank == 1:  # the receiver's clock: a sync is over when the last byte arrived (and loaded)
        out.put({"times": times, "bytes": sum(m.nbytes for m in metas), "buckets": len(plan)})
    raw_group.barrier().wait()


def plain_pair(path: str, repeats: int, warmup: int, engine, gpus: list[str] | None = None,
               dtype: str = "float32", niceness: int = 0) -> dict[str, Any]:
    from bench.rollout import environment
    from rl.wire.collective import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, wire_port, raw_port = free_port(), free_port(), free_port()
    procs = [ctx.Process(target=_pair, args=(r, port, wire_port, path, repeats, warmup, engine, out, gpus, dtype,
                                             raw_port, niceness))
             for r in range(2)]
    # glibc reads its malloc settings as a process starts: both get the rollout actor's (on CPU
    # its kept heap, launch/allocator.py), so the bound reloads vLLM under the same allocator
    with environment({k: v for k, v in engine[1].items() if k.startswith("MALLOC_")}):
        for p in procs:
            p.start()
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                result = out.get(timeout=5)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"the raw/wire processes failed (exit codes {dead}) or took over 900 s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


# ---- ours: LearnerGroup -> RolloutFleet, as a run builds them ----------------------------------

def _reset_peak(worker) -> int:
    """Inside the rollout actor: reset its peak RSS to the current RSS; returns the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak(worker) -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_gpu_peak(worker) -> int:
    """Inside the rollout actor (GPU): reset torch's peak allocated memory; returns what is allocated."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _gpu_peak(worker) -> int:
    import torch

    return torch.cuda.max_memory_allocated()


def run_config(path: str, run_dir: str, device: str = "cpu"):
    """The run's config for this model, as `launch.train` composes it (typed); on GPUs with the GPU
    profile (`cluster=local_gpu`)."""
    from omegaconf import OmegaConf

    import launch.checks
    from rl.config.compose import compose

    # kl_coef=0: no reference model (it takes no part in a sync); peak_tflops given: no probe
    cfg = compose("train", [f"model.path={path}", f"run.dir={run_dir}", "rollout.max_model_len=128",
                            "algorithm.kl_coef=0", "cluster.peak_tflops=1",
                            *(["cluster=local_gpu"] if device == "cuda" else [])])
    launch.checks.resolve_paths(cfg)
    return cfg, OmegaConf.to_object(cfg)


def rollout_engine(config) -> tuple[Any, dict[str, str]]:
    """(RolloutSpec, environment) of rollout worker 0, as `build_components` makes them."""
    from launch.console import rollout_env
    from launch.components import worker_threads
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env

    threads = worker_threads(config)
    env = {**rollout_env(threads, config.cluster.gpus_per_rollout_worker > 0),
           **vllm_env(config.rollout.kv_cache_gib, threads, config.rollout.enforce_eager)}
    return RolloutSpec.from_config(config, threads), env


def ours(cfg, config, repeats: int, warmup: int) -> dict[str, Any]:
    import ray

    import launch.components
    from launch.cluster import Cluster
    from launch.console import actor_env
    from launch.placement import make_placement
    from rl.actors.faults import Deadlines
    from rollout.fleet import RolloutFleet
    from trainer.group import LearnerGroup
    from rl.wire.transports import make_weight_sync
    from trainer.learner_setup import LearnerSpec

    launch.components.start_ray(cfg)
    fleet = learner = None
    try:
        # what launch.components.build_components does, less the reward service
        threads, c = launch.components.worker_threads(config), config.cluster
        deadlines = Deadlines(config.run.call_timeout_s, config.run.call_timeout_factor, config.run.start_timeout_s)
        spec, env = rollout_engine(config)
        placement = make_placement(config, print)
        fleet = RolloutFleet(spec, num_cpus=1, num_gpus=c.gpus_per_rollout_worker, env_vars=env,
                             actor_options=placement.rollout, deadlines=deadlines, log=print)
        learner = LearnerGroup(LearnerSpec.from_config(config, threads), config.trainer.num_workers, num_cpus=1,
                               num_gpus=c.gpus_per_learner, env_vars=actor_env(threads, c.gpus_per_learner > 0,
                                                                                 config.trainer.cpu_allocator),
                               actor_options=placement.learner, deadlines=deadlines)
        weights = Cluster(fleet, learner, make_weight_sync(config.trainer.weight_sync, learner.group, learner.metas,
                                                           fleet.group, config.rollout.tensor_parallel_size, deadlines))
        weights.join()
        worker = fleet.workers[0]
        gpu = c.gpus_per_rollout_worker > 0
        walls, splits, peaks, gpu_peaks = [], [], [], []
        sent = 0.0
        for i in range(warmup + repeats):
            before = ray.get(worker.__ray_call__.remote(_reset_peak))
            gpu_before = ray.get(worker.__ray_call__.remote(_reset_gpu_peak)) if gpu else 0
            started = time.perf_counter()
            sent = weights.sync(i + 1)
            wall = time.perf_counter() - started
            stats = ray.get(worker.sync_stats.remote())
            peak = ray.get(worker.__ray_call__.remote(_peak)) - before
            if i >= warmup:
                walls.append(wall)
                splits.append(stats)
                peaks.append(peak)
                if gpu:
                    gpu_peaks.append(ray.get(worker.__ray_call__.remote(_gpu_peak)) - gpu_before)
    finally:
        for part in (learner, fleet):
            if part is not None:
                part.shutdown()
        ray.shutdown()

    def median(key: str) -> float:
        return statistics.median(s[key] for s in splits)

    return {"bytes": sent, "times": walls, "receive_s": median("receive_s"), "load_s": median("load_s"),
            "worker_s": median("total_s"), "peak_extra_rss_bytes": statistics.median(peaks), "threads": threads,
            **({"peak_extra_gpu_bytes": statistics.median(gpu_peaks)} if gpu_peaks else {})}


# ---- report -----------------------------------------------------------------------------------

def gbps(nbytes: float, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(shape: str, repeats: int, warmup: int, device: str = "cpu") -> dict[str, Any]:
    path = model_path(shape)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg, config = run_config(path, run_dir, device)
        pair = plain_pair(path, repeats, warmup, rollout_engine(config), visible_gpus()[:2] if device == "cuda" else None,
                          config.model.dtype, config.cluster.worker_niceness)
        full = ours(cfg, config, repeats, warmup)
    nbytes = pair["bytes"]
    assert abs(full["bytes"] - nbytes) < 1, (full["bytes"], nbytes)
    t = pair["times"]
    raw, wire, raw_load = gbps(nbytes, t["raw"]), gbps(nbytes, t["wire"]), gbps(nbytes, t["raw+load"])
    wire_separate = gbps(nbytes, t["wire (separate)"])
    total = gbps(nbytes, full["times"])
    wall = statistics.median(full["times"])
    row = {
        "shape": shape, "model": path, "bytes": nbytes, "mib": nbytes / 2**20, "buckets": pair["buckets"],
        "raw_gb_per_s": raw, "wire_gb_per_s": wire, "raw_load_gb_per_s": raw_load, "ours_gb_per_s": total,
        "wire_separate_gb_per_s": wire_separate, "wire_over_raw": wire / raw,
        "wire_separate_over_raw": wire_separate / raw, "ours_over_raw_load": total / raw_load, "ours_over_raw": total / raw,
        "raw_load_split_s": {"broadcast": statistics.median(t["raw"]),
                             "load": statistics.median(t["raw+load"]) - statistics.median(t["raw"])},
        "ours_split_s": {"wall": wall, "receive": full["receive_s"], "load": full["load_s"],
                         "learner_and_ray": wall - full["worker_s"]},
        "ours_receive_gb_per_s": nbytes / full["receive_s"] / 1e9,
        "peak_extra_rss_mib": full["peak_extra_rss_bytes"] / 2**20,
        "times_s": {**t, "ours": full["times"]},
        "threads_per_actor": full["threads"], "dtype": config.model.dtype, "niceness": config.cluster.worker_niceness,
    }
    if "peak_extra_gpu_bytes" in full:
        row["peak_extra_gpu_mib"] = full["peak_extra_gpu_bytes"] / 2**20
    print(table([row], header=False), flush=True)
    return row


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES names them (or as indices when it is unset)."""
    import torch

    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g.strip() for g in given.split(",") if g.strip()] if given else [str(i) for i in range(torch.cuda.device_count())]


def table(rows: list[dict], header: bool = True) -> str:
    """The results as fixed-width lines (a row alone, `header=False`, as each shape finishes)."""
    head = (f"{'shape':>5} {'MiB':>5} | {'raw':>6} {'wire':>6} {'wire/raw':>8} {'sep.':>5} | {'raw+load':>8} {'ours':>6} "
            f"{'ours/raw+load':>13} | {'ours s':>7} {'receive':>7} {'load':>6} {'other':>6} | {'bare load':>9} "
            f"{'peak+MiB':>8} {'GPU+MiB':>7}")
    lines = ["GB/s of one full sync (median); sep.: wire/raw with separate tensors; ours split in seconds; "
             "bare load: vLLM reload_weights in raw+load; peak+: extra RSS and GPU memory of the receiver",
             head, "-" * len(head)] if header else []
    for r in rows:
        s = r["ours_split_s"]
        lines.append(f"{r['shape']:>5} {r['mib']:>5.0f} | {r['raw_gb_per_s']:>6.2f} {r['wire_gb_per_s']:>6.2f} "
                     f"{r['wire_over_raw']:>8.2f} {r['wire_separate_over_raw']:>5.2f} | {r['raw_load_gb_per_s']:>8.3f} "
                     f"{r['ours_gb_per_s']:>6.3f} "
                     f"{r['ours_over_raw_load']:>13.2f} | {s['wall']:>7.3f} {s['receive']:>7.3f} {s['load']:>6.3f} "
                     f"{s['learner_and_ray']:>6.3f} | {r['raw_load_split_s']['load']:>9.3f} {r['peak_extra_rss_mib']:>8.0f} "
                     f"{r.get('peak_extra_gpu_mib', float('nan')):>7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from bench.machine import add_device_arg, machine_info, resolve_device, write_result
    from launch.console import quiet_driver
    from rl.wire.format import BUCKET_BYTES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="27m only, 3 repeats")
    parser.add_argument("--shapes", default="27m,100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="bench/results/weight_sync.json")
    add_device_arg(parser, "the learner, the rollout worker and the raw pair")
    args = parser.parse_args(argv)
    gpu = resolve_device(parser, args, 2, "a learner rank and a rollout worker on a GPU each: NCCL refuses two "
                         "members of a group on one GPU") == "cuda"
    if args.quick:
        args.shapes, args.repeats = "27m", 3
    quiet_driver()
    info = machine_info()
    rows = [measure(shape, args.repeats, args.warmup, args.device) for shape in args.shapes.split(",")]
    result = {"machine": info, "settings": {"bucket_bytes": BUCKET_BYTES, "dtype": "bfloat16" if gpu else "float32",
                                            "repeats": args.repeats, "warmup": args.warmup,
                                            "backend": "nccl" if gpu else "gloo", "device": args.device,
                                            "rollout_workers": 1, "learner_ranks": 1},
              "results": rows, "targets": {"wire_over_raw": 0.8, "ours_over_raw_load": 0.8},
              "meets_targets": all(r["wire_over_raw"] >= 0.8 and r["ours_over_raw_load"] >= 0.8 for r in rows)}
    print()
    print(table(rows))
    print(f"targets wire/raw >= 0.8 and ours/raw+load >= 0.8: {'met' if result['meets_targets'] else 'NOT met'}")
    write_result(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
