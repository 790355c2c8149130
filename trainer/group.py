"""`LearnerGroup`: N `LearnerWorker` Ray actors forming one DeepSpeed data-parallel job.

The driver sees one object: `train_step(batch)` shards the batch over the ranks and reduces their
metric sums; `sync_weights(fleet, version)` pushes the new weights to the rollout fleet.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from rl.types import TrainBatch
from rl import weight_sync
from trainer.learner import LearnerSpec, LearnerWorker


def shard_rows(n_rows: int, world_size: int) -> list[torch.Tensor]:
    """Interleaved row indices per rank, so every rank sees a mix of groups and lengths."""
    return [torch.arange(rank, n_rows, world_size) for rank in range(world_size)]


class LearnerGroup:
    def __init__(
        self,
        spec: LearnerSpec,
        num_workers: int,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
        weight_sync_method: str = "collective",
    ):
        self.spec, self.world_size = spec, num_workers
        self.num_gpus, self.sync_method = num_gpus, weight_sync_method
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        remote_cls = ray.remote(LearnerWorker)
        self.workers = [remote_cls.options(**options).remote(spec, rank, num_workers) for rank in range(num_workers)]
        master_addr, master_port = ray.get(self.workers[0].node_address.remote())
        ray.get([w.setup.remote(master_addr, master_port) for w in self.workers])
        self.metas: list[weight_sync.WeightMeta] = ray.get(self.workers[0].weight_metas.remote())

    def score(self, batch: TrainBatch) -> TrainBatch:
        """Every rank scores its shard (old/reference log-probs, values); reassembled in row order."""
        if len(batch) != self.spec.samples_per_step:
            raise ValueError(f"expected {self.spec.samples_per_step} rows per step, got {len(batch)}")
        index = shard_rows(len(batch), self.world_size)
        scored = ray.get([w.score.remote(batch.select(rows)) for w, rows in zip(self.workers, index)])
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
        results = ray.get([w.train_step.remote(s, step, kl_coef) for w, s in zip(self.workers, shards)])
        return reduce_metrics(results)

    def connect(self, fleet) -> None:
        """Make the weight-sync group: learner rank 0 plus every rollout worker."""
        if self.sync_method == "object_store":
            return
        host, port = ray.get(self.workers[0].node_address.remote())
        backend = "nccl" if torch.cuda.is_available() or self.num_gpus > 0 else "gloo"
        world = 1 + len(fleet.workers)
        joins = [self.workers[0].join_weight_sync.remote(host, port, world, backend)]
        joins += [
            w.join_weight_sync.remote(host, port, rank + 1, world, backend, self.metas)
            for rank, w in enumerate(fleet.workers)
        ]
        ray.get(joins)

    def sync_weights(self, fleet, version: int) -> float:
        """Push the current weights to every rollout worker as `version`; returns bytes moved."""
        if self.sync_method == "object_store":
            states = ray.get([w.full_state_dict.remote() for w in self.workers])
            ref = ray.put(states[0])
            ray.get([w.load_weights_from_object.remote(ref, version) for w in fleet.workers])
            return float(sum(t.numel() * t.element_size() for t in states[0].values()))
        sends = [w.broadcast_weights.remote() for w in self.workers]
        receives = [w.receive_weights.remote(version) for w in fleet.workers]
        sent = ray.get(sends)
        ray.get(receives)
        return sent[0]

    def save_checkpoint(self, path: str) -> None:
        ray.get([w.save_checkpoint.remote(path) for w in self.workers])

    def load_checkpoint(self, path: str) -> None:
        ray.get([w.load_checkpoint.remote(path) for w in self.workers])

    def save_pretrained(self, path: str) -> None:
        ray.get([w.save_pretrained.remote(path) for w in self.workers])

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
    for k, v in total.items():
        if k.startswith("_max/"):
            out[k.removeprefix("_max/")] = v
        elif k in ("sync/logprob_abs_diff", "actor/entropy_nats", "critic/values_mean"):
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
