"""Rollout benchmark: generated tokens/s through our `RolloutFleet` against the bare vLLM engine.

Both sides generate the same requests on the same model (a `bench/models.py` shape, `27m` by
default: random-init Llama, hidden 512, 6 layers, 8k byte-level BPE vocab) with the same engine
settings: `rollout.vllm_engine.engine_kwargs` of the run's default config with 128 new tokens;
one request per sample, each with its own seed (as `rl.data.dataset` makes them), temperature 1, top-p 1,
the sampled token's log-prob returned.

- fleet: `RolloutFleet.generate(requests) -> list[Sample]`, called from this driver, with one
  `RolloutWorker` Ray actor built as `launch.components.build_components` builds it (local Ray started by
  `launch.components.start_ray`, the actor's environment, thread count, 1 CPU and placement bundle).
  Its time is split, with timers put into the actor: vLLM (`LLM.generate` inside the actor), ours
  (the engine's SamplingParams and conversion to Samples) and Ray (the rest: the calls, moving
  requests and Samples, splitting and sorting).
- raw: `vllm.LLM(**engine_kwargs).generate(prompts, sampling_params)` in a plain process started
  with the actor's environment and CPU priority (`cluster.worker_niceness`, read from the actor); its outputs
  are counted, nothing is converted.

Batches: 8 prompts x 4 samples (32 requests) and 16 x 4 (64 requests), 128 new tokens each. The
two sides take turns (fleet, raw, fleet, raw...), never generating at once, so that load from other
processes on a shared machine falls on both alike; warm-up batches are excluded and the median of
the timed ones is reported. Tokens are the completion tokens generated: the same on both sides
(same seeds; the bench checks that the token ids match). Target: fleet / raw >= 0.9.

On a GPU (`--device cuda`, the default where torch sees one) the config is the one GPU profile's,
`cluster=local_gpu` (the rollout worker given a GPU by Ray, bf16, CUDA graphs: `rollout.enforce_eager
=false`), with `cluster.gpus_per_learner=0` (no learner here) and `rollout.gpu_memory_utilization`
0.4 (`--gpu-memory-utilization`) instead of 0.85: the raw engine runs on the same GPU as the
worker's (its `CUDA_VISIBLE_DEVICES`), both engines resident, so each takes a share that leaves
room for the other; same engine arguments on both sides as on CPU.

    python -m bench.rollout [--quick] [--shape 27m|smollm2] [--batches 8x4,16x4] [--repeats 5] [--warmup 1]
                            [--dtype float32|bfloat16] [--device cpu|cuda] [--out bench/results/rollout.json]

`--shape smollm2`: the real SmolLM2-135M-Instruct (`bench.models.REAL_MODELS`). Each row also gives
the memory-bandwidth bound of decoding (the weights' bytes x the batch's token steps / the
bandwidth measured in this process, `rl.plan.flops.memory_bandwidth_gbs`) and the share of it reached.

`--quick`: the 8x4 batch only, 3 timed repeats (about 1-2 minutes on 2 cores, half of it start-up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.machine import add_device_arg, machine_info, resolve_device, write_result
from rl.plan.flops import memory_bandwidth_gbs

NEW_TOKENS = 128
SAMPLES_PER_PROMPT = 4
MAX_MODEL_LEN = 256
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer",
    "In a distant galaxy, a small robot learned to",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: what is 17 times 23? Answer:",
    "Once upon a time there was a princess who lived in a tower made of",
    "The history of the printing press begins in",
    "SELECT name, COUNT(*) FROM orders WHERE",
    "Dear committee, I am writing to apply for the position of",
    "To make bread you need flour, water, salt and",
    "import numpy as np\nx = np.linspace(0, 1, 100)\n",
    "The mitochondria is the powerhouse of the cell because",
    "Breaking news: scientists have discovered that",
    "Step 1: preheat the oven to 200 degrees. Step 2:",
    "The theorem states that for every prime p greater than two",
    "Roses are red, violets are blue,",
    "She opened the door and saw",
]


# ---- the model and the requests ---------------------------------------------------------------

def model_path(shape: str) -> str:
    from bench.models import build

    return str(build(shape).resolve())


def make_requests(tokenizer, prompts: int, n: int, seed: int = 0):
    """`prompts` x `n` GenerationRequests, seeds derived as `rl.data.dataset` derives them (step 0)."""
    from rl.data.dataset import derive_seed
    from rl.data.types import GenerationRequest

    texts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(prompts)]
    return [GenerationRequest(tokenizer(t).input_ids, t, g, k, derive_seed(seed, 0, g, k))
            for g, t in enumerate(texts) for k in range(n)]


def parse_batches(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in b.split("x")) for b in text.split(",") if b]  # type: ignore[misc]


# ---- machine ----------------------------------------------------------------------------------

# ---- the config as a run makes it -------------------------------------------------------------

def lengths(model: str, longest_prompt: int) -> tuple[int, int]:
    """(max_model_len, new tokens): MAX_MODEL_LEN and NEW_TOKENS, or less for a model whose
    position limit is smaller."""
    limit = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings", MAX_MODEL_LEN)
    max_len = min(MAX_MODEL_LEN, limit)
    return max_len, min(NEW_TOKENS, max_len - longest_prompt)


def device_overrides(device: str, gpu_memory_utilization: float) -> list[str]:
    """The config of a GPU run (the local GPU profile) for a rollout worker alone, sharing its GPU
    with the raw engine; nothing on CPU."""
    if device != "cuda":
        return []
    return ["cluster=local_gpu", "cluster.gpus_per_learner=0", f"rollout.gpu_memory_utilization={gpu_memory_utilization}"]


def run_config(model: str, run_dir: str, max_len: int, new_tokens: int, extra: list[str] = ()) -> Any:
    """The composed, validated config of `launch.train` for this model (paths resolved)."""
    import launch.checks
    from rl.config.compose import compose

    cfg = compose("train", [f"model.path={model}", f"run.dir={run_dir}", f"rollout.max_new_tokens={new_tokens}",
                            f"rollout.n={SAMPLES_PER_PROMPT}", f"rollout.max_model_len={max_len}", *extra])
    launch.checks.resolve_paths(cfg)
    return cfg


def start_fleet(cfg):
    """Local Ray and one rollout worker, exactly as `launch.train` starts them."""
    from omegaconf import OmegaConf

    from launch.console import rollout_env
    from launch.placement import make_placement
    from launch.components import start_ray, worker_threads
    from rl.actors.faults import Deadlines
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env

    start_ray(cfg)
    config = OmegaConf.to_object(cfg)
    threads, c = worker_threads(config), config.cluster
    env = {**rollout_env(threads, c.gpus_per_rollout_worker > 0),
           **vllm_env(config.rollout.kv_cache_gib, threads, config.rollout.enforce_eager)}
    placement = make_placement(config, print)
    deadlines = Deadlines(config.run.call_timeout_s, config.run.call_timeout_factor, config.run.start_timeout_s)
    fleet = RolloutFleet(RolloutSpec.from_config(config, threads), num_cpus=1, num_gpus=c.gpus_per_rollout_worker,
                         env_vars=env, actor_options=placement.rollout, deadlines=deadlines, log=print)
    return fleet, RolloutSpec.from_config(config, threads), env


# ---- the raw side: vllm.LLM in a process of its own -------------------------------------------

def _niceness(worker=None) -> int:
    return os.nice(0)


def _visible_devices(worker=None) -> str | None:
    """Inside the rollout actor: the GPU(s) Ray gave it, as CUDA_VISIBLE_DEVICES."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _raw_server(spec, niceness: int, conn) -> None:
    """Child process: a bare vLLM engine with the rollout worker's engine arguments, at its CPU
    priority; answers each list of (prompt_ids, seed) with (seconds in `LLM.generate`, tokens,
    token ids); None ends it."""
    os.nice(niceness - os.nice(0))
    from vllm import LLM, SamplingParams

    from rollout.vllm_engine import engine_kwargs

    llm = LLM(**engine_kwargs(spec, spec.seed))  # worker 0 seeds its engine with run.seed + 0
    r = spec.rollout
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        prompts = [{"prompt_token_ids": ids} for ids, _ in msg]
        params = [SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
                                 seed=seed, logprobs=0) for _, seed in msg]
        started = time.perf_counter()
        outputs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        conn.send((elapsed, sum(map(len, ids)), ids))


@contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RawEngine:
    def __init__(self, spec, env: dict[str, str], niceness: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # The child starts with the rollout actor's environment (threads, vLLM switches, quiet logs).
        with environment({**env, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}):
            self.proc = ctx.Process(target=_raw_server, args=(spec, niceness, child), daemon=True)
            self.proc.start()
        if not self.conn.poll(900) or self.conn.recv() != "ready":
            raise RuntimeError("the raw vLLM engine did not start in 900 s")

    def generate(self, requests) -> tuple[float, int, list[list[int]]]:
        self.conn.send([(list(r.prompt_ids), r.seed) for r in requests])
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)


# ---- measurement ------------------------------------------------------------------------------

def _instrument(worker) -> None:
    """Inside the rollout actor: time `vllm.LLM.generate` and the engine's whole `generate`
    (the difference: building SamplingParams and converting outputs to Samples)."""
    engine = worker.engine
    worker.bench_times = times = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = time.perf_counter() - started
        return call

    engine.llm.generate = timed("vllm_s", engine.llm.generate)
    engine.generate = timed("engine_s", engine.generate)


def _times(worker) -> dict[str, float]:
    return dict(worker.bench_times)


def fleet_generate(fleet, requests) -> tuple[float, int, list[list[int]], dict[str, float]]:
    import ray

    started = time.perf_counter()
    samples = fleet.generate(requests)
    elapsed = time.perf_counter() - started
    ids = [s.completion_ids for s in samples]
    inner = ray.get(fleet.workers[0].__ray_call__.remote(_times))
    split = {"vllm_s": inner["vllm_s"], "convert_s": inner["engine_s"] - inner["vllm_s"],
             "ray_s": elapsed - inner["engine_s"]}
    return elapsed, sum(map(len, ids)), ids, split


