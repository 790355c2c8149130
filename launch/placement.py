"""Where the actors of a run go, and where they landed.

`make_placement` reserves one Ray placement group for the rollout workers and learner ranks,
spread over nodes as `cluster.placement` says, and gives each actor the options that put it in
its bundle. `cluster.placement_mode=disaggregated`: one bundle per actor (1 CPU, plus
`cluster.gpus_per_rollout_worker` / `cluster.gpus_per_learner` GPUs). `hybrid`: one bundle per
pair (2 CPUs and 1 GPU), rollout worker i and learner rank i both in bundle i, each asking Ray for
half of its GPU: Ray gives two fractional requests of one bundle the same GPU instance, so the
pair sees the same device (without the pairing, best-fit packing may put two rollout workers on
one GPU). Sandbox workers are not in it: they go to nodes advertising `sandbox.resource`.

`report_placement` prints where every actor landed, one line per role plus one naming the nodes
(head, IP, CPUs/GPUs and custom resources such as `benchmark`), and writes `<run>/actors.json`
(role, index, Ray node, IP, pid, bundle), so a user can find a process on a cluster and a test
can check the placement or inject a fault into a process.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

# cluster.placement -> Ray's placement group strategy
STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
# Resources every Ray node has; anything else on a node is custom (e.g. `benchmark`).
_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")


class PlacementError(RuntimeError):
    """The cluster cannot hold the rollout workers and learner ranks (the message names the fix)."""


@dataclass
class RolePlacement:
    """The placement group of the rollout and learner roles and each actor's Ray options. Ray
    removes the group when the driver disconnects (`ray.shutdown()`, on a cluster too)."""

    group: Any  # ray.util.placement_group.PlacementGroup
    strategy: str
    rollout: list[dict[str, Any]]  # actor_options for RolloutFleet: worker i -> its bundle
    learner: list[dict[str, Any]]  # actor_options for LearnerGroup: rank r -> its bundle
    mode: str = "disaggregated"  # cluster.placement_mode

    @property
    def id(self) -> str:
        return self.group.id.hex()

    def bundle(self, role: str, index: int) -> int | None:
        if role == "rollout":
            return index
        if role == "learner":
            return index if self.mode == "hybrid" else len(self.rollout) + index
        return None


# Ray's GPU request of each actor of a hybrid pair: only what puts both on their bundle's GPU
# (memory is shared in time: the engine sleeps while the learner trains, and the other way round).
HYBRID_GPU_SHARE = 0.5


def role_bundles(cfg: Any) -> list[dict[str, float]]:
    """Disaggregated: one bundle per rollout worker, then one per learner rank, each the resources
    its actor asks for (build_components gives every rollout worker and learner rank 1 CPU).
    Hybrid: one bundle per learner rank and its rollout worker (2 CPUs, their shared GPU)."""

    def bundle(gpus: float, cpus: float = 1.0) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": float(gpus)} if gpus > 0 else {})}

    c = cfg.cluster
    if c.placement_mode == "hybrid":
        return [bundle(1.0 if c.gpus_per_learner > 0 else 0.0, 2.0)] * cfg.trainer.num_workers
    return ([bundle(c.gpus_per_rollout_worker)] * cfg.rollout.num_workers
            + [bundle(c.gpus_per_learner)] * cfg.trainer.num_workers)


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items())


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def shortfall(bundles: list[dict[str, float]], strategy: str) -> list[str]:
    """Why the cluster as it stands (its nodes' total resources, whoever uses them) can never
    hold these bundles with this strategy; empty when it could."""
    totals = [n["Resources"] for n in _alive_nodes()]
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    why = [f"{k}: {sum(t.get(k, 0.0) for t in totals):g} in the cluster, {v:g} needed"
           for k, v in need.items() if sum(t.get(k, 0.0) for t in totals) < v]
    fits = lambda res, node: all(node.get(k, 0.0) >= v for k, v in res.items())  # noqa: E731
    for b in {tuple(sorted(b.items())) for b in bundles}:
        if not any(fits(dict(b), t) for t in totals):
            why.append(f"no node has {{{_amounts(dict(b))}}}")
    if strategy == "STRICT_PACK" and not any(fits(need, t) for t in totals):
        why.append(f"no node has {{{_amounts(need)}}} and strict_pack needs one")
    if strategy == "STRICT_SPREAD":
        hosts = sum(1 for t in totals if any(fits(b, t) for b in bundles))
        if hosts < len(bundles):
            why.append(f"{hosts} node(s) can hold a bundle and strict_spread needs {len(bundles)}")
    return why


def _failure(cfg: Any, bundles: list[dict[str, float]], strategy: str, why: list[str], waited: float | None) -> str:
    import ray

    c, free, total = cfg.cluster, ray.available_resources(), ray.cluster_resources()
    keys = sorted({k for b in bundles for k in b})
    have = ", ".join(f"{k} {free.get(k, 0.0):g} free of {total.get(k, 0.0):g}" for k in keys)
    waited_s = (f"not ready after {waited:.0f} s (run.start_timeout_s={cfg.run.start_timeout_s:g})"
                if waited is not None else "cannot be placed")
    if c.placement_mode == "hybrid":
        shapes = f"{len(bundles)} x {{{_amounts(bundles[0])}}}, one per learner rank and its rollout worker"
    else:
        shapes = (f"{cfg.rollout.num_workers} x {{{_amounts(bundles[0])}}} + {cfg.trainer.num_workers} x "
                  f"{{{_amounts(bundles[-1])}}}")
    lines = [
        f"the placement group of {cfg.rollout.num_workers} rollout worker(s) and {cfg.trainer.num_workers} "
        f"learner rank(s) {waited_s}: it needs {len(bundles)} bundles "
        f"({shapes}, strategy {strategy}); the cluster has {have} "
        f"({'; '.join(why) if why else 'other actors hold the rest'})."]
    if c.address:
        gpus = max(c.gpus_per_rollout_worker, c.gpus_per_learner)
        add = f"ray start --address=HEAD:6379{f' --num-gpus={math.ceil(gpus)}' if gpus > 0 else ''}"
        lines.append(f"Add nodes with those resources (on each: `{add}`), or ask for less:")
    else:
        lines.append("This machine's Ray cannot hold them (cluster.num_cpus sets its CPUs; GPUs are those it "
                     "finds); ask for less:")
    lines.append("rollout.num_workers, trainer.num_workers, cluster.gpus_per_rollout_worker, cluster.gpus_per_learner"
                 + (", or cluster.placement=pack" if strategy.startswith("STRICT") else "") + ".")
    return " ".join(lines)


def make_placement(cfg: Any, log: Callable[[str], None] = print) -> RolePlacement:
    """Reserve the rollout and learner bundles and wait (up to `run.start_timeout_s`) until Ray
    placed them. A local Ray that can never hold them fails at once; on a cluster it waits (an
    autoscaler may add nodes), says once what is missing, and fails at the deadline naming it."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = role_bundles(cfg)
    strategy = STRATEGIES[cfg.cluster.placement]
    if not cfg.cluster.address:
        why = shortfall(bundles, strategy)
        if why:
            raise PlacementError(_failure(cfg, bundles, strategy, why, None))
    group = placement_group(bundles, strategy=strategy)
    started, deadline, told = time.monotonic(), cfg.run.start_timeout_s, False
    while not group.wait(max(0.1, min(10.0, deadline - (time.monotonic() - started)))):
        waited = time.monotonic() - started
        if waited >= deadline:
            message = _failure(cfg, bundles, strategy, shortfall(bundles, strategy), waited)
            remove_placement_group(group)
            raise PlacementError(message)
        if not told:
            why = shortfall(bundles, strategy)
            log(f"Waiting for the cluster to hold {len(bundles)} bundles of the rollout and learner roles "
                f"({strategy}; {'; '.join(why) if why else 'other actors hold the resources'}); "
                f"giving up after run.start_timeout_s={deadline:g} s")
            told = True

    def options(index: int, gpus: float | None = None) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, **({"num_gpus": gpus} if gpus is not None else {})}

    n, m = cfg.rollout.num_workers, cfg.trainer.num_workers
    if cfg.cluster.placement_mode == "hybrid":
        share = HYBRID_GPU_SHARE if cfg.cluster.gpus_per_learner > 0 else None
        return RolePlacement(group, strategy, [options(i, share) for i in range(n)],
                             [options(r, share) for r in range(m)], mode="hybrid")
    return RolePlacement(group, strategy, [options(i) for i in range(n)], [options(n + r) for r in range(m)])


