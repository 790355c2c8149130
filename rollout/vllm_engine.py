"""vLLM backend (CPU build on CPU machines, CUDA build on GPUs): the engine in the calling process,
its model too without tensor parallelism, else in one vLLM worker process per TP rank."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Iterator

import torch

from rl.config.schema import RolloutConfig
from rl.data.types import GenerationRequest, Sample
from rl.wire.ipc import IpcReceiver
from rollout.protocol import BatchQueue, RolloutSpec, each_or_refused


def vllm_env(kv_cache_gib: int, threads: int, eager: bool = True) -> dict[str, str]:
    """Environment a process needs before importing vLLM so the engine runs inside it.

    `eager` (`rollout.enforce_eager`): no torch.compile at all. vLLM compiles a few sampler helpers
    even in eager mode (the sampled token's rank, `batched_count_greater_than`): 3.3 s of Dynamo
    and Inductor on the first rollout of every engine on a 2-core CPU, for an op that takes
    microseconds uncompiled. Torch reads the switch when vLLM's module applies the decorator."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process (a Ray actor), no subprocess
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # fastest measured on small shared CPU boxes
        "TOKENIZERS_PARALLELISM": "false",
    }
    if eager is not False:  # "auto" not decided by launch (a config built by hand): eager
        env["TORCHDYNAMO_DISABLE"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _cpu_scheduler_kwargs(max_model_len: int) -> dict[str, Any]:
    """vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a request with its own
    seed is prefilled in chunks (a batch of prompts over max_num_batched_tokens): it rewinds the
    request's generator offset, which CPU generators lack. Whole-prompt prefill avoids that path."""
    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}


