"""`LearnerGroup`: N `LearnerWorker` Ray actors forming one DeepSpeed data-parallel job.

The driver sees one object: `update(batch, outcomes, ...)` shards the batch over the ranks, which
score it, estimate the advantages and train where it is (the batch's tensors cross once), and
reduces their metric sums. The ranks are an `ActorGroup` (rl/actors/group.py); the weight sync
(`rl/wire/`) reaches them through that group and `metas`; the learner knows nothing of
rollout workers.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from rl.wire.format import WeightMeta
from rl.algo.importance import effective_sample_size
from rl.actors.group import ActorGroup, HoldsActorGroup
from rl.actors.faults import Deadlines
from rl.data.batch import shard_rows
from rl.data.types import Outcomes, TrainBatch
from trainer.learner import LearnerWorker
from trainer.learner_setup import LearnerSpec


class LearnerGroup(HoldsActorGroup):
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
        actor_options: list[dict[str, Any]] | None = None,
        deadlines: Deadlines | None = None,
    ):
        self.spec, self.world_size = spec, num_workers
        self.num_gpus = num_gpus
        self.deadlines = deadlines or Deadlines()
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        # per-rank options (a placement bundle, a GPU share) override the common ones
        self.group = ActorGroup(ray, LearnerWorker, num_workers, role="learner rank",
                                args=lambda r: (spec, r, num_workers), options=options, per_actor=actor_options,
                                deadlines=self.deadlines)
        self.group.started()
        master_addr, master_port = self.call([self.workers[0].node_address.remote()], "start-up")[0]
        self.call([w.setup.remote(master_addr, master_port) for w in self.workers], "set-up", self.deadlines.start_s)
        self.metas: list[WeightMeta] = self.call([self.workers[0].weight_metas.remote()], "set-up")[0]  # (what a sync sends)

    def call(self, refs: list, kind: str, deadline: float | None = None, tolerate_errors: bool = False) -> list:
        """One result per rank within the deadline of `kind`; a dead or silent rank is an
        ActorFailure. `tolerate_errors`: an exception raised inside a live rank gives None (its
        peer in a collective failed, which the caller handles)."""
        return self.group.each(refs, kind, deadline, tolerate_errors)

    def _check_rows(self, batch: TrainBatch) -> None:
        if len(batch) < self.spec.samples_per_step:  # more: an episode's segments, rows of their own
            raise ValueError(f"expected at least {self.spec.samples_per_step} rows per step, got {len(batch)}")

    def update(self, batch: TrainBatch, outcomes: Outcomes, step: int, kl_coef: float) -> dict[str, float]:
        """The step on the ranks: each scores its shard, they estimate the advantages together and
        each trains on its rows (`LearnerWorker.update`). The batch's tensors cross once; back come
        the reduced metrics, the estimate's (`adv/...`, KL in the reward) and `time/score_s`."""
        self._check_rows(batch)
        shards = [batch.select(rows) for rows in shard_rows(len(batch), self.world_size)]
        width = batch.input_ids.shape[1] - 1
        results = self.call([w.update.remote(s, outcomes, step, kl_coef, width) for w, s in zip(self.workers, shards)],
                            "update")
        return {**results[0][1], **reduce_metrics([sums for sums, _ in results])}

    def score(self, batch: TrainBatch) -> TrainBatch:
        """Every rank scores its shard (old/reference/teacher log-probs, values); reassembled in row
        order. For tools and tests: a step scores where it trains (`update`)."""
        self._check_rows(batch)
        index = shard_rows(len(batch), self.world_size)
        scored = self.call([w.score.remote(batch.select(rows)) for w, rows in zip(self.workers, index)], "score")
        width = batch.input_ids.shape[1] - 1
        for name in ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs"):
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
        """An update on a batch whose advantages are set (tools and tests; a step `update`s)."""
        self._check_rows(batch)
        shards = [batch.select(rows) for rows in shard_rows(len(batch), self.world_size)]
        results = self.call([w.train_step.remote(s, step, kl_coef) for w, s in zip(self.workers, shards)],
                            "train_step")
        return reduce_metrics(results)

    def offload(self, keep_weights: bool = False) -> None:
        """Every rank moves its states to the host (hybrid placement: the engine on its GPU wakes)."""
        self.call([w.offload.remote(keep_weights) for w in self.workers], "offload")

    def onload(self) -> None:
        self.call([w.onload.remote() for w in self.workers], "onload")

    def save_checkpoint(self, path: str) -> None:
        self.call([w.save_checkpoint.remote(path) for w in self.workers], "save_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        self.call([w.load_checkpoint.remote(path) for w in self.workers], "load_checkpoint", self.deadlines.start_s)

    def parameter_counts(self) -> dict[str, float]:
        """Rank 0's trainable and total parameters and model bytes (`LearnerWorker.parameter_counts`)."""
        return self.call([self.workers[0].parameter_counts.remote()], "parameter_counts")[0]

    def save_pretrained(self, path: str, adapter_path: str | None = None) -> None:
        self.call([w.save_pretrained.remote(path, adapter_path) for w in self.workers], "save_pretrained")

    def shutdown(self) -> None:
        self.group.shutdown()


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
    skipped = total.pop("_skipped", 0.0) / len(results)  # updates DeepSpeed skipped (same on every rank)
    critic_skipped = total.pop("_skipped/critic", None)
    out: dict[str, float] = {}
    if "_is/w_sum" in total:
        out["is/ess_frac"] = effective_sample_size(total.pop("_is/w_sum"), total.pop("_is/w_sq_sum"), tokens)
    if "_flops" in total:
        out["perf/model_tflop"] = total.pop("_flops") / 1e12
        out["perf/trained_tokens"] = total.pop("_trained_tokens")
        # positions the layers computed per trained token: < 1 where prefixes are shared, > 1 with padding
        out["perf/computed_per_trained_token"] = total.pop("_computed_tokens", 0.0) / max(out["perf/trained_tokens"], 1.0)
    if "_kernel_flops" in total:  # what the kernels computed (rl/plan/flops.py: hardware utilisation)
        out["perf/kernel_tflop"] = total.pop("_kernel_flops") / 1e12
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
    out["actor/skipped_updates_count"] = skipped
    if critic_skipped is not None:  # a critic (PPO): its skips stop the run like the actor's (rl/run/guards.py)
        out["critic/updates_count"] = critic_updates
        out["critic/skipped_updates_count"] = critic_skipped / len(results)
    return out