def weight_bytes(model: str, dtype: str) -> int:
    """Bytes of the model's weights at the engine's dtype (tied weights once): the memory
    planner's parameter count (`rl.plan.memory_plan.ModelShape`) of its config.json."""
    import torch

    from rl.plan.memory_plan import ModelShape

    params = ModelShape.from_config(json.loads((Path(model) / "config.json").read_text())).params()
    return params * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def decode_bound(row: dict, ids: list[list[int]], weights: int, bandwidth_gbs: float) -> None:
    """Add the memory-bandwidth bound of decoding to `row`: every token step of the batch reads
    all the weights once (KV cache and activations not counted), so a batch whose longest
    completion is T tokens takes at least weights x T / bandwidth."""
    steps = max(map(len, ids))
    bound = weights * steps / (bandwidth_gbs * 1e9)
    row.update({"token_steps": steps, "weight_bytes": weights, "decode_bound_s": bound,
                "bound_over_fleet": bound / statistics.median(row["fleet_s"]),
                "bound_over_raw": bound / statistics.median(row["raw_s"])})


def measure(fleet, raw: RawEngine, tokenizer, batches: list[tuple[int, int]], repeats: int, warmup: int,
            weights: int, bandwidth_gbs: float) -> list[dict]:
    rows = []
    for prompts, n in batches:
        requests = make_requests(tokenizer, prompts, n)
        times: dict[str, list[float]] = {"fleet": [], "raw": []}
        splits: list[dict[str, float]] = []
        tokens: dict[str, int] = {}
        ids: dict[str, list[list[int]]] = {}
        for i in range(warmup + repeats):
            elapsed, tokens["fleet"], ids["fleet"], split = fleet_generate(fleet, requests)
            if i >= warmup:
                times["fleet"].append(elapsed)
                splits.append(split)
            elapsed, tokens["raw"], ids["raw"] = raw.generate(requests)
            if i >= warmup:
                times["raw"].append(elapsed)
        fleet_tps = tokens["fleet"] / statistics.median(times["fleet"])
        raw_tps = tokens["raw"] / statistics.median(times["raw"])
        overhead = {k: statistics.median(s[k] for s in splits) for k in ("vllm_s", "convert_s", "ray_s")}
        row = {"batch": f"{prompts}x{n}", "requests": len(requests), "max_new_tokens": fleet.spec.rollout.max_new_tokens,
               "tokens": tokens["fleet"], "same_tokens": ids["fleet"] == ids["raw"],
               "fleet_tokens_per_s": fleet_tps, "raw_tokens_per_s": raw_tps, "ratio": fleet_tps / raw_tps,
               "fleet_split_s": overhead, "fleet_s": times["fleet"], "raw_s": times["raw"], "fleet_splits_s": splits}
        decode_bound(row, ids["fleet"], weights, bandwidth_gbs)
        print(table([row], header=not rows), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict], header: bool = True) -> str:
    """The results as fixed-width lines (a row alone, `header=False`, as each batch finishes)."""
    head = (f"{'batch':>6} {'requests':>8} {'tokens':>7} {'fleet tok/s':>12} {'raw tok/s':>10} {'fleet/raw':>10} "
            f"{'same ids':>9} | {'fleet s = vLLM':>14} {'+ ours':>7} {'+ Ray':>6} | {'bound s':>7} {'of fleet':>8}")
    lines = [head, "-" * len(head)] if header else []
    for r in rows:
        s = r["fleet_split_s"]
        lines.append(f"{r['batch']:>6} {r['requests']:>8} {r['tokens']:>7} {r['fleet_tokens_per_s']:>12.1f} "
                     f"{r['raw_tokens_per_s']:>10.1f} {r['ratio']:>10.3f} {str(r['same_tokens']):>9} | "
                     f"{s['vllm_s']:>14.3f} {s['convert_s']:>7.3f} {s['ray_s']:>6.3f} | "
                     f"{r['decode_bound_s']:>7.2f} {r['bound_over_fleet']:>8.0%}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    import ray
    from transformers import AutoTokenizer

    from launch.console import quiet_driver

    quiet_driver()
    model = model_path(args.shape)
    tokenizer = AutoTokenizer.from_pretrained(model)
    batches = parse_batches(args.batches)
    longest = max(len(r.prompt_ids) for r in make_requests(tokenizer, max(p for p, _ in batches), 1))
    max_len, new_tokens = lengths(model, longest)
    with tempfile.TemporaryDirectory() as run_dir:
        dtype = [f"model.dtype={args.dtype}"] if args.dtype else []
        cfg = run_config(model, run_dir, max_len, new_tokens,
                         [*device_overrides(args.device, args.gpu_memory_utilization), *dtype])
        info = machine_info()
        info["memory_bandwidth_gbs"] = memory_bandwidth_gbs()
        fleet, spec, env = start_fleet(cfg)
        ray.get(fleet.workers[0].__ray_call__.remote(_instrument))
        # the raw engine gets the actor's CPU priority (`cluster.worker_niceness`), so that other
        # load on the machine weighs on both sides alike
        niceness = ray.get(fleet.workers[0].__ray_call__.remote(_niceness))
        if args.device == "cuda":  # the raw engine on the worker's GPU
            env = {**env, "CUDA_VISIBLE_DEVICES": ray.get(fleet.workers[0].__ray_call__.remote(_visible_devices))}
        raw = None
        try:
            raw = RawEngine(spec, env, niceness)
            rows = measure(fleet, raw, tokenizer, batches, args.repeats, args.warmup,
                           weight_bytes(model, spec.model.dtype), info["memory_bandwidth_gbs"])
        finally:
            if raw is not None:
                raw.close()
            fleet.shutdown()
            ray.shutdown()
    settings = {"shape": args.shape, "model": model, "new_tokens": new_tokens, "max_model_len": max_len,
                "repeats": args.repeats, "warmup": args.warmup, "threads": spec.threads, "niceness": niceness,
                "rollout": {k: getattr(spec.rollout, k) for k in ("temperature", "top_p", "enforce_eager", "kv_cache_gib")},
                "dtype": spec.model.dtype, "device": args.device}
    if args.device == "cuda":
        settings["rollout"]["gpu_memory_utilization"] = spec.rollout.gpu_memory_utilization
        settings["cuda_visible_devices"] = env["CUDA_VISIBLE_DEVICES"]
    return {"machine": info, "settings": settings, "results": rows, "target_ratio": 0.9,
            "meets_target": all(r["ratio"] >= 0.9 for r in rows)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 8x4 batch, 3 repeats")
    parser.add_argument("--shape", default="27m", help="bench/models.py shape (27m, tiny, ...)")
    parser.add_argument("--batches", default="8x4,16x4", help="prompts x samples per prompt, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the engine's dtype (default: the run config's for the device)")
    parser.add_argument("--out", default="bench/results/rollout.json")
    add_device_arg(parser, "both engines")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="GPU: each engine's share of the one GPU both use (the run's profile has 0.85)")
    args = parser.parse_args(argv)
    resolve_device(parser, args)
    if args.quick:
        args.batches, args.repeats = "8x4", 3
    result = run(args)
    print()
    print(table(result["results"]))
    print(f"target fleet/raw >= {result['target_ratio']}: {'met' if result['meets_target'] else 'NOT met'}")
    write_result(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