def engine_kwargs(spec: RolloutSpec, seed: int) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments of an engine built from `spec` (bench/rollout.py builds a bare
    engine from the same ones)."""
    r = spec.rollout
    tp = r.tensor_parallel_size
    return dict(
        model=spec.model.path,
        dtype=spec.model.dtype,
        max_model_len=r.max_model_len,
        seed=seed,
        enforce_eager=r.enforce_eager is not False,  # "auto" is decided by launch; undecided: eager
        gpu_memory_utilization=r.gpu_memory_utilization,
        # Log-probs after temperature, i.e. of the distribution the tokens were drawn from;
        # the learner divides its logits by the same temperature.
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        use_tqdm_on_load=False,  # a progress bar for loading a few files is noise
        enable_sleep_mode=r.sleep_between_steps and spec.gpu,  # sleep is a no-op on CPU
        # hybrid placement: the learner on the same GPU sends by CUDA IPC (rl/wire/ipc.py)
        **({"weight_transfer_config": {"backend": "ipc"}} if spec.weight_sync == "ipc" else {}),
        tensor_parallel_size=tp,
        # TP workers are subprocesses of this actor. Set explicitly: in a Ray placement group vLLM
        # picks its "ray" executor (vllm/config/parallel.py), which on CPU fails ("current platform
        # cpu does not support ray") and on GPUs asks Ray for GPUs this actor already holds.
        **({"distributed_executor_backend": "mp"} if tp > 1 else {}),
        # the weight sync and tied-parameter fix-up inside each vLLM worker process
        worker_extension_cls="rollout.vllm_worker.SyncExtension",
        **_cpu_scheduler_kwargs(r.max_model_len),
        # requests that name a saved adapter (GenerationRequest.adapter) sample through vLLM's LoRA
        **({"enable_lora": True, "max_loras": r.max_loras, "max_lora_rank": r.max_lora_rank}
           if r.max_loras > 0 else {}),
    )


def sampling_params(rollout: RolloutConfig, req: GenerationRequest, **extra: Any):
    """vLLM's SamplingParams of one request: one sample with its own seed (reproducible whatever
    the batching), the run's sampling unless the request sets its temperature or token budget,
    and the sampled token's log-prob only; past EOS to the budget where the request or
    `rollout.ignore_eos` asks."""
    from vllm import SamplingParams

    own = {"top_k": req.top_k} if req.top_k is not None and req.top_k > 0 else {}
    if req.stop:
        own["stop"] = list(req.stop)
    if req.stop_token_ids:
        own["stop_token_ids"] = list(req.stop_token_ids)
    if req.prompt_logprobs:
        own["prompt_logprobs"] = 0  # the prompt token's own log-prob
    return SamplingParams(
        n=1, temperature=rollout.temperature if req.temperature is None else req.temperature,
        top_p=rollout.top_p if req.top_p is None else req.top_p,
        max_tokens=rollout.max_new_tokens if req.max_tokens is None else req.max_tokens, seed=req.seed,
        logprobs=0, ignore_eos=req.ignore_eos or rollout.ignore_eos, **own, **extra)


def adapter_version(folder: str) -> tuple:
    """What tells one save of an adapter folder from another: the folder's and its files' inode,
    size and modification time. A folder saved again under the same path (the Tinker service's
    `save_weights_for_sampler` with a name used before) is a new folder and new files
    (trainer/adapter_trainer.swap_in), so its version differs even when the sizes do not."""
    try:
        files = []
        with os.scandir(folder) as entries:
            for entry in entries:
                st = entry.stat()
                files.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        st = os.stat(folder)
    except OSError:  # gone or not a folder: vLLM's load names the problem
        return ()
    return (st.st_ino, st.st_mtime_ns, tuple(sorted(files)))


class AdapterRequests:
    """vLLM's `LoRARequest` of each adapter folder a request names (`GenerationRequest.adapter`).
    vLLM caches a loaded adapter by its integer id, so each *version* of a folder (`adapter_version`)
    gets an id of its own: a request always samples the weights saved last under its folder, never
    a copy cached from an earlier save. The ids a newer save retired wait in `stale` for the engine
    to unload (`take_stale`)."""

    def __init__(self) -> None:
        self._current: dict[str, tuple[tuple, int]] = {}  # folder -> (its version, its id)
        self._next_id = 1
        self.stale: list[int] = []

    def __call__(self, req: GenerationRequest):
        if req.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        version = adapter_version(req.adapter)
        known = self._current.get(req.adapter)
        if known is None or known[0] != version:
            if known is not None:
                self.stale.append(known[1])
            known = self._current[req.adapter] = (version, self._next_id)
            self._next_id += 1
        lora_id = known[1]
        return LoRARequest(f"adapter-{lora_id}", lora_id, req.adapter)

    def take_stale(self) -> list[int]:
        stale, self.stale = self.stale, []
        return stale


# ---- adapters merged into the engine's weights, one batch at a time (rollout.max_loras=0) ----------

def read_adapter(folder: str) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """A peft LoRA folder (adapter_config.json, adapter_model.safetensors): its matrices by the
    module they adapt, {module: (A [rank, in], B [out, rank])}, and its scaling (lora_alpha / r,
    or lora_alpha / sqrt(r) with rsLoRA)."""
    from safetensors.torch import load_file

    from rl.wire.lora import split_wire_name, wire_name

    try:
        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.load(f)
        tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    except OSError as err:  # the request's fault (a folder gone or not an adapter), not the engine's
        raise ValueError(f"adapter {folder}: {err}") from None
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save") if config.get(k)]
    if unsupported:
        raise ValueError(f"adapter {folder}: {unsupported} cannot be merged into the base weights (plain LoRA only)")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if ".base_layer." in name:  # peft also saves an adapted embedding layer's (frozen) base weight
            continue
        module, part = split_wire_name(wire_name(name))
        pairs.setdefault(module, {})[part] = tensor
    unpaired = sorted(m for m, p in pairs.items() if len(p) != 2)
    if unpaired:
        raise ValueError(f"adapter {folder}: LoRA matrices without their pair: {unpaired}")
    return {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items()}, scaling


class _Checkpoint:
    """The base model's weights as its safetensors files store them, read when asked (mmapped)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.files: dict[str, str] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, "pt") as f:
                self.files.update(dict.fromkeys(f.keys(), file))

    def get(self, name: str) -> torch.Tensor | None:
        from safetensors import safe_open

        if name not in self.files:
            return None
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)


