"""Streaming vLLM backend (`rollout.mode=streaming`): vLLM's `AsyncLLM`, requests flowing continuously.

Requests are submitted one group at a time and finished samples are drained whenever the driver
asks, so no batch waits for its slowest sample. A weight sync pauses the engine with its requests
kept (`pause_generation(mode="keep")`), loads, and resumes them: tokens sampled after the load
carry the new version, so every sample records the policy version of each of its tokens
(docs/architecture.md "Rollouts"), as vLLM's engine labels them (`update_weight_version`).
`rollout.inflight_kv=recompute` drops the KV cache of the kept requests at the pause, so their
tokens so far are prefilled again under the new weights.

AsyncLLM runs its engine core in a child process (also on CPU), so the weights always go through
the vLLM worker's RPC (`rollout/vllm_worker.py`), as with tensor parallelism; the engine's event
loop runs in a thread of its own, so the Ray actor's methods stay plain blocking calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from rl.data.types import GenerationRequest, Sample
from rollout.protocol import RolloutSpec
from rollout.protocol import refused
from rollout.vllm_engine import (AdapterRequests, completion_sample, engine_kwargs, prompt_logprobs_of, request_errors,
                                 sampling_params, vllm_env)


class AsyncVLLMEngine:
    in_process = False  # the model runs in vLLM's engine-core process: weights go through its RPC

    def __init__(self, spec: RolloutSpec, seed: int):
        r = spec.rollout
        for key, value in vllm_env(r.kv_cache_gib, spec.threads, r.enforce_eager).items():
            if key != "VLLM_ENABLE_V1_MULTIPROCESSING":  # AsyncLLM's core always runs in a child process
                os.environ.setdefault(key, value)
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        self.rollout = r
        self._adapters = AdapterRequests()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True).start()
        self.llm = self._call(self._build(engine_kwargs(spec, seed)))
        self._call(self.llm.collective_rpc("rlpost_watch_parent", args=(os.getpid(),)))
        self._call(self.llm.collective_rpc("rlpost_record_fixups"))
        self._call(self.llm.update_weight_version("0"))  # vLLM labels every sampled token with it
        self.version = 0
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._done: list[Sample | BaseException] = []
        self._running = 0
        self._paused_since: float | None = None
        self._sync = threading.Lock()  # one pause/load/resume at a time

    @staticmethod
    async def _build(kwargs: dict[str, Any]):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True))

    def _call(self, coro, timeout: float | None = None):
        """Run a coroutine on the engine's loop and wait for its result (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _sample(self, req: GenerationRequest) -> Sample:
        """One request, its output taken once finished. Each token's policy version comes from vLLM:
        its engine core labels every step's outputs with the weight version it holds
        (`update_weight_version`, set while paused), and the finished output lists the spans."""
        from vllm.sampling_params import RequestOutputKind

        request_id = f"g{req.group_id}-s{req.sample_index}-{next(self._ids)}"
        final = whole = None
        try:
            params = sampling_params(self.rollout, req, output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in self.llm.generate({"prompt_token_ids": list(req.prompt_ids)}, params, request_id,
                                               lora_request=self._adapters(req)):
                final, whole = out.outputs[0], out
        except request_errors() as err:  # the request's fault, not the engine's: its own error sample
            return refused(req, f"{type(err).__name__}: {err}", self.version)
        versions = [int(span.version) for span in final.weight_versions or () for _ in range(span.start, span.end)]
        if len(versions) != len(final.token_ids):
            raise RuntimeError(f"vLLM labelled {len(versions)} of {len(final.token_ids)} tokens with a weight version")
        return completion_sample(req, final, versions[0] if versions else self.version, versions,
                                 prompt_logprobs_of(req, whole))

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Start the requests; their samples come out of `drain` as each finishes."""
        with self._cond:
            self._running += len(requests)
        for req in requests:
            asyncio.run_coroutine_threadsafe(self._sample(req), self._loop).add_done_callback(self._finished)

    def _finished(self, future) -> None:
        with self._cond:
            self._running -= 1
            self._done.append(future.exception() or future.result())
            self._cond.notify_all()

    def drain(self, wait_s: float) -> dict[str, Any]:
        """The samples finished since the last call (collected for `wait_s`, less once none runs) and
        for how long the engine has been paused (0: it is not).
        A request the engine refused is a sample with its error; one that failed otherwise raises
        here (its engine is broken: the fleet replaces the worker)."""
        with self._cond:  # the window's samples together: one round trip per window, not per sample
            self._cond.wait_for(lambda: self._done and not self._running, timeout=wait_s)
            done, self._done = self._done, []
        for item in done:
            if isinstance(item, BaseException):
                raise item
        since = self._paused_since
        return {"samples": done, "paused_s": time.monotonic() - since if since else 0.0}

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """A blocking batch (evaluation, tests), beside whatever is streaming."""
        async def all_of():
            return await asyncio.gather(*(self._sample(r) for r in requests))

        return self._call(all_of())

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """Requests kept and frozen for the duration (their KV cache too unless `inflight_kv` is
        recompute); resumed however the body ends."""
        with self._sync:
            self.pause()
            try:
                yield
            finally:
                self.resume()

    def pause(self) -> None:
        self._call(self.llm.pause_generation(mode="keep", clear_cache=self.rollout.inflight_kv == "recompute"))
        self._paused_since = time.monotonic()

    def resume(self) -> None:
        self._call(self.llm.resume_generation())
        self._paused_since = None

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                         metas: list, lora_spec: RolloutSpec | None = None, delta: bool = False) -> None:
        payload = pickle.dumps((host, port, first_rank, world_size, backend, metas, lora_spec, delta))
        self._call(self.llm.collective_rpc("rlpost_join_pickled", args=(payload,)))

    def receive_weights(self, version: int) -> list[dict[str, float]]:
        """Pause, take rank 0's broadcast in the vLLM worker(s) (`SyncExtension.rlpost_receive`), resume."""
        with self._paused():
            stats = self._call(self.llm.collective_rpc("rlpost_receive"))
            self._loaded(version)
        return stats

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Weights from the object store: pause, load them in the worker(s), resume."""
        payload = pickle.dumps([(name, t.contiguous()) for name, t in named_tensors])
        with self._paused():
            self._call(self.llm.collective_rpc("rlpost_reload_pickled", args=(payload,)))
            self._loaded(version)

    def _loaded(self, version: int) -> None:
        """Still paused: label the tokens sampled from now on with `version`. Cached prefixes of
        finished requests were computed by the old weights; with requests kept (inflight_kv=keep)
        vLLM resets nothing while they hold blocks: their KV stays the old one."""
        self._call(self.llm.update_weight_version(str(version)))
        self._call(self.llm.reset_prefix_cache())
        self.version = version

    def sleep(self, level: int | None = None) -> None:
        """Streaming engines never sleep (rollout.sleep_between_steps is refused with this mode)."""

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """See `sleep`."""

    def shutdown(self) -> None:
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
