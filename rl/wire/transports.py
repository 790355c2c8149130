"""The weight sync `trainer.weight_sync` names: one strategy per transport (rl/wire/collective.py,
object_store.py, ipc.py; the contract they share: rl/wire/base.py)."""

from __future__ import annotations

from rl.actors.faults import Deadlines
from rl.wire.base import Port, WeightSync
from rl.wire.collective import CollectiveSync
from rl.wire.format import WeightMeta
from rl.wire.ipc import IpcRuntime, IpcSync
from rl.wire.object_store import ObjectStoreSync


def make_weight_sync(method: str, learner: Port, metas: list[WeightMeta], rollout: Port, ranks_per_engine: int = 1,
                     deadlines: Deadlines | None = None, delta_max_fraction: float | None = None, *,
                     ipc: IpcRuntime | None = None) -> WeightSync:
    """The strategy `trainer.weight_sync` names between the learner ranks and the rollout workers
    (not joined yet: the `Cluster` joins it); `delta_max_fraction`: delta syncs
    (`trainer.delta_sync`, collective only), None: whole; `ipc`: what CUDA IPC takes from outside
    `rl` (`trainer.vllm_ipc.ipc_runtime()`), needed by `ipc` only."""
    if delta_max_fraction is not None and method != "collective":
        raise ValueError(f"delta syncs need trainer.weight_sync=collective, not {method}")
    if method == "collective":
        return CollectiveSync(learner, metas, rollout, ranks_per_engine, deadlines, delta_max_fraction)
    if method == "object_store":
        return ObjectStoreSync(learner, metas, rollout, ranks_per_engine, deadlines)
    if method == "ipc":
        if ipc is None:
            raise ValueError("trainer.weight_sync=ipc needs ipc=trainer.vllm_ipc.ipc_runtime() (Ray and vLLM's "
                             "trainer-side engine)")
        return IpcSync(learner, metas, rollout, ranks_per_engine, deadlines, runtime=ipc)
    raise ValueError(f"trainer.weight_sync={method!r}: choose collective, object_store or ipc")
