"""The weight sync, as one component: learner -> rollout workers, one strategy per transport
(`base.py` has the contract: join, push, sync; each transport's two ends are in rl/wire/)."""

from __future__ import annotations

from trainer.sync.base import Port, Pushed, Synced, WeightSync


def make_weight_sync(method: str, learner: Port, metas: list, rollout: Port, ranks_per_engine: int = 1,
                     deadlines=None, delta_max_fraction: float | None = None) -> WeightSync:
    """The strategy `trainer.weight_sync` names between the learner ranks and the rollout workers
    (not joined yet: the `Cluster` joins it); `delta_max_fraction`: delta syncs
    (`trainer.delta_sync`, collective only), None: whole."""
    from trainer.sync.collective import CollectiveSync
    from trainer.sync.ipc import IpcSync
    from trainer.sync.object_store import ObjectStoreSync

    if delta_max_fraction is not None and method != "collective":
        raise ValueError(f"delta syncs need trainer.weight_sync=collective, not {method}")
    if method == "collective":
        return CollectiveSync(learner, metas, rollout, ranks_per_engine, deadlines, delta_max_fraction)
    strategies = {"object_store": ObjectStoreSync, "ipc": IpcSync}
    return strategies[method](learner, metas, rollout, ranks_per_engine, deadlines)
