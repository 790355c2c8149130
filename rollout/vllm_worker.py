"""The rollout end of the weight sync inside vLLM's worker processes, one per tensor-parallel rank.

`VLLMEngine` names `SyncExtension` as vLLM's `worker_extension_cls`, so vLLM mixes it into its
Worker class (vllm/v1/worker/worker_base.py) and `LLM.collective_rpc("rlpost_...")` runs these
methods in every worker at once. With tensor parallelism each worker joins the weight-sync group
itself, at rank `first_rank + its rank in the engine`, takes every bucket of rank 0's broadcast
and loads it with its own `reload_weights`, which keeps this rank's shard of each tensor: the
weights do not pass through the Ray actor, and no process holds a second copy of the model.
Without tensor parallelism the worker runs in the actor's process and only the fix-ups after a
reload (`rlpost_record_fixups`, `rlpost_after_reload`) are used. Names start with `rlpost_`:
vLLM refuses an extension attribute its Worker has.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

from rl.wire.collective import CollectiveReceiver
from rl.wire.format import WeightMeta


class SyncExtension:
    # Set by `rlpost_join` (class defaults, so a worker that never joined has them too).
    _rlpost_receiver = None
    _rlpost_merger = None

    def rlpost_join(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                    metas: list[WeightMeta], lora_spec=None, delta: bool = False) -> None:
        """Join the weight-sync group at rank `first_rank + self.rank` (a group of the fleet before
        a replacement is closed first). `lora_spec` (a RolloutSpec with `model.lora`): syncs carry
        adapters, merged here into base weights this worker keeps (read once, at its first join).
        `delta`: syncs send changes, applied to a copy of the weights this worker keeps."""
        if lora_spec is not None and self._rlpost_merger is None:
            from rollout.adapters import adapter_merger

            self._rlpost_merger = adapter_merger(lora_spec)
        if self._rlpost_receiver is None:
            self._rlpost_receiver = CollectiveReceiver()
        self._rlpost_receiver.join(host, port, first_rank + self.rank, world_size, backend, metas, delta,
                                   self._rlpost_merger)

    def rlpost_join_pickled(self, payload: bytes) -> None:
        """`rlpost_join` with its arguments pickled: AsyncLLM's RPC to its engine-core process encodes
        arguments with msgpack, which turns the WeightMeta and RolloutSpec dataclasses into dicts."""
        self.rlpost_join(*pickle.loads(payload))

    def rlpost_reload_pickled(self, payload: bytes) -> None:
        """`reload_weights` of pickled (name, tensor) pairs (msgpack would turn the tensors into lists)."""
        self.reload_weights(weights_iterator=iter(pickle.loads(payload)))
        self.rlpost_after_reload()

    def rlpost_watch_parent(self, actor_pid: int) -> None:
        """End this process (and vLLM's engine core above it, when that is not the actor itself) once
        the Ray actor `actor_pid` is gone: an actor killed outright cannot shut its AsyncLLM down,
        and vLLM's engine-core process does not watch its parent (its TP workers do)."""
        core = os.getppid()  # the engine core with tensor parallelism, else the actor itself

        def watch() -> None:
            while True:
                try:
                    os.kill(actor_pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(1.0)
            if core != actor_pid:
                os.kill(core, signal.SIGKILL)
            os._exit(1)

        if os.getpid() != actor_pid:
            threading.Thread(target=watch, name="rlpost-watch-parent", daemon=True).start()

    def rlpost_close(self) -> None:
        if self._rlpost_receiver is not None:
            self._rlpost_receiver.close()

    def rlpost_receive(self) -> dict[str, float]:
        """Take rank 0's broadcast and load it bucket by bucket as it arrives (this rank's shard of
        each tensor is kept); returns this worker's `receive_s` and `bytes`."""
        if self._rlpost_receiver is None or not self._rlpost_receiver.joined:
            raise RuntimeError(f"rlpost_receive in vLLM worker {self.rank} before rlpost_join: the fleet was not "
                               "connected to the weight-sync group")
        stats = self._rlpost_receiver.receive(lambda tensors: self.reload_weights(weights_iterator=tensors),
                                              self.device)
        self.rlpost_after_reload()
        return stats

    def rlpost_record_fixups(self) -> int:
        """Prepare for reloads (after the first load): remember the module attributes that share
        one Parameter (lm_head.weight is embed_tokens.weight when word embeddings are tied), put
        right after each reload (`rlpost_after_reload`), and on CPU have MoE layers prepack their
        experts whenever a reload processes them (`_prepack_on_reload`). Returns how many tied
        sets there are (none: nothing to do after a reload)."""
        model = self.model_runner.model
        by_id: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(name)
        model._rlpost_tied = [names for names in by_id.values() if len(names) > 1]
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return len(model._rlpost_tied)
        for layer in model.modules():
            if getattr(getattr(layer, "quant_method", None), "moe_kernel", None) is not None:
                _prepack_on_reload(layer)
        for canonical, *twins in model._rlpost_tied:
            _skip_lookup_pack(model, canonical, twins)
        return len(model._rlpost_tied)

    def rlpost_after_reload(self) -> None:
        """A tied twin (that received no checkpoint weight of its own) keeps the old tensor after
        vLLM's layer-wise `reload_weights`, since the loaded layer gets a new one: point it at the
        new one again and redo the twin's post-load processing (on CPU the LM head keeps a
        prepacked GEMM copy)."""
        model = self.model_runner.model
        for canonical, *twins in getattr(model, "_rlpost_tied", []):
            param = model.get_parameter(canonical)
            for twin in twins:
                owner_name, _, attr = twin.rpartition(".")
                owner = model.get_submodule(owner_name)
                setattr(owner, attr, param)
                method = getattr(owner, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(owner)


def _skip_lookup_pack(model, canonical: str, twins: list[str]) -> None:
    """On CPU vLLM's embedding method packs a GEMM copy of every embedding table when it is
    processed, also for an input embedding that only looks rows up. When that table is tied to a
    separate LM head, `rlpost_after_reload` packs the head again after each reload, so the
    embedding's own pack (the whole vocabulary, ~30 ms for SmolLM2's 49k x 576 in bf16) is
    skipped on reloads: its packed copy is never read. An embedding that is itself used as the
    head (no separate head module: Gemma in vLLM) has no twin and keeps it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    owner = model.get_submodule(canonical.rpartition(".")[0])
    heads = [model.get_submodule(t.rpartition(".")[0]) for t in twins]
    method = getattr(owner, "quant_method", None)
    if (type(owner) is not VocabParallelEmbedding or method is None
            or not any(isinstance(h, ParallelLMHead) for h in heads)
            or any(getattr(h, "quant_method", None) is method for h in heads)):
        return
    method.process_weights_after_loading = lambda layer: None  # this layer's own instance only


def _prepack_on_reload(layer) -> None:
    """On CPU a MoE layer's experts are padded and prepacked into the grouped-GEMM layout its
    kernel reads. vLLM (0.32) does that at the first load only: on a weight update its
    `_setup_kernel` skips the experts' own step, so a reload left checkpoint-layout weights
    where packed ones belong (reloading the very same weights moved log-probs by 0.015 nats)
    or, where the inner size is padded, failed copying them into the padded tensor. Installed
    after the first load, this runs that step whenever a reload processes the layer, before
    vLLM copies the result into the tensors the kernel holds."""
    method = layer.quant_method
    process = method.process_weights_after_loading

    def process_and_prepack(module) -> None:
        process(module)
        module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)

    method.process_weights_after_loading = process_and_prepack
