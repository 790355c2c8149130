"""vLLM backend (CPU build on CPU machines, CUDA build on GPUs), engine in the calling process."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import torch

from rl.types import GenerationRequest, Sample
from rollout.protocol import RolloutSpec


def vllm_env(kv_cache_gib: int, threads: int) -> dict[str, str]:
    """Environment a process needs before importing vLLM so the engine runs inside it."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process (a Ray actor), no subprocess
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # fastest on small shared CPU boxes (PLATFORM.md)
        "TOKENIZERS_PARALLELISM": "false",
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _record_tied_parameters(worker) -> int:
    """Runs inside vLLM's worker: remember which module attributes share one Parameter
    (e.g. lm_head.weight is embed_tokens.weight when word embeddings are tied)."""
    model = worker.model_runner.model
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    model._rlpost_tied = [names for names in by_id.values() if len(names) > 1]
    return len(model._rlpost_tied)


def _restore_tied_parameters(worker) -> None:
    """vLLM's layer-wise `reload_weights` gives the loaded layer a new tensor, so a tied twin (that
    received no checkpoint weight of its own) keeps the old one: point it at the new one again and
    redo the twin's post-load processing (on CPU the LM head keeps a prepacked GEMM copy)."""
    model = worker.model_runner.model
    for canonical, *twins in getattr(model, "_rlpost_tied", []):
        param = model.get_parameter(canonical)
        for twin in twins:
            owner_name, _, attr = twin.rpartition(".")
            owner = model.get_submodule(owner_name)
            setattr(owner, attr, param)
            method = getattr(owner, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(owner)


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
    return dict(
        model=spec.model.path,
        dtype=spec.model.dtype,
        max_model_len=r.max_model_len,
        seed=seed,
        enforce_eager=r.enforce_eager,
        gpu_memory_utilization=r.gpu_memory_utilization,
        # Log-probs after temperature, i.e. of the distribution the tokens were drawn from;
        # the learner divides its logits by the same temperature.
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        use_tqdm_on_load=False,  # a progress bar for loading a few files is noise
        enable_sleep_mode=r.sleep_between_steps and spec.gpu,  # sleep is a no-op on CPU
        **_cpu_scheduler_kwargs(r.max_model_len),
    )


class VLLMEngine:
    def __init__(self, spec: RolloutSpec, seed: int):
        r = spec.rollout
        for key, value in vllm_env(r.kv_cache_gib, spec.threads).items():
            os.environ.setdefault(key, value)
        # torch warns on import that Triton is missing: expected (and harmless) on a CPU build
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        from vllm import LLM

        self.rollout = r
        self.llm = LLM(**engine_kwargs(spec, seed))
        self.tokenizer = self.llm.get_tokenizer()
        from vllm.v1.engine.core_client import InprocClient

        # With the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as `vllm_env` sets)
        # `collective_rpc` calls the worker directly, so a lazy weight iterator can be handed over.
        self._in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        self._has_tied = any(self.llm.collective_rpc(_record_tied_parameters))
        self.version = 0
        self._sleep_mode = r.sleep_between_steps and spec.gpu and torch.cuda.is_available()
        self._sleeping = False

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        from vllm import SamplingParams

        sampling = self.rollout
        params = [
            SamplingParams(
                n=1,  # one request per sample, each with its own seed: reproducible whatever the split
                temperature=sampling.temperature if req.temperature is None else req.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens if req.max_tokens is None else req.max_tokens,
                seed=req.seed,
                logprobs=0,  # the sampled token's log-prob only
            )
            for req in requests
        ]
        prompts = [{"prompt_token_ids": list(req.prompt_ids)} for req in requests]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        samples = []
        for req, out in zip(requests, outputs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            logprobs = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)]
            samples.append(
                Sample(
                    prompt_ids=list(req.prompt_ids),
                    completion_ids=ids,
                    logprobs=logprobs,
                    finish_reason="stop" if comp.finish_reason == "stop" else "length",
                    policy_version=self.version,
                    prompt_text=req.prompt_text,
                    completion_text=comp.text,
                    group_id=req.group_id,
                    sample_index=req.sample_index,
                    metadata=req.metadata,
                )
            )
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights in place, streaming: vLLM's layer-wise `reload_weights` consumes the
        iterator once, inside this call, loading each layer as soon as its tensors have arrived,
        so with `weight_sync.receive` as the source no second full copy of the model exists."""
        weights = iter(named_tensors)
        if not self._in_process:  # an engine in a subprocess: the tensors must cross whole
            weights = iter(list(weights))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self._has_tied:
            self.llm.collective_rpc(_restore_tied_parameters)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version

    def sleep(self) -> None:
        if self._sleep_mode and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