def describe_node(node: dict[str, Any]) -> dict[str, Any]:
    """A node of `ray.nodes()` as a report shows it: IP, head or not, CPUs/GPUs, custom resources."""
    res = node.get("Resources", {})
    custom = {k: v for k, v in res.items()
              if k not in _BUILTIN and not k.startswith(("node:", "accelerator_type:"))}
    return {"node_ip": node.get("NodeManagerAddress"), "head": "node:__internal_head__" in res,
            "cpus": res.get("CPU", 0.0), "gpus": res.get("GPU", 0.0), "custom_resources": custom}


def report_placement(run_dir: str, fleet, learner, rewards, sandboxes,
                     say: Callable[[str], None] = print,
                     placement: RolePlacement | None = None, envs=None) -> list[dict[str, Any]]:
    """Print and write where every actor landed; `placement` (make_placement's) adds each rollout
    worker's and learner rank's placement group and bundle. `rewards`, `sandboxes` and `envs`
    may be None (not started)."""
    import ray

    nodes = {n["NodeID"]: describe_node(n) for n in ray.nodes()}
    rows: list[dict[str, Any]] = []
    roles = [("rollout", fleet.where), ("learner", learner.where)]
    for role, part in (("reward", rewards), ("env", envs), ("sandbox", sandboxes)):
        if part is not None:
            roles.append((role, part.where()))
    node_ids = list(dict.fromkeys(where["node_id"] for _, places in roles for where in places))
    node_ids.sort(key=lambda node: not nodes.get(node, {}).get("head"))  # the head first, then in order of use
    label = {node: f"node {n + 1}" for n, node in enumerate(node_ids)}
    for role, places in roles:
        for i, where in enumerate(places):
            bundle = placement.bundle(role, i) if placement else None
            rows.append({"role": role, "index": i, **where, "node": label[where["node_id"]],
                         **nodes.get(where["node_id"], {}),
                         "placement_group": placement.id if bundle is not None else None, "bundle": bundle})
    path = os.path.join(run_dir, "actors.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(path + ".tmp", path)

    def node_line(node: str) -> str:
        d = nodes.get(node)
        if d is None:
            return f"{label[node]} ({node[:8]}, gone)"
        parts = (["head"] if d["head"] else []) + [d["node_ip"], f"CPU {d['cpus']:g}"]
        parts += [f"GPU {d['gpus']:g}"] if d["gpus"] else []
        parts += [f"{k} {v:g}" for k, v in d["custom_resources"].items()]
        return f"{label[node]} ({', '.join(parts)})"

    say(f"Nodes: {', '.join(node_line(node) for node in node_ids)}")
    if placement is not None:
        n, m = len(placement.rollout), len(placement.learner)
        span = lambda a, b: f"bundle {a}" if a == b else f"bundles {a}-{b}"  # noqa: E731
        if placement.mode == "hybrid":
            say(f"Placement group {placement.id} ({placement.strategy}, hybrid): rollout worker i and learner "
                f"rank i share bundle i ({span(0, m - 1)})")
        else:
            say(f"Placement group {placement.id} ({placement.strategy}): rollout workers in {span(0, n - 1)}, "
                f"learner ranks in {span(n, n + m - 1)}")
    for role, places in roles:
        spots = []
        for i, w in enumerate(places):
            bundle = placement.bundle(role, i) if placement else None
            spots.append(f"{i}: {label[w['node_id']]} ({w['ip']}) pid {w['pid']}"
                         + (f" bundle {bundle}" if bundle is not None else ""))
        say(f"Placement: {role} [{', '.join(spots)}]")
    return rows
