"""`RolloutFleet`: spreads a batch of generation requests over `RolloutWorker` actors."""

from __future__ import annotations

from typing import Any

import ray

from rl.types import GenerationRequest, Sample
from rollout.protocol import RolloutSpec
from rollout.worker import RolloutWorker


def split_by_group(requests: list[GenerationRequest], parts: int) -> list[list[GenerationRequest]]:
    """Contiguous chunks of whole groups (a prompt's n samples stay together for prefix caching),
    balanced by request count."""
    groups: dict[int, list[GenerationRequest]] = {}
    for r in requests:
        groups.setdefault(r.group_id, []).append(r)
    chunks: list[list[GenerationRequest]] = [[] for _ in range(parts)]
    per_part = -(-len(requests) // parts)
    part = 0
    for members in groups.values():
        if len(chunks[part]) >= per_part and part < parts - 1:
            part += 1
        chunks[part].extend(members)
    return chunks


class RolloutFleet:
    def __init__(
        self,
        spec: RolloutSpec,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
    ):
        """`spec.rollout.num_workers` RolloutWorker actors, worker i seeded with run.seed + i."""
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        remote_cls = ray.remote(RolloutWorker)
        self.workers = [remote_cls.options(**options).remote(spec, i) for i in range(spec.rollout.num_workers)]
        ray.get([w.version.remote() for w in self.workers])  # surface start-up errors here

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        chunks = split_by_group(requests, len(self.workers))
        futures = [w.generate.remote(c) for w, c in zip(self.workers, chunks) if c]
        samples = [s for part in ray.get(futures) for s in part]
        order = {(r.group_id, r.sample_index): i for i, r in enumerate(requests)}
        return sorted(samples, key=lambda s: order[(s.group_id, s.sample_index)])

    def sleep(self) -> None:
        ray.get([w.sleep.remote() for w in self.workers])

    def wake(self) -> None:
        ray.get([w.wake.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
