"""`LearnerGroup`: N `LearnerWorker` Ray actors forming one DeepSpeed data-parallel job.

The driver sees one object: `train_step(batch)` shards the batch over the ranks and reduces their
metric sums; `sync_weights(fleet, version)` pushes the new weights to the rollout fleet.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rl.wire import weight_sync
from rl.plan.devices import collective_backend
from rl.algo.importance import effective_sample_size
from rl.run.faults import ActorFailure, Deadlines, first_line, hung
from rl.data.types import TrainBatch
from trainer.learner import LearnerSpec, LearnerWorker


def shard_rows(n_rows: int, world_size: int) -> list[torch.Tensor]:
    """Interleaved row indices per rank, so every rank sees a mix of groups and lengths."""
    return [torch.arange(rank, n_rows, world_size) for rank in range(world_size)]



def sync_backend(devices: list[str]) -> str:
    """The weight-sync group's backend from the devices its members were given (learner rank 0,
    then each rollout worker, as they report them): NCCL when every one is on a GPU, else gloo
    (which the GPU members feed from host copies)."""
    return collective_backend("cuda" if devices and all(d == "cuda" for d in devices) else "cpu")

class LearnerGroup:
    """A rank that dies or stops answering ends the run (`ActorFailure`, naming the rank and the
    phase): its ZeRO shards are gone, so the run resumes from its latest checkpoint."""

    def __init__(
        self,
        spec: LearnerSpec,
        num_workers: int,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
        weight_sync_method: str = "collective",
        actor_options: list[dict[str, Any]] | None = None,
        deadlines: Deadlines | None = None,
    ):
        self.spec, self.world_size = spec, num_workers
        self.num_gpus, self.sync_method = num_gpus, weight_sync_method
        self.deadlines = deadlines or Deadlines()
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        remote_cls = ray.remote(LearnerWorker)
        # per-rank options (a placement bundle, a GPU share) override the common ones
        self.workers = [remote_cls.options(**{**options, **(actor_options[r] if actor_options else {})})
                        .remote(spec, r, num_workers) for r in range(num_workers)]
        self.where: list[dict[str, Any]] = [{} for _ in range(num_workers)]
        self.where = self._get([w.where.remote() for w in self.workers], "start-up", self.deadlines.start_s)
        master_addr, master_port = self._get([self.workers[0].node_address.remote()], "start-up")[0]
        self._get([w.setup.remote(master_addr, master_port) for w in self.workers], "set-up", self.deadlines.start_s)
        self.metas: list[weight_sync.WeightMeta] = self._get([self.workers[0].weight_metas.remote()], "set-up")[0]

    def name(self, rank: int) -> str:
        pid = self.where[rank].get("pid")
        return f"learner rank {rank}" + (f" (pid {pid})" if pid else "")

    def _get(self, refs: list, kind: str, deadline: float | None = None, tolerate_errors: bool = False) -> list:
        """One result per rank within the deadline of `kind`; a dead or silent rank is an
        ActorFailure. `tolerate_errors`: an exception raised inside a live rank gives None (its
        peer in a collective failed, which the caller handles)."""
        deadline = deadline or self.deadlines.of(kind)
        started = time.monotonic()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline)
        finished = set(ready)
        out = []
        for rank, ref in enumerate(refs):
            if ref not in finished:
                raise ActorFailure(self.name(rank), kind, hung(deadline))
            try:
                out.append(ray.get(ref))
            except RayActorError as exc:
                raise ActorFailure(self.name(rank), kind, f"its process died ({first_line(exc)})") from None
            except RayTaskError:
                if not tolerate_errors:
                    raise
                out.append(None)
        self.deadlines.record(kind, time.monotonic() - started)
        return out

    def score(self, batch: TrainBatch) -> TrainBatch:
        """Every rank scores its shard (old/reference log-probs, values); reassembled in row order."""
        if len(batch) != self.spec.samples_per_step:
            raise ValueError(f"expected {self.spec.samples_per_step} rows per step, got {len(batch)}")
        index = shard_rows(len(batch), self.world_size)
        scored = self._get([w.score.remote(batch.select(rows)) for w, rows in zip(self.workers, index)], "score")
        width = batch.input_ids.shape[1] - 1
        for name in ("old_logprobs", "ref_logprobs", "values"):
            parts = [getattr(s, name) for s in scored]
            if parts[0] is None:
                setattr(batch, name, None)
                continue
            full = torch.zeros((len(batch), width))
            for rows, part in zip(index, parts):
                full[rows, : part.shape[1]] = part
            setattr(batch, name, full)
        return batch

    def train_step(self, batch: TrainBatch, step: int, kl_coef: float | None = None) -> dict[str, float]:
        if len(batch) != self.spec.samples_per_step:
            raise ValueError(f"expected {self.spec.samples_per_step} rows per step, got {len(batch)}")
        shards = [batch.select(rows) for rows in shard_rows(len(batch), self.world_size)]
        results = self._get([w.train_step.remote(s, step, kl_coef) for w, s in zip(self.workers, shards)],
                            "train_step")
        return reduce_metrics(results)

    def connect(self, fleet) -> None:
        """Make the weight-sync group (learner rank 0 plus every rollout worker), and have the
        fleet call back when it replaced a worker: a new group, then the current weights."""
        fleet.on_replace = lambda: self.reconnect(fleet)
        self._link(fleet)

    def reconnect(self, fleet) -> None:
        self._link(fleet)
        self.sync_weights(fleet, fleet.version)

    def _link(self, fleet) -> None:
        """What the sync method needs with the current workers: a weight-sync group (collective),
        the trainer side of the CUDA IPC transfer (ipc), nothing (object_store)."""
        if self.sync_method == "collective":
            self._join(fleet)
        elif self.sync_method == "ipc":
            self._connect_ipc(fleet)

    def _connect_ipc(self, fleet) -> None:
        """Every rank builds vLLM's trainer-side IPC engine; rank 0 gets the rollout workers."""
        timeout = self.deadlines.of("weight sync")
        self._get([w.connect_ipc.remote(list(fleet.workers) if r == 0 else [], timeout)
                   for r, w in enumerate(self.workers)], "weight-sync join")

    def _join(self, fleet) -> None:
        while True:
            host, port = self._get([self.workers[0].node_address.remote()], "weight-sync join")[0]
            backend = sync_backend([self.where[0].get("device", "cpu"), *(w.get("device", "cpu") for w in fleet.where)])
            # a tensor-parallel engine joins with each of its TP vLLM workers: ranks 1+i*TP .. (i+1)*TP
            tp = fleet.spec.rollout.tensor_parallel_size
            world = 1 + tp * len(fleet.workers)
            mine = self.workers[0].join_weight_sync.remote(host, port, world, backend)
            _, failed = fleet.wait({i: w.join_weight_sync.remote(host, port, 1 + i * tp, world, backend, self.metas)
                                    for i, w in enumerate(fleet.workers)}, "weight-sync join")
            if not failed:
                self._get([mine], "weight-sync join")
                return
            fleet.replace(failed, "weight-sync join")  # raises once its replacements are used up

    def sync_weights(self, fleet, version: int) -> float:
        """Push the current weights to every rollout worker as `version`; returns bytes moved. A
        rollout worker that fails meanwhile is replaced, the group made again and the push redone."""
        rejoined = False
        while True:
            broken: dict[int, str] = {}  # receivers whose broadcast failed, alive: a new group will do
            sent, failed = self._push(fleet, version, broken)
            if not failed and not broken:
                fleet.version = version
                return sent
            if failed:
                fleet.replace(failed, "weight sync")  # raises once its replacements are used up
            elif rejoined:
                i, why = next(iter(broken.items()))
                raise ActorFailure(fleet.name(i), "weight sync", f"its broadcast failed twice ({why})")
            rejoined = True
            if self.sync_method == "collective":
                self._join(fleet)

    def _push(self, fleet, version: int, broken: dict[int, str]) -> tuple[float, dict[int, str]]:
        if self.sync_method == "ipc":
            sends = [w.send_weights_ipc.remote(version) for w in self.workers]
            sent = self._get(sends, "weight sync", tolerate_errors=True)
            if sent[0] is not None:
                return sent[0], {}
            # rank 0's calls on the rollout workers failed: replace those that are gone or stuck
            _, failed = fleet.wait({i: w.version.remote() for i, w in enumerate(fleet.workers)}, "weight sync")
            if not failed:
                ray.get(sends[0])  # not a rollout worker's fault: raise the learner's error
            return 0.0, failed
        if self.sync_method == "object_store":
            # rank 0's weights go from its object store to the workers' (Ray resolves the ref in
            # each worker): the driver never holds them (the other ranks return None)
            states = [w.full_state_dict.remote() for w in self.workers]
            _, failed = fleet.wait({i: w.load_weights_from_object.remote(states[0], version)
                                    for i, w in enumerate(fleet.workers)}, "weight sync")
            self._get(states[1:], "weight sync")
            return self.sync_bytes(), failed
        # Rank 0 waits for each broadcast at most half the sync's deadline: a stopped receiver
        # makes it raise (NCCL would otherwise only queue the broadcast and report it sent), by
        # the time the driver below has found the receiver silent and waits on rank 0.
        wait_s = self.deadlines.of("weight sync") / 2
        sends = [w.broadcast_weights.remote(wait_s) for w in self.workers]
        _, failed = fleet.wait({i: w.receive_weights.remote(version) for i, w in enumerate(fleet.workers)},
                               "weight sync", errors=broken)
        # A stopped receiver holds rank 0's broadcast: end it (gloo then fails the broadcast at
        # once; NCCL at rank 0's wait), and the group is made again without it.
        for i in failed:
            ray.kill(fleet.workers[i], no_restart=True)
        sent = self._get(sends, "weight sync", tolerate_errors=bool(failed or broken))
        return (sent[0] or 0.0), failed

    def offload(self, keep_weights: bool = False) -> None:
        """Every rank moves its states to the host (hybrid placement: the engine on its GPU wakes)."""
        self._get([w.offload.remote(keep_weights) for w in self.workers], "offload")

    def onload(self) -> None:
        self._get([w.onload.remote() for w in self.workers], "onload")

    def save_checkpoint(self, path: str) -> None:
        self._get([w.save_checkpoint.remote(path) for w in self.workers], "save_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        self._get([w.load_checkpoint.remote(path) for w in self.workers], "load_checkpoint", self.deadlines.start_s)

    def parameter_counts(self) -> dict[str, float]:
        """Rank 0's trainable and total parameters and model bytes (`LearnerWorker.parameter_counts`)."""
        return self._get([self.workers[0].parameter_counts.remote()], "parameter_counts")[0]

    def sync_bytes(self) -> float:
        """Bytes one weight sync moves: the whole model, or with LoRA the adapters."""
        return float(sum(m.nbytes for m in self.metas))

    def save_pretrained(self, path: str, adapter_path: str | None = None) -> None:
        self._get([w.save_pretrained.remote(path, adapter_path) for w in self.workers], "save_pretrained")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def reduce_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Sum the ranks' metric sums, then turn them into means per token / per update."""
    total: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            total[k] = max(total.get(k, v), v) if k.startswith("_max/") else total.get(k, 0.0) + v
    tokens = max(total.pop("_tokens", 0.0), 1.0)
    loss_tokens = max(total.pop("_loss_tokens", 0.0), 1.0)
    updates = max(total.pop("_updates", 0.0) / len(results), 1.0)  # optimizer steps (same on every rank)
    critic_tokens = max(total.pop("_critic_tokens", 0.0), 1.0)
    critic_updates = max(total.pop("_updates/critic", 0.0) / len(results), 1.0)
    out: dict[str, float] = {}
    if "_is/w_sum" in total:
        out["is/ess_frac"] = effective_sample_size(total.pop("_is/w_sum"), total.pop("_is/w_sq_sum"), tokens)
    if "_flops" in total:
        out["perf/model_tflop"] = total.pop("_flops") / 1e12
        out["perf/trained_tokens"] = total.pop("_trained_tokens")
    for k, v in total.items():
        if k.startswith("_max/"):
            out[k.removeprefix("_max/")] = v
        elif k in ("sync/logprob_abs_diff", "actor/entropy_nats", "critic/values_mean", "is/capped_frac",
                   "is/masked_frac"):
            out[k] = v / tokens
        elif k in ("critic/value_error", "critic/clip_frac"):
            out[k] = v / critic_tokens
        elif k == "critic/value_loss":
            out[k] = v / critic_updates
        elif k in ("actor/kl_nats", "actor/pg_loss_nats", "actor/clip_frac"):
            out[k] = v / loss_tokens
        elif k in ("actor/grad_norm", "actor/lr_per_update"):  # every rank reports the same value
            out[k] = v / updates / len(results)
        else:  # actor/loss_nats: the ranks' parts add up to each update's loss
            out[k] = v / updates
    out["actor/updates_count"] = updates
    return out
