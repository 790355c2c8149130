"""Which device an actor computes on and which backend its process groups use, decided inside the
actor from the GPUs Ray gave it (`ray.get_gpu_ids()`), never from the driver's view of the machine.

Why not `torch.cuda.is_available()`: on a CUDA machine it is true in every process, also in an
actor Ray gave no GPU (Ray 2.60 leaves `CUDA_VISIBLE_DEVICES` unset for those unless
`GPU_VISIBILITY_ENV` is set, which `launch.train` does), and the driver's answer says nothing
about the actors'. Pure functions: the Ray call stays in the actor wrappers.
"""

from __future__ import annotations

from collections.abc import Sequence

# Ray then sets CUDA_VISIBLE_DEVICES="" in an actor given no GPU, so it sees none (reward models,
# sandboxes, environments and CPU roles stay off the GPUs other roles were given).
GPU_VISIBILITY_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}


class NoCudaError(RuntimeError):
    """An actor was given GPUs by Ray but this process's torch has no CUDA."""


def actor_device(gpu_ids: Sequence[object], cuda_available: bool, role: str) -> str:
    """'cuda' when Ray gave this actor GPUs, else 'cpu'. With one GPU per actor (the only layout
    we place), the device is the first visible one: `cuda:0` inside the actor."""
    if not gpu_ids:
        return "cpu"
    if not cuda_available:
        import torch

        raise NoCudaError(
            f"{role} was given GPU(s) {[str(g) for g in gpu_ids]} by Ray but torch {torch.__version__} cannot use CUDA "
            "here: install the CUDA build (RLPOST_EXTRA=cuda bash launch/install.sh), or set "
            "cluster.gpus_per_learner=0 cluster.gpus_per_rollout_worker=0 to run on CPUs")
    return "cuda"


def collective_backend(device: str) -> str:
    """torch.distributed backend for tensors on `device`: NCCL for CUDA tensors, gloo for CPU."""
    return "nccl" if device == "cuda" else "gloo"



def local_device_index(gpu_ids: Sequence[object], environ: dict[str, str]) -> int:
    """The CUDA index of an actor's GPU inside its process (DeepSpeed's LOCAL_RANK): 0, since Ray
    sets CUDA_VISIBLE_DEVICES to the actor's own GPU, unless told not to
    (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): then every GPU of the node is visible and the
    actor's is the one Ray assigned."""
    if gpu_ids and environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        visible = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
        first = str(gpu_ids[0])
        return visible.index(first) if first in visible else int(first)
    return 0
