"""`Cluster`: the driver's owner of every actor group of a run: the sandbox pool, the rollout
fleet, the learner group, the reward service and the environment service, and the weight sync
between the learner and the fleet. It starts them in order with their placement
(launch/components.py knows how each is built), keeps them whole and shuts them down.

It is the one caller of the fleet's `repair` (in a training run, and in the Tinker service, whose
command line holds a Cluster with a weight sync that moves nothing: launch/serve.py,
launch/tinker/server.FixedWeights): a repair returns the workers it replaced, and the Cluster
then has the weight sync join them and bring them up to date, and tells the fleet when every
worker holds the current weights (`fleet.synced()`). A sync that loses workers is handled
the same way. No component calls another back or reads another's attributes: they meet here.

The loop sees the Cluster as its weight sync (`sync`, `bytes_per_sync`), the GPU hand-over sees it
as the engines (`sleep`, `wake`), and the rollout sources call its `repair` while they wait.
Repairs happen on the driver's thread only (the one that made the Cluster, which also runs the
syncs), so a replaced worker gets the weights of the version the driver last synced, never the
learner's newer ones mid-step; a fleet call on another thread (a batch made ahead, an agent's
call) waits for the driver's next repair, as the fleet's calls do with a deadline.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from omegaconf import DictConfig

from rl.config.schema import TrainConfig
from rl.run.rollouts import repaired_while


class Cluster:
    def __init__(self, fleet, learner, weight_sync, *, rewards=None, sandboxes=None, envs=None, placement=None,
                 log: Callable[[str], None] = print):
        """The parts as started (`Cluster.start` starts them from a config); `weight_sync` not joined yet."""
        self.fleet, self.learner, self.weight_sync = fleet, learner, weight_sync
        self.rewards, self.sandboxes, self.envs, self.placement, self.log = rewards, sandboxes, envs, placement, log
        self.version = 0  # the policy version every rollout worker holds
        self._lock = threading.RLock()
        self._driver = threading.get_ident()

    @classmethod
    def start(cls, cfg: DictConfig, config: TrainConfig, log: Callable[[str], None] = print) -> Cluster:
        """Start every group of the run in order (sandboxes first: code rewards need them; the
        engines while the learner starts, launch/components.py) and join the weight sync. What
        started before a failure is shut down before the error propagates."""
        from launch.components import build_components, start_env_service, start_sandbox_pool

        parts: dict[str, Any] = {}
        try:
            parts["sandboxes"] = start_sandbox_pool(cfg)
            fleet, rewards, learner, weight_sync, placement = build_components(config, log, started=parts)
            parts["envs"] = start_env_service(config)
            cluster = cls(fleet, learner, weight_sync, rewards=rewards, sandboxes=parts["sandboxes"],
                          envs=parts["envs"], placement=placement, log=log)
            cluster.join()
            return cluster
        except BaseException:
            for name in ("learner", "rewards", "fleet", "envs"):
                if parts.get(name) is not None:
                    parts[name].shutdown()
            if parts.get("sandboxes") is not None:
                parts["sandboxes"].close()
            raise

    # --- the weight sync, with the repairs it needs ------------------------------------------

    @property
    def bytes_per_sync(self) -> float:
        return self.weight_sync.bytes_per_sync

    def join(self) -> None:
        """Join the weight sync with the current workers, replacing those that fail meanwhile
        (within `rollout.max_restarts`)."""
        with self._lock:
            while failed := self.weight_sync.join():
                self.fleet.replace(failed, "weight-sync join")

    def sync(self, version: int) -> float:
        """Bring every rollout worker to the learner's weights as policy `version`; a worker lost
        meanwhile is replaced, the sync joined again and redone. Returns the bytes sent to each."""
        with self._lock:
            while True:
                synced = self.weight_sync.sync(version)
                if not synced.failed:
                    self.version = version
                    self.fleet.synced()
                    return synced.sent
                self.fleet.replace(synced.failed, "weight sync")  # raises once its replacements are used up
                self.join()

    def repair(self) -> None:
        """Replace the rollout workers that failed and bring the new ones up to date (a no-op
        when none failed). Called by whoever waits on the fleet: the loop's schedules, the agents'
        runner, the hand-over below); on any other thread than the driver's, a no-op."""
        if threading.get_ident() != self._driver:
            return
        with self._lock:
            replaced = self.fleet.repair()
            if replaced:
                self.join()
                self.sync(self.version)

    # --- the engines' GPU memory, for the hand-over (rl/run/colocation.py) -------------------

    def sleep(self, level: int | None = None) -> None:
        repaired_while(lambda: self.fleet.sleep(level), self)

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        repaired_while(lambda: self.fleet.wake(tags), self)

    def shutdown(self) -> None:
        """End every group (never waits on a stuck one)."""
        self.weight_sync.close()
        for part in (self.learner, self.rewards, self.fleet, self.envs):
            if part is not None:
                part.shutdown()
        if self.sandboxes is not None:
            self.sandboxes.close()

