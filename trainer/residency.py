"""Where one learner rank's states live between uses, for hybrid placement
(`cluster.placement_mode=hybrid`): a learner rank and a rollout engine share a GPU in turns, so
while the engine generates the rank's states wait in host memory (rl/run/colocation.py says
when each side holds the GPU)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Residency:
    def __init__(self, engines: list, frozen: list, frozen_movable: bool, device: torch.device):
        """`engines`: the DeepSpeed engines with states to move (policy, critic); `frozen`: the
        reference and teacher engines, moved as plain modules when `frozen_movable` (ZeRO stage
        0: under ZeRO-3 their partitions stay where DeepSpeed keeps them, with ref_offload the host)."""
        self.engines = [e for e in engines if e is not None]
        self.frozen = [f for f in frozen if f is not None] if frozen_movable else []
        self.device = device
        self.offloaded = False

    def offload(self, keep_weights: bool = False) -> None:
        """Move the states to host memory so the rollout engine sharing the GPU can wake:
        DeepSpeed's `offload_states` for the policy and critic (optimizer states, fp32 master
        weights, gradients, and unless `keep_weights` the 16-bit weights a CUDA-IPC sync reads),
        the reference and teacher models' weights, then the caching allocator's free blocks. Again with
        keep_weights=False, the rest goes too."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        include = [s for s in State if not (keep_weights and s == State.lp_params)]
        pin = self.device.type == "cuda"
        for engine in self.engines:
            engine.offload_states(include=include, pin_memory=pin)
        if not keep_weights:
            for frozen in self.frozen:
                frozen.module.to("cpu")
        self.offloaded = True
        if pin:
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload` (the engine on this GPU sleeps now)."""
        if not self.offloaded:
            return
        for engine in self.engines:
            engine.reload_states()
        for frozen in self.frozen:
            frozen.module.to(self.device)
        self.offloaded = False

    @contextmanager
    def resident(self):
        """States on the device for the duration (a checkpoint written between steps, a sync),
        then offloaded again if they were."""
        was = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was:
                self.offload()
