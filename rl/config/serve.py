"""The typed config of `python -m launch.serve` (configs/serve.yaml): the Tinker-protocol training
service. It takes the same `model`, `rollout`, `cluster` and `run` sections as `launch.train`
(schema.py), and its own `serve` section; `validate_serve` names every bad field with its fix."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from rl.config.schema import ClusterConfig, ConfigError, ModelConfig, RolloutConfig, RunConfig
from rl.config.validation import range_error


@dataclass
class ServeSection:
    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 serves every interface (set api_key then)
    port: int = 8000
    api_key: str = ""  # "" accepts any key the SDK sends (it must start with tml-); else only this one
    # the name clients ask for as base_model ("" = model.path as given: a Hub id is its own name)
    model_name: str = ""
    max_models: int = 4  # training models alive at once (each is an actor with its own base copy)
    max_lora_rank: int = 64
    lora_threads: int = 1  # torch threads of each training model's actor
    # a session without a heartbeat this long is ended, its models freed (noticed within a quarter
    # more: a client that exits frees its models within a minute); the SDK beats every 10 s
    session_timeout_s: float = 45.0
    poll_s: float = 20.0  # how long retrieve_future holds a pending request before "try again" (< the SDK's 45 s)
    op_timeout_s: float = 900.0  # a training or sampling call still unfinished after this fails
    seq_wait_s: float = 300.0  # a training call waits this long for the calls numbered before it
    max_request_mib: int = 64  # a request body over this is refused
    max_tokens_per_request: int = 1_000_000  # tokens of one forward_backward or sample call
    max_samples: int = 128  # num_samples of one sample call
    # how a sampler's adapter is applied: "merged" (into the engine's weights for each batch: base
    # speed on vLLM's CPU build, rollout/vllm_engine.MergedAdapters), "lora" (vLLM's LoRA, up to
    # rollout.max_loras adapters in one batch: fused kernels on GPUs), "auto" (merged on CPU)
    adapter_sampling: str = "auto"


@dataclass
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    serve: ServeSection = field(default_factory=ServeSection)


ConfigStore.instance().store(name="serve_schema", node=ServeConfig)
ADAPTER_SAMPLING = ("auto", "merged", "lora")


def adapters_merged(adapter_sampling: str, cuda: bool) -> bool:
    """Whether samplers' adapters are merged into the engine's weights (else vLLM's LoRA runs them):
    `serve.adapter_sampling`, where "auto" merges unless the machine has CUDA."""
    return adapter_sampling == "merged" or (adapter_sampling == "auto" and not cuda)


def validate_serve(cfg: Any) -> None:
    """Raise ConfigError listing every bad field of a merged ServeConfig, each with its fix."""
    s, r = cfg.serve, cfg.rollout
    errors = []
    try:
        ipaddress.ip_address(s.host)
    except ValueError:
        if s.host != "localhost":
            errors.append(f"serve.host={s.host!r}: give an IP address to bind, e.g. serve.host=127.0.0.1")
    if not 0 <= s.port <= 65535:
        errors.append(f"serve.port={s.port}: must be in [0, 65535] (0: any free port), e.g. serve.port=8000")
    if s.api_key and not s.api_key.startswith("tml-"):
        errors.append(f"serve.api_key={s.api_key!r}: the tinker SDK sends only keys starting with 'tml-', e.g. "
                      "serve.api_key=tml-mysecret")
    if s.host not in ("127.0.0.1", "localhost", "::1") and not s.api_key:
        errors.append(f"serve.host={s.host} serves other machines: set serve.api_key (e.g. serve.api_key=tml-...) "
                      "so that only your clients can train and sample")
    for name in ("max_models", "max_lora_rank", "lora_threads", "max_request_mib", "max_tokens_per_request",
                 "max_samples"):
        if getattr(s, name) < 1:
            errors.append(f"serve.{name}={getattr(s, name)}: must be >= 1")
    for name in ("session_timeout_s", "poll_s", "op_timeout_s", "seq_wait_s"):
        if not getattr(s, name) > 0:
            errors.append(f"serve.{name}={getattr(s, name)}: must be > 0")
    if 0 < s.session_timeout_s < 20:
        errors.append(f"serve.session_timeout_s={s.session_timeout_s}: the SDK heartbeats every 10 s, so a live "
                      "client would be ended; use 20 or more, e.g. serve.session_timeout_s=45")
    if not 0 < s.poll_s < 45:
        errors.append(f"serve.poll_s={s.poll_s}: the SDK gives up on a poll after 45 s; use e.g. serve.poll_s=20")
    if niceness := range_error("cluster.worker_niceness", cfg.cluster.worker_niceness):  # as launch.train checks it
        errors.append(niceness)
    if r.backend != "vllm":
        errors.append(f"rollout.backend={r.backend}: the service samples with saved adapters through vLLM's LoRA; "
                      "use rollout.backend=vllm")
    if s.adapter_sampling not in ADAPTER_SAMPLING:
        errors.append(f"serve.adapter_sampling={s.adapter_sampling!r}: choose one of {', '.join(ADAPTER_SAMPLING)}, "
                      "e.g. serve.adapter_sampling=auto")
    if s.adapter_sampling != "merged" and r.max_loras < 1:
        errors.append(f"rollout.max_loras={r.max_loras}: samplers use saved adapters through vLLM's LoRA "
                      f"(serve.adapter_sampling={s.adapter_sampling}); set rollout.max_loras >= 1, or "
                      "serve.adapter_sampling=merged")
    if s.adapter_sampling != "merged" and r.max_lora_rank < s.max_lora_rank:
        errors.append(f"rollout.max_lora_rank={r.max_lora_rank} is below serve.max_lora_rank={s.max_lora_rank}: "
                      f"the samplers must take every rank a client may train; set rollout.max_lora_rank="
                      f"{s.max_lora_rank}")
    if cfg.model.lora.rank:
        errors.append("model.lora.rank: each client names its own LoRA rank (create_lora_training_client); leave "
                      "model.lora unset")
    if errors:
        raise ConfigError("bad serve config:\n  - " + "\n  - ".join(errors))
