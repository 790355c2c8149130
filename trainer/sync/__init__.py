"""The weight sync, as one component: learner -> rollout workers, one strategy per transport
(`base.py` has the contract: join, push, verify, rejoin)."""

from __future__ import annotations

from trainer.sync.base import Receivers, Senders, WeightSync


def make_weight_sync(method: str, learner: Senders, fleet: Receivers, deadlines=None,
                     delta_max_fraction: float | None = None) -> WeightSync:
    """The strategy `trainer.weight_sync` names, joined with the fleet's current workers;
    `delta_max_fraction`: delta syncs (`trainer.delta_sync`, collective only), None: whole."""
    from trainer.sync.collective import CollectiveSync
    from trainer.sync.ipc import IpcSync
    from trainer.sync.object_store import ObjectStoreSync

    strategies = {"collective": CollectiveSync, "object_store": ObjectStoreSync, "ipc": IpcSync}
    if delta_max_fraction is not None and method != "collective":
        raise ValueError(f"delta syncs need trainer.weight_sync=collective, not {method}")
    sync = (CollectiveSync(learner, fleet, deadlines, delta_max_fraction) if method == "collective"
            else strategies[method](learner, fleet, deadlines))
    sync.join()
    return sync