class MergedAdapters:
    """Sampling with a saved adapter at the base model's speed on vLLM's CPU build: for one batch,
    each layer the adapter touches computes with W + scaling * B @ A (merged in fp32 from the
    checkpoint's W, cast once to the engine's dtype, as the RL LoRA sync merges, rl/wire/lora.py)
    instead of the base W, and afterwards with exactly the base W again.

    On CPU vLLM packs each linear layer's weight for its GEMM kernel once (oneDNN, or sgl-kernel)
    and keeps only the packed copy, called through the layer's `cpu_linear`
    (vllm/model_executor/layers/utils.dispatch_cpu_unquantized_gemm). A merge packs the merged
    weight the same way and swaps the layer's `cpu_linear` for that one; restoring swaps the base
    one back: the very object the engine had, so the base is restored bit for bit and nothing of
    the base is copied. The LM head's adapter (`train_unembed`) goes on the LM head's GEMM only:
    with tied embeddings the input embedding table (the same tensor) is left as it was, as peft's
    adapter leaves it. The layers of the adapter merged last are kept packed (one adapter's worth):
    its next batch swaps them in without merging again. A folder saved again is another version
    (`adapter_version`) and is merged afresh."""

    def __init__(self, model: torch.nn.Module, model_path: str, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.checkpoint = _Checkpoint(model_path)
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self.stacked = {leaf: (packed, i) for packed, leaves in self.packed.items() for i, leaf in enumerate(leaves)}
        self._kept: tuple[Any, dict[str, tuple[torch.nn.Module, Callable]]] | None = None
        self.merges = 0  # adapters merged (not counting batches that reused the kept one)

    def _target(self, module: str) -> tuple[str, int]:
        """The engine's layer that computes the checkpoint's `module`, and which part of its
        stacked output that module is (0 when not stacked: q/k/v are one layer in vLLM)."""
        parent, _, leaf = module.rpartition(".")
        if leaf in self.stacked:
            packed, i = self.stacked[leaf]
            return (f"{parent}.{packed}" if parent else packed), i
        return module, 0

    def _base(self, target: str, layer: torch.nn.Module) -> tuple[torch.Tensor, list[int]]:
        """The fp32 base weight of the engine's layer `target` as it stacks its parts, and where
        each part starts."""
        parent, _, leaf = target.rpartition(".")
        parts = [f"{parent}.{p}" if parent else p for p in self.packed.get(leaf, [leaf])] if leaf in self.packed \
            else [target]
        tensors = [self.checkpoint.get(f"{p}.weight") for p in parts]
        if any(t is None for t in tensors):
            own = getattr(layer, "weight", None)  # the LM head tied to the embeddings: the table itself
            if len(parts) > 1 or own is None or own.numel() == 0:
                missing = [p for p, t in zip(parts, tensors) if t is None]
                raise ValueError(f"the adapter changes {missing}, whose base weights the model's checkpoint does not "
                                 "hold")
            tensors = [own.detach().float().clone()]  # (never changed in place: a copy)
        starts = [0]
        for t in tensors[:-1]:
            starts.append(starts[-1] + t.shape[0])
        # (read from the checkpoint: tensors of their own, changed in place below)
        return torch.cat([t.float() for t in tensors]) if len(tensors) > 1 else tensors[0].float(), starts

    def _merge(self, folder: str) -> dict[str, tuple[torch.nn.Module, Callable]]:
        """{layer name: (the engine's layer, its GEMM with the adapter merged in)}."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        pairs, scaling = read_adapter(folder)
        by_layer: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, str]]] = {}
        for module, (a, b) in sorted(pairs.items()):
            target, part = self._target(module)
            by_layer.setdefault(target, []).append((part, a, b, module))
        out: dict[str, tuple[torch.nn.Module, Callable]] = {}
        for target, members in by_layer.items():
            try:
                layer = self.model.get_submodule(target)
            except AttributeError:
                raise ValueError(f"the adapter changes {members[0][3]}, which the served model has no layer "
                                 f"{target!r} for") from None
            if not callable(getattr(layer, "cpu_linear", None)):
                raise ValueError(f"layer {target!r} has no CPU GEMM to swap (merged adapters need vLLM's CPU build and "
                                 "unquantized weights; use vLLM's LoRA: rollout.max_loras >= 1)")
            weight, starts = self._base(target, layer)
            for part, a, b, module in members:
                start = starts[part]
                rows = (starts[part + 1] if part + 1 < len(starts) else weight.shape[0]) - start
                if a.shape[1] != weight.shape[1] or b.shape[0] != rows or a.shape[0] != b.shape[1]:
                    raise ValueError(f"adapter {folder}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                     f"its base weight [{rows}, {weight.shape[1]}]")
                weight[start:start + rows].addmm_(b.float(), a.float(), alpha=scaling)
            own = getattr(layer, "weight", None)
            if own is not None and own.ndim == 2 and own.shape[0] > weight.shape[0]:  # a vocabulary padded by vLLM
                weight = torch.cat([weight, torch.zeros(own.shape[0] - weight.shape[0], weight.shape[1])])
            holder = torch.nn.Module()
            holder.weight = torch.nn.Parameter(weight.to(self.dtype), requires_grad=False)
            holder.bias = None
            dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
            gemm = holder.cpu_linear
            if holder.weight.numel():  # torch's plain linear: it takes the weight it is called with
                merged = holder.weight

                def gemm(x, weight, bias, _linear=holder.cpu_linear, _merged=merged):  # noqa: ANN001
                    return _linear(x, _merged, bias)
            out[target] = (layer, gemm)
        return out

    @contextlib.contextmanager
    def merged(self, folder: str, key: Any) -> Iterator[None]:
        """Inside: the engine computes with adapter `folder` (whose save `key` names) merged in."""
        if self._kept is None or self._kept[0] != key:
            self._kept = None  # the older adapter's packed layers go before the new ones are made
            self._kept = (key, self._merge(folder))
            self.merges += 1
        saved: list[tuple[torch.nn.Module, Callable]] = []
        try:
            for layer, gemm in self._kept[1].values():
                saved.append((layer, layer.cpu_linear))
                layer.cpu_linear = gemm
            yield
        finally:
            for layer, base in saved:
                layer.cpu_linear = base

    def forget(self) -> None:
        self._kept = None


def _served_model(worker: Any) -> torch.nn.Module:
    """(run by `collective_rpc` in the engine's worker) the model it runs."""
    return worker.model_runner.model


def prompt_logprobs_of(req: GenerationRequest, out: Any) -> list[float | None] | None:
    """The prompt tokens' log-probs of vLLM's RequestOutput `out` (None for the first token), when asked."""
    if not req.prompt_logprobs or out.prompt_logprobs is None:
        return None
    return [None if step is None else float(step[tok].logprob) for tok, step in zip(req.prompt_ids, out.prompt_logprobs)]


def completion_sample(req: GenerationRequest, comp: Any, version: int,
                      token_versions: list[int] | None = None,
                      prompt_logprobs: list[float | None] | None = None) -> Sample:
    """The Sample of `req` from vLLM's finished CompletionOutput `comp`, sampled by `version`."""
    ids = list(comp.token_ids)
    return Sample(prompt_ids=list(req.prompt_ids), completion_ids=ids,
                  logprobs=[float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)],
                  finish_reason="stop" if comp.finish_reason == "stop" else "length", policy_version=version,
                  prompt_text=req.prompt_text, completion_text=comp.text, group_id=req.group_id,
                  sample_index=req.sample_index, metadata=req.metadata, token_versions=token_versions,
                  prompt_logprobs=prompt_logprobs)


def request_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request it refuses (its parameters, token ids, length), as opposed to
    a failure of the engine itself."""
    from vllm.exceptions import VLLMClientError

    return VLLMClientError, ValueError, TypeError


class VLLMEngine(BatchQueue):
    def __init__(self, spec: RolloutSpec, seed: int):
        r = spec.rollout
        for key, value in vllm_env(r.kv_cache_gib, spec.threads, r.enforce_eager).items():
            os.environ.setdefault(key, value)
        # torch warns on import that Triton is missing: expected (and harmless) on a CPU build
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        from vllm import LLM

        self.rollout = r
        self._adapters = AdapterRequests()
        self._model_path = spec.model.path
        self._merged: MergedAdapters | None = None  # made at the first adapter request without vLLM's LoRA
        self.llm = LLM(**engine_kwargs(spec, seed))
        self.tokenizer = self.llm.get_tokenizer()
        from vllm.v1.engine.core_client import InprocClient

        # The model runs in this process: the engine core is here (VLLM_ENABLE_V1_MULTIPROCESSING=0,
        # as `vllm_env` sets) and so is its one worker ("uni" executor), so `collective_rpc` calls it
        # directly and a lazy weight iterator can be handed over. With tensor parallelism the core
        # is still here but the workers are subprocesses ("mp"): they take the weight sync themselves.
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        self.in_process = (isinstance(self.llm.llm_engine.engine_core, InprocClient)
                           and parallel.distributed_executor_backend == "uni")
        self._needs_fixup = any(self.llm.collective_rpc("rlpost_record_fixups"))
        self.version = 0
        self._sleep_mode = r.sleep_between_steps and spec.gpu and torch.cuda.is_available()
        self._sleep_level = 1 if spec.model.lora.rank > 0 else 2
        self._asleep: set[str] = set()
        self._ipc = IpcReceiver()  # CUDA IPC: vLLM's weight-transfer rounds (`weight_transfer`)
        if torch.cuda.is_available() and not self.llm.llm_engine.vllm_config.use_v2_model_runner:
            # every request carries its own seed (reproducible samples whatever the batching); vLLM's
            # V2 model runner (the CUDA default) samples them batched, the V1 sampler loops per sequence
            print("WARNING: vLLM runs its V1 model runner here (VLLM_USE_V2_MODEL_RUNNER=0, no Triton, or an "
                  "unsupported feature): with a seed per request its sampler loops over the sequences in "
                  "Python, which slows large batches", flush=True)

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        return each_or_refused(self._generate, requests, request_errors(), self.version)

    def _generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        if self.rollout.max_loras == 0 and any(r.adapter for r in requests):
            return self._generate_merged(requests)
        # vLLM 0.32's LoRA logits layer applies one adapter slot per sequence of the batch; the
        # prompt's log-probs are computed over every prompt token, which only the slot of a batch of
        # one broadcasts to (a larger batch fails its shape check). So with LoRA on, a request that
        # asks for them runs alone.
        if self.rollout.max_loras > 0 and len(requests) > 1 and any(r.prompt_logprobs for r in requests):
            alone = [i for i, r in enumerate(requests) if r.prompt_logprobs]
            rest = [i for i, r in enumerate(requests) if not r.prompt_logprobs]
            out: dict[int, Sample] = {i: self._generate([requests[i]])[0] for i in alone}
            if rest:
                out.update(zip(rest, self._generate([requests[i] for i in rest])))
            return [out[i] for i in range(len(requests))]
        adapters = [self._adapters(req) for req in requests]
        for lora_id in self._adapters.take_stale():  # an older save of a folder these requests sample
            self.llm.llm_engine.remove_lora(lora_id)
        return self._run(requests, adapters if any(adapters) else None)

    def _run(self, requests: list[GenerationRequest], lora_requests: list | None = None,
             cache_salt: str | None = None) -> list[Sample]:
        """One `LLM.generate` of `requests` (with vLLM's LoRA requests, if any); `cache_salt`: their
        prompts' KV blocks are cached apart from other weights' (an adapter merged in)."""
        params = [sampling_params(self.rollout, req) for req in requests]
        prompts = [{"prompt_token_ids": list(req.prompt_ids), **({"cache_salt": cache_salt} if cache_salt else {})}
                   for req in requests]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, lora_request=lora_requests)
        return [completion_sample(req, out.outputs[0], self.version, prompt_logprobs=prompt_logprobs_of(req, out))
                for req, out in zip(requests, outputs)]

    def _generate_merged(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Requests naming adapters on an engine without vLLM's LoRA (`rollout.max_loras=0`): one
        batch per adapter, the base model's first, each run with its adapter merged into the
        weights (`MergedAdapters`) and its prompts cached apart (a salt naming the adapter's save)."""
        merged = self._adapter_merger()
        groups: dict[str | None, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(req.adapter, []).append(i)
        out: list[Sample | None] = [None] * len(requests)
        for adapter, index in sorted(groups.items(), key=lambda item: item[0] is not None):
            part = [requests[i] for i in index]
            if adapter is None:
                samples = self._run(part)
            else:
                save = self._adapters(part[0]).lora_int_id  # a new number for each save of the folder
                self._adapters.take_stale()  # (nothing loaded in vLLM to remove)
                with merged.merged(adapter, save):
                    samples = self._run(part, cache_salt=f"rlpost-adapter-{save}")
            for i, sample in zip(index, samples):
                out[i] = sample
        return out  # type: ignore[return-value]

    def _adapter_merger(self) -> MergedAdapters:
        """The engine's `MergedAdapters`, made at first use; refused (a ValueError: the request's
        error) where merging cannot serve the adapter exactly."""
        config = self.llm.llm_engine.vllm_config
        if self.version != 0:
            raise ValueError("adapters are merged into the base weights of model.path, and this engine's weights were "
                             f"replaced by a weight sync (policy version {self.version}): use vLLM's LoRA "
                             "(rollout.max_loras >= 1)")
        if not self.in_process or not config.model_config.enforce_eager:
            raise ValueError("merged adapters need the model in the engine's process, run eagerly "
                             "(rollout.tensor_parallel_size=1, rollout.enforce_eager=true); else use vLLM's LoRA "
                             "(rollout.max_loras >= 1)")
        if self._merged is None:
            model = self.llm.collective_rpc(_served_model)[0]
            self._merged = MergedAdapters(model, self._model_path, config.model_config.dtype)
        return self._merged

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights in place, streaming: vLLM's layer-wise `reload_weights` consumes the
        iterator once, inside this call, loading each layer as soon as its tensors have arrived,
        so with `rl.wire.collective.receive` as the source no second full copy of the model exists."""
        # workers in subprocesses (tensor parallelism): the tensors cross whole, pickled to each
        weights = iter(named_tensors) if self.in_process else list(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self._needs_fixup:
            self.llm.collective_rpc("rlpost_after_reload")
        self._loaded(version)

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                         metas: list, lora_spec: RolloutSpec | None = None, delta: bool = False) -> None:
        """Workers in subprocesses: each joins the weight-sync group at `first_rank` + its rank."""
        self.llm.collective_rpc("rlpost_join", args=(host, port, first_rank, world_size, backend, metas, lora_spec,
                                                     delta))

    def receive_weights(self, version: int) -> list[dict[str, float]]:
        """Workers in subprocesses: each takes rank 0's broadcast and loads its shard
        (`SyncExtension.rlpost_receive`); returns each worker's figures."""
        stats = self.llm.collective_rpc("rlpost_receive")
        self._loaded(version)
        return stats

    def _loaded(self, version: int) -> None:
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version
        if self._merged is not None:  # merged from the weights before this load
            self._merged.forget()

    def sleep(self, level: int | None = None) -> None:
        """Free the GPU (no-op on CPU). Level 2 drops the weights too, which is right when the
        next sync sends them all; level 1 keeps a host copy (the default with LoRA, whose syncs
        send only the targeted modules, and when no sync follows, e.g. around a checkpoint)."""
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=level or self._sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Give back what `sleep` freed: the weights first (`("weights",)`) so a sync can load
        them while the KV cache still sleeps, then the rest (None); vLLM resumes scheduling once
        everything is back."""
        if not self._asleep:
            return
        wanted = self._asleep & set(tags) if tags else set(self._asleep)
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self._asleep -= wanted

    def weight_transfer(self, method: str, payload: dict | None = None, version: int | None = None) -> None:
        """One call of vLLM's weight-transfer API (`init_weight_transfer_engine`,
        `start_weight_update`, `update_weights`, `finish_weight_update`), driven by the learner's
        trainer-side engine (rl/wire/ipc.py, `IpcReceiver` keeps the rounds); after
        `finish_weight_update` the loaded weights are the policy `version`."""
        if self._ipc.call(self.llm, method, payload):
            if self._needs_fixup:
                self.llm.collective_rpc("rlpost_after_reload")
            self._loaded(version if version is not None else self.version)
