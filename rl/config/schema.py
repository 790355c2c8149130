"""Structured config schema: every key a run accepts, with its type and default.

Hydra merges `configs/train.yaml` and its groups into `TrainConfig`, so a misspelled key or a
value of the wrong type fails before anything starts, naming the field. `validate` adds the
checks a type cannot express (ranges, divisibility) with the field's name and the fix.
No torch/ray imports here: the CLI must reject bad input in well under a second.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from rl.config.algorithm_names import ALGORITHM_CHOICES, advantage_needs, advantages_needing

# metric sinks of `run.loggers` (rl/run/loggers.py writes them)
LOGGERS = ("tensorboard", "jsonl", "wandb", "mlflow")


def logger_errors(names: Iterable[str]) -> list[str]:
    """The config error for `run.loggers` naming an unknown sink (empty when all are known)."""
    names = list(names)
    unknown = [name for name in names if name not in LOGGERS]
    if not unknown:
        return []
    return [f"run.loggers={names}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(LOGGERS)}, "
            "e.g. run.loggers=[tensorboard,jsonl,wandb]"]


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    advantage: str = "grpo"  # grpo | rloo | reinforce_pp | gae ... (all: rl/config/algorithm_names.py)
    norm_by_std: bool = True  # grpo only; False = Dr.GRPO (mean-centred only)
    gamma: float = 1.0  # reinforce_pp, gae
    lam: float = 0.95  # gae
    whiten_advantages: bool = True  # gae: normalise advantages over the batch (PPO)
    policy_loss: str = "ppo_clip"  # ppo_clip | ppo_dual_clip | gspo | cispo (rl/algo/losses.py)
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # > clip_eps_low: DAPO's clip-higher
    clip_ratio_c: float = 3.0  # ppo_dual_clip: lower bound on the loss of negative advantages
    entropy_coef: float = 0.0  # entropy bonus weight
    # MoE only: weight of the routers' load-balancing loss (transformers' aux_loss over the learner's
    # forward) added to the policy loss; 0 = off, as RL fine-tuning of a trained router usually is
    router_aux_loss_coef: float = 0.0
    kl_coef: float = 0.001  # weight of KL(policy || reference); 0 disables the reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 | k3_clamped
    kl_in_reward: bool = False  # True: per-token reward penalty (PPO-RLHF style); False: a loss term
    kl_ctrl: str = "fixed"  # fixed | adaptive (Ziegler et al.: steer towards kl_target)
    kl_target: float = 0.01  # adaptive: target KL in nats per token
    kl_horizon: int = 10000  # adaptive: samples over which the coefficient adapts
    critic: bool = False  # PPO: learn a value model (needed by advantage=gae)
    critic_init: str | None = None  # value model start: null = the policy's weights, or a reward-model folder
    critic_lr: float = 1e-3
    critic_warmup_steps: int = 0  # steps that train only the critic before the policy moves
    # On-policy distillation (rl/algo/distill.py, algorithm=opd): a frozen teacher (a model folder or
    # Hub id, sharing the student's tokenizer) scores the student's sampled tokens; each token's
    # advantage becomes (1 - distill_coef) x the task advantage + distill_coef x (teacher log-prob -
    # student log-prob), the negative reverse KL. 0 = no teacher
    teacher_path: str | None = None
    distill_coef: float = 0.0
    value_clip: float = 0.2  # clipped value loss range; 0 = unclipped
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more
    max_sampling_rounds: int = 3  # DAPO: generation rounds per step at most (then fill with what there is)
    overlong_buffer: int = 0  # DAPO: soft length penalty over the last N tokens of the budget; 0 = off
    overlong_penalty: float = 1.0  # DAPO: penalty at the budget
    mask_truncated: bool = False  # DAPO: completions cut at max_new_tokens get no loss
    lr: float = 1e-3
    lr_warmup_steps: int = 10  # optimizer updates of linear warm-up
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1  # passes over each step's batch
    mini_batches: int = 1  # optimizer steps per pass
    # Asynchronous rollouts: the next batches generate while the learner trains on this one, from
    # weights at most this many versions old (0 = on-policy, lock-step).
    off_policy_steps: int = 0
    # Behaviour (rollout engine) vs learner policy mismatch (rl/algo/importance.py):
    # behaviour_clip: with off_policy_steps > 0, PPO's clipped ratio is pi_learner / pi_rollout, a
    #   trust region around the policy that sampled (measured best with off_policy_steps=1,
    #   docs/speed-and-planner.md); on-policy it leaves PPO's ratio against the learner's old policy as it is;
    # token_tis: ratio against the learner's pre-update policy, each token weighted by
    #   min(pi_learner_old / pi_rollout, tis_cap); token_mis: the ratio, tokens above mis_cap get
    #   no loss; icepop: the ratio, tokens outside [icepop_low, icepop_high] get no loss;
    #   seq_mask: sequences whose geometric-mean ratio leaves [seq_mask_low, seq_mask_high]
    #   dropped; none. The share of tokens capped or masked is logged (is/capped_frac, is/masked_frac).
    importance_correction: str = "behaviour_clip"
    tis_cap: float = 2.0
    mis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_low: float = 0.5
    seq_mask_high: float = 2.0


@dataclass
class LoraConfig:
    """LoRA adapters (peft) instead of full fine-tuning: the learner trains and syncs only them."""

    rank: int = 0  # 0 = full fine-tuning; > 0 = train LoRA adapters of this rank only
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    # a local HF folder (this default one is built when missing) or a Hub id such as Qwen/Qwen3-1.7B,
    # resolved into the Hugging Face cache before Ray starts (launch/hub.py)
    path: str = "artifacts/tiny/model"
    revision: str = ""  # with a Hub id: its branch, tag or commit ("" = the default branch)
    dtype: str = "float32"  # float32 | bfloat16, for learner and rollout alike
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RolloutConfig:
    backend: str = "vllm"  # vllm | hf
    num_workers: int = 1
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    max_model_len: int = 128
    # true: no torch.compile / CUDA graphs (fast start); false: compiled (faster decoding, slow
    # start); auto: launch picks by the run's predicted generation time (rl/plan/engine_mode.py)
    enforce_eager: Any = True
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: int = 1  # CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)
    sleep_between_steps: bool = False  # free rollout memory while the learner trains (GPU colocate)
    max_restarts: int = 3  # dead or hung rollout workers replaced per run (then the run stops)
    max_retries: int = 2  # times a worker's unfinished requests are sent again after it failed
    # GPUs (vLLM worker processes) per engine, each holding a shard of the model; with GPUs set
    # cluster.gpus_per_rollout_worker to the same number (vllm backend only)
    tensor_parallel_size: int = 1
    # batch: each step's prompts are generated together (with algorithm.off_policy_steps=k, up to k
    # batches ahead in a thread). streaming: every engine runs vLLM's AsyncLLM with requests flowing
    # continuously; finished groups queue up for the learner, weight syncs pause the engines with
    # their requests kept and resume them (a sample may span versions; the staleness bound,
    # algorithm.off_policy_steps >= 1, counts its oldest token) (rl/run/streaming.py)
    mode: str = "batch"
    # streaming: the KV cache of requests in flight across a weight sync: keep (reuse the blocks the
    # old weights computed: fastest) or recompute (drop them; the prompt and tokens so far are
    # prefilled again under the new weights)
    inflight_kv: str = "keep"
    pause_timeout_s: float = 300.0  # streaming: an engine paused this long is named and resumed
    # vLLM's LoRA (vllm backend): requests may name a saved adapter to sample with (the Tinker
    # service's samplers); max_loras adapters in one batch (0: off), each of rank <= max_lora_rank
    max_loras: int = 0
    max_lora_rank: int = 32


@dataclass
class RewardFunctionConfig:
    fn: str = MISSING  # "package.module:function" or "path/to/file.py:function"
    weight: float = 1.0
    name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments for fn


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    num_workers: int = 1
    timeout_s: float = 60.0
    max_failed_steps: int = 3  # stop when every sample's reward failed this many steps in a row
    # A reward function's value, and the weighted sum of them, must be within +-bound; past it the
    # sample is an error naming the function and the value (1e300 overflowed GRPO's group std and a
    # critic's squared error, issue 58). Agents have their own: task.agent_reward_bound.
    bound: float = 1e6


@dataclass
class TaskConfig:
    name: str = "arith"
    train_files: list[str] = field(default_factory=lambda: ["artifacts/tiny/data/train.jsonl"])
    prompt_key: str = "prompt"
    prompts_per_step: int = 32
    # true: each prompt is sent as a user message through the tokenizer's chat template (with
    # the generation prompt), and observations become the template's tool (or user) turns
    chat_template: bool = False
    system_prompt: str = ""  # with task.chat_template: a system message before every prompt ("": none)
    # reasoning-gym's procedural datasets (task=reasoning_gym, reward/reasoning_gym.py), mixed as its
    # CompositeDataset mixes them: [{name, weight, config}]. Their rows are written before Ray starts
    # and become task.train_files (and eval.files, when that is empty); [] = rows come from files.
    datasets: list[dict[str, Any]] = field(default_factory=list)
    size: int = 1000  # training rows drawn from task.datasets
    eval_size: int = 100  # held-out rows drawn from task.datasets (their questions are never trained on)
    seed: int = 0  # the seed task.datasets' rows are drawn with (not run.seed: the same rows for every run)
    # appended to each question of task.datasets (e.g. "Reply with just the number."); launch.checks
    # refuses a run whose answer extraction, with this and task.system_prompt, cannot score a
    # perfect answer on one of task.datasets (word answers and the last number; tags nothing asks for)
    instruction: str = ""
    # Multi-turn episodes (rl/data/env.py): the environment class, "package.module:Class" or
    # "path/file.py:Class", built per episode with env_kwargs; null = single-turn completions.
    # "openenv:<EnvClient class or http://server>": an OpenEnv environment (expand_openenv
    # below: played as agent episodes of reward/agents/openenv.py, env_kwargs theirs)
    env: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # model turns per episode at most (rollout.max_new_tokens is per turn)
    max_episode_tokens: int = 0  # model + observation tokens after the prompt; 0 = up to rollout.max_model_len
    max_observation_tokens: int = 64  # an observation longer than this is cut
    observation_role: str = "tool"  # chat role of a text observation (tool or user)
    env_workers: int = 1  # Ray actors running environments
    env_timeout_s: float = 60.0  # per reset or step call; past it the episode ends with an error
    # Agent episodes: "package.module:function" or "path/file.py:function", called as
    # fn(base_url, row, **agent_kwargs) once per sample, in a process of its own, with its own
    # OpenAI-compatible base URL; it runs any agent code (the `openai` client) and returns the
    # episode's reward (a finite number, or None to leave it to reward.functions). The calls it
    # makes there are the trajectory, token for token (reward/agents/runner.py).
    agent: str | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    agent_workers: int = 16  # episodes running at once (worker processes)
    agent_timeout_s: float = 300.0  # an agent that has not returned by then is killed; its episode is an error
    agent_memory_mb: int = 2048  # memory of one agent's processes (past it: killed, an error sample)
    agent_max_processes: int = 64  # processes/threads one agent may have at once (a fork bomb stops there)
    # An agent's reward must be a real number (not a bool) with |reward| <= this; past it the sample
    # is an error naming the agent and the value (a 1e30 reward overflows the update, issue 47).
    agent_reward_bound: float = 1e6
    agent_max_calls: int = 1000  # model calls one episode may make; past it a 429 and the sample is an error
    # Another Python interpreter for task.agent (e.g. /path/to/venv/bin/python): agent code whose
    # packages conflict with ours runs in a virtual environment of its own (its episodes import
    # only the standard library of ours); "" = this interpreter
    agent_python: str = ""
    # The agent server's address. Loopback (the default) serves this machine's processes only; any
    # other address (0.0.0.0: every interface) lets whoever reaches it call the policy being trained
    # with an episode's key (keys are unguessable, 192 random bits, and die with their episode).
    agent_host: str = "127.0.0.1"
    agent_port: int = 0  # 0 = a free port
    # What else an agent episode may reach: "host:port" or URLs (an OpenEnv environment's server:
    # task.env=openenv:... adds its own). Episodes run sandboxed with a network of their own: the
    # agent server and these are all they reach (reward/agents/pool.py)
    agent_endpoints: list[str] = field(default_factory=list)
    # A difficulty curriculum (rl/data/curriculum.py): a prompt whose group was all solved (every
    # reward >= curriculum_pass_reward) or all failed rests for this many epochs of the prompt
    # stream, the next prompts drawn instead; 0 = off. Logged: curriculum/skipped_frac, resting_rows
    curriculum_epochs: int = 0
    curriculum_pass_reward: float = 1.0


@dataclass
class EvalConfig:
    """Evaluation on held-out rows during training (rl/run/evaluate.py): greedy and sampled."""

    every_steps: int = 0  # 0 = never; else before the first update and every N steps
    files: list[str] = field(default_factory=list)  # JSONL/Parquet rows like task.train_files
    n: int = 4  # sampled completions (episodes) per row, for pass@k, avg@n, maj@k (k = 1, n); 0 = greedy only
    k: list[int] = field(default_factory=list)  # more k for pass@k and maj@k, each at most n
    # maj@k's answer of a completion (rl/run/evaluate.py answer_extractor): final_answer (the
    # last \boxed{}, else the last number: what reward.builtin:math_answer checks); "" = no maj@k
    answer: str = ""
    max_rows: int = 64  # the first rows of eval.files at most
    temperature: float = 1.0  # of the sampled ones (greedy: 0)
    pass_threshold: float = 1.0  # a sample "passes" when its reward is at least this
    # a column of the held-out rows (e.g. reasoning-gym's `dataset`): greedy_pass_frac and
    # greedy_mean_reward are logged per value too, as eval/greedy_pass_frac/<value>; "" = overall only
    group_by: str = ""


@dataclass
class TrainerConfig:
    num_workers: int = 1  # DeepSpeed data-parallel ranks
    zero_stage: int = 2
    # The most sequences (rows of the model's input) one forward or forward-backward pass on one
    # rank takes; the same meaning in launch.train_sft and launch.train_rm (rl/plan/geometry.py).
    # A rank's share of one update is cut into the fewest micro-batches within it, of near-equal
    # rows (gradient accumulation covers the rest); scoring passes take runs of it.
    micro_batch_size: int = 64
    # > 0: micro-batches are cut by padded tokens (rows x longest row) instead of rows, rows sorted
    # by length first, so variable-length batches do not pay for padding (still at most
    # micro_batch_size rows each)
    max_tokens_per_micro_batch: int = 0
    # steps in a row whose every update the learner skipped (non-finite gradients, DeepSpeed's
    # overflow skip) before the run stops naming the cause (rl/run/faults.py NotLearning)
    max_skipped_steps: int = 3
    # each micro-batch's rows packed end to end into rows of its longest one (trainer/packing.py):
    # the layers see no padding; used only if the model gives packed rows their padded values
    padding_free: bool = True
    # the rows of a group (one prompt, n completions; episodes with common first turns) computed
    # as one prefix tree, each shared token once (trainer/prefix_tree.py). auto: where the
    # model's FLOPs say the tree costs less than separate rows; on: wherever possible; off
    shared_prefix: str = "auto"
    offload_optimizer: bool = False
    ref_offload: bool = False  # keep the frozen reference model's weights on CPU (ZeRO-3 param offload)
    zero3_persistence_threshold: int = 0  # DeepSpeed's 1e5 keeps small tensors whole; 0 shards all
    # collective (gloo/NCCL broadcast) | object_store (Ray) | ipc (CUDA IPC on a shared GPU, with
    # cluster.placement_mode=hybrid: vLLM's ipc weight-transfer engine)
    weight_sync: str = "collective"
    # Delta syncs (collective only): each bucket sends the values that changed since the last sync
    # with their positions and a CRC-32 of the whole bucket, checked by the receiver; a bucket whose
    # change exceeds delta_sync_max_fraction of its bytes goes whole, and a refused checksum makes
    # the sync whole. Saves bytes on the wire (bf16 weights change by a few % a step); both ends keep
    # a host copy of the weights (rl/wire/weight_sync.py)
    delta_sync: bool = False
    delta_sync_max_fraction: float = 0.5
    logprob_warn_threshold: float = 0.05  # warn when learner and rollout log-probs differ more


@dataclass
class ClusterConfig:
    address: str | None = None  # None: start a local Ray; "auto" or ray://...: join a cluster
    num_cpus: int | None = None  # logical CPUs of the local Ray (default: enough for all actors)
    threads_per_worker: int = 0  # torch/OMP threads per rollout/learner actor; 0 = the cores shared by the roles computing at once
    gpus_per_rollout_worker: float = 0.0
    gpus_per_learner: float = 0.0
    # How the placement group of the rollout workers and learner ranks (one bundle each) spreads
    # over nodes: pack (as few nodes as possible) | spread | strict_pack (one node) | strict_spread
    placement: str = "pack"
    # disaggregated: rollout workers and learner ranks on GPUs of their own | hybrid: learner rank i
    # and rollout worker i share one GPU (one bundle each pair; the engine sleeps while the
    # learner trains, the learner offloads its states while the engine generates)
    placement_mode: str = "disaggregated"
    peak_tflops: float = 0.0  # per device, for MFU; 0 = the learner measures its matmul peak at start
    price_per_device_hour: float = 0.0  # for the per-step cost metric (cost/step_usd); 0 = not shown
    # Preflight memory plan (rl/plan/memory_plan.py, `python -m launch.plan`): launch.train refuses a run
    # that cannot fit, before Ray starts. memory_gib: RAM of the machine the roles share (0 = detect
    # this one's); gpu_memory_gib: memory of one GPU (0 = detect it with nvidia-smi, else unchecked).
    memory_gib: float = 0.0
    gpu_memory_gib: float = 0.0
    preflight: bool = True  # false: skip the check


@dataclass
class SandboxConfig:
    """Where untrusted programs (code rewards) run: see sandbox/ and docs/code-rewards.md."""

    backend: str = "process"      # process (bubblewrap+cgroups), docker, or unsafe_local (NO isolation)
    num_workers: int = 0          # sandbox Ray actors; 0 = a code reward runs jobs in its own process
    slots_per_worker: int = 2     # jobs one worker runs at once
    num_cpus_per_worker: float = 1.0
    resource: str | None = None   # custom Ray resource a node must advertise, e.g. "benchmark"
    docker_image: str = "rlpost-sandbox:bookworm"
    max_retries: int = 2          # times a dead worker's jobs are sent again (then: sandbox_error)


@dataclass
class RunConfig:
    dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    steps: int = 30
    log_samples_per_step: int = 4
    save_final_model: bool = True
    save_every: int = 20  # checkpoint every N steps (and at the last step); 0 = never
    keep_checkpoints: int = 2
    resume: bool = False  # continue the run in run.dir from its latest checkpoint
    progress: bool = True
    max_restarts: int = 0  # after a fatal actor fault, restart the run from its latest checkpoint up to N times
    call_timeout_s: float = 300.0  # deadline of an actor call at least; past it the actor counts as hung
    call_timeout_factor: float = 10.0  # ...or this many times the slowest earlier call of the same kind
    start_timeout_s: float = 900.0  # deadline of actor start-up (model load, engine and DeepSpeed set-up)
    # metric sinks (rl/run/loggers.py): tensorboard, jsonl (always written), wandb (offline unless
    # WANDB_MODE=online), mlflow (a file store in <run>/mlruns unless mlflow_tracking_uri is set)
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    project: str = "rlpost"  # the wandb project and MLflow experiment
    mlflow_tracking_uri: str = ""


@dataclass
class TrainConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# `configs/train.yaml` starts its defaults list with this schema.
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


class ConfigError(ValueError):
    """A config value that is well-typed but unusable; the message names the field and the fix."""


_CHOICES: dict[str, tuple[Any, ...]] = {
    **ALGORITHM_CHOICES,  # the names rl.algo's registries hold (rl/config/algorithm_names.py)
    "model.dtype": ("float32", "bfloat16"),
    "rollout.backend": ("vllm", "hf"),
    "rollout.mode": ("batch", "streaming"),
    "rollout.inflight_kv": ("keep", "recompute"),
    "trainer.zero_stage": (0, 1, 2, 3),
    "trainer.weight_sync": ("collective", "object_store", "ipc"),
    "eval.answer": ("", "final_answer"),  # rl/run/evaluate.py answer_extractor
    "sandbox.backend": ("process", "docker", "unsafe_local"),
    "cluster.placement": ("pack", "spread", "strict_pack", "strict_spread"),
    "trainer.shared_prefix": ("auto", "on", "off"),
    "rollout.enforce_eager": (True, False, "auto"),
    "cluster.placement_mode": ("disaggregated", "hybrid"),
}

_POSITIVE = (
    "rollout.num_workers",
    "rollout.max_new_tokens",
    "rollout.max_model_len",
    "reward.num_workers",
    "task.prompts_per_step",
    "trainer.num_workers",
    "trainer.micro_batch_size",
    "algorithm.ppo_epochs",
    "algorithm.mini_batches",
    "run.steps",
    "run.keep_checkpoints",
    "sandbox.slots_per_worker",
)

# Numeric ranges a type cannot express: key -> (lowest, lowest allowed?, highest allowed or None, a
# good value to suggest). A value outside (NaN included) is reported with the range and the example.
_RANGES: dict[str, tuple[float, bool, float | None, str]] = {
    "rollout.n": (1, True, None, "8"),
    "rollout.top_p": (0, False, 1, "1.0"),
    "rollout.gpu_memory_utilization": (0, False, 1, "0.5"),
    "rollout.kv_cache_gib": (0, False, None, "1"),
    "rollout.max_restarts": (0, True, None, "3"),
    "trainer.delta_sync_max_fraction": (0, False, 1, "0.5"),
    "rollout.max_retries": (0, True, None, "2"),
    "rollout.tensor_parallel_size": (1, True, None, "1 (or the GPUs one engine spans, e.g. 2)"),
    "rollout.pause_timeout_s": (0, False, None, "300"),
    "task.agent_workers": (1, True, None, "16"),
    "task.agent_timeout_s": (0, False, None, "300"),
    "task.agent_memory_mb": (64, True, None, "2048"),
    "task.agent_max_processes": (1, True, None, "64"),
    "task.agent_reward_bound": (0, False, None, "1e6"),
    "task.agent_max_calls": (1, True, None, "1000"),
    "task.agent_port": (0, True, 65535, "0 (a free port)"),
    "rollout.temperature": (0, False, 2, "1.0"),  # vLLM refuses a temperature above 2
    "eval.temperature": (0, True, 2, "1.0 (0 = greedy)"),
    "reward.timeout_s": (0, False, None, "60"),
    "reward.max_failed_steps": (1, True, None, "3"),
    "reward.bound": (0, False, 1e30, "1e6"),  # within fp32's range (3.4e38), with room for sums
    "trainer.max_skipped_steps": (1, True, None, "3"),
    "sandbox.num_workers": (0, True, None, "0 (jobs run in the reward worker) or 2"),
    "sandbox.num_cpus_per_worker": (0, False, None, "1.0"),
    "sandbox.max_retries": (0, True, None, "2"),
    "cluster.threads_per_worker": (0, True, None, "0 (automatic)"),
    "cluster.gpus_per_rollout_worker": (0, True, None, "0 or 1"),
    "cluster.gpus_per_learner": (0, True, None, "0 or 1"),
    "run.save_every": (0, True, None, "20 (0 = never)"),
    "algorithm.off_policy_steps": (0, True, None, "0 (on-policy) or 1"),
    "algorithm.tis_cap": (1, True, None, "2.0"),
    "algorithm.seq_mask_low": (0, True, 1, "0.5"),
    "algorithm.mis_cap": (1, True, None, "2.0"),
    "algorithm.distill_coef": (0, True, 1, "1.0 (distillation alone) or 0.5"),
    "algorithm.icepop_low": (0, True, 1, "0.5"),
    "algorithm.icepop_high": (1, True, None, "5.0"),
    "algorithm.seq_mask_high": (1, True, None, "2.0"),
    "trainer.max_tokens_per_micro_batch": (0, True, None, "0 (rows) or 8192"),
    "cluster.peak_tflops": (0, True, None, "0 (measure) or 312"),
    "cluster.price_per_device_hour": (0, True, None, "0 or 2.5"),
    "cluster.memory_gib": (0, True, None, "0 (detect) or 24"),  # preflight plan
    "cluster.gpu_memory_gib": (0, True, None, "0 (detect) or 80"),  # preflight plan
    "run.log_samples_per_step": (0, True, None, "4"),
    "run.max_restarts": (0, True, None, "0"),
    "run.call_timeout_s": (0, False, None, "300"),
    "run.call_timeout_factor": (1, True, None, "10"),
    "run.start_timeout_s": (0, False, None, "900"),
}


def _range_error(key: str, value: Any) -> str | None:
    """The message for `value` of `key` outside its `_RANGES` entry, else None."""
    low, low_ok, high, example = _RANGES[key]
    inside = (value >= low if low_ok else value > low) and (high is None or value <= high)
    if inside:
        return None
    if high is not None:
        bounds = f"in {'[' if low_ok else '('}{low}, {high}]"
    else:
        bounds = f"{'>=' if low_ok else '>'} {low}"
    return f"{key}={value}: must be {bounds}, e.g. {key}={example}"


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    import dataclasses
    import typing

    from omegaconf import DictConfig, ListConfig

    hints = typing.get_type_hints(schema)
    found = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        path = f"{prefix}{key}"
        if key not in hints:
            found.append(path)
            continue
        child, kind = node._get_node(key), hints[key]
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if dataclasses.is_dataclass(kind):
            found += unknown_keys(child, kind, path + ".")
        elif item is not None and dataclasses.is_dataclass(item) and isinstance(child, ListConfig):
            for i, element in enumerate(child):
                found += unknown_keys(element, item, f"{path}[{i}].")
    return found


def check_schema(cfg: Any, schema: type = TrainConfig, app: str = "train", where: str = "rl/config/schema.py") -> None:
    """Reject keys the schema does not know, also ones forced in with Hydra's `+key=value`."""
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; check the spelling against {where} "
            f"(`python -m launch.{app} --cfg job` prints every key)"
        )


def raise_errors(errors: list[str]) -> None:
    """One ConfigError listing every bad field with its fix (nothing when the list is empty)."""
    if errors:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(errors))


def _placement_mode_errors(cfg: Any) -> list[str]:
    """What hybrid placement (a learner rank and a rollout worker on each GPU) and the CUDA IPC
    weight sync it enables need."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    errors = []
    if t.delta_sync and t.weight_sync != "collective":
        errors.append(f"trainer.delta_sync sends changes over the collective weight sync; trainer.weight_sync="
                      f"{t.weight_sync} sends whole weights: set trainer.weight_sync=collective or trainer.delta_sync=false")
    if t.weight_sync == "ipc" and c.placement_mode != "hybrid":
        errors.append("trainer.weight_sync=ipc shares GPU memory between a learner rank and the rollout worker on "
                      "its GPU: set cluster.placement_mode=hybrid, or use trainer.weight_sync=collective")
    if c.placement_mode != "hybrid":
        return errors
    tp = r.tensor_parallel_size
    if r.num_workers * tp != t.num_workers:
        errors.append(f"cluster.placement_mode=hybrid pairs each learner rank with a rollout engine on its GPU: "
                      f"rollout.num_workers={r.num_workers} must equal trainer.num_workers={t.num_workers}"
                      + (f" / rollout.tensor_parallel_size={tp}" if tp > 1 else ""))
    if tp > 1:
        errors.append(f"rollout.tensor_parallel_size={tp} with cluster.placement_mode=hybrid is not supported yet: "
                      "use cluster.placement_mode=disaggregated for tensor-parallel rollouts")
    if c.gpus_per_learner != c.gpus_per_rollout_worker or c.gpus_per_learner not in (0, 1):
        errors.append(f"cluster.placement_mode=hybrid: a learner rank and its rollout worker share one GPU, so "
                      f"cluster.gpus_per_learner={c.gpus_per_learner:g} and cluster.gpus_per_rollout_worker="
                      f"{c.gpus_per_rollout_worker:g} must both be 1 (or both 0 on CPUs); Ray gives each half of it")
    if t.zero_stage == 0:
        errors.append("cluster.placement_mode=hybrid moves the learner's states to the host while the engine "
                      "generates, which DeepSpeed does for ZeRO stages 1-3 (offload_states): set trainer.zero_stage=1, "
                      "2 or 3")
    on_gpu = c.gpus_per_learner > 0
    if on_gpu and t.weight_sync == "collective":
        errors.append("trainer.weight_sync=collective cannot join two processes on one GPU (NCCL refuses them) in "
                      "cluster.placement_mode=hybrid: set trainer.weight_sync=ipc")
    if on_gpu and not r.sleep_between_steps:
        errors.append("cluster.placement_mode=hybrid needs rollout.sleep_between_steps=true: the engine frees the "
                      "GPU while its learner rank trains")
    if t.weight_sync == "ipc" and not on_gpu:
        errors.append("trainer.weight_sync=ipc moves weights by CUDA IPC: it needs cluster.gpus_per_learner=1 and "
                      "cluster.gpus_per_rollout_worker=1 (on CPUs use trainer.weight_sync=collective)")
    if t.weight_sync == "ipc" and cfg.model.lora.rank > 0:
        errors.append("trainer.weight_sync=ipc sends full weights, not LoRA adapters: set trainer.weight_sync="
                      "object_store with model.lora")
    if t.weight_sync == "ipc" and r.backend != "vllm":
        errors.append(f"trainer.weight_sync=ipc loads through vLLM's weight-transfer engine: rollout.backend="
                      f"{r.backend} cannot take it, use rollout.backend=vllm")
    return errors


def _shared_gpu_errors(cfg: Any) -> list[str]:
    """Disaggregated roles given a share of a GPU: Ray packs such shares from any actors onto one
    device, so a learner rank and an engine, or two learner ranks (NCCL refuses two members of one
    group on a device), or two engines (each asks vLLM for `gpu_memory_utilization` of the whole
    card) may land together."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    if c.placement_mode != "disaggregated":
        return []
    errors = []
    if 0 < c.gpus_per_learner < 1 and 0 < c.gpus_per_rollout_worker < 1 and t.weight_sync == "collective":
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g} and cluster.gpus_per_rollout_worker="
                      f"{c.gpus_per_rollout_worker:g} put a learner and a rollout worker on one GPU, where NCCL "
                      "refuses two members of the weight-sync group: set trainer.weight_sync=object_store, "
                      "or give each a whole GPU")
    if 0 < c.gpus_per_learner < 1 and t.num_workers > 1:
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g} with trainer.num_workers={t.num_workers}: "
                      "Ray may put two learner ranks on one GPU, where NCCL refuses two ranks of one group; set "
                      "cluster.gpus_per_learner=1")
    per_gpu = min(r.num_workers, math.floor(1 / c.gpus_per_rollout_worker + 1e-9)) \
        if 0 < c.gpus_per_rollout_worker < 1 else 1
    if per_gpu > 1 and t.weight_sync == "collective":
        errors.append(f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} with rollout.num_workers="
                      f"{r.num_workers}: Ray may put two rollout workers on one GPU, where NCCL refuses two members "
                      "of the weight-sync group; set cluster.gpus_per_rollout_worker=1, or "
                      "trainer.weight_sync=object_store")
    if per_gpu > 1 and per_gpu * r.gpu_memory_utilization > 0.95:  # the rest: each process's CUDA context
        errors.append(f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} with rollout.num_workers="
                      f"{r.num_workers} puts up to {per_gpu} engines on one GPU, each taking rollout."
                      f"gpu_memory_utilization={r.gpu_memory_utilization:g} of it; set rollout.gpu_memory_utilization"
                      f"={math.floor(95 / per_gpu) / 100:g} or cluster.gpus_per_rollout_worker=1")
    return errors


def _tensor_parallel_errors(cfg: Any) -> list[str]:
    """A tensor-parallel engine holds one whole GPU per TP rank (vLLM's workers, one per rank, in
    the rollout actor's bundle); one GPU or a share of one is an engine without tensor parallelism."""
    r, gpus = cfg.rollout, cfg.cluster.gpus_per_rollout_worker
    tp = r.tensor_parallel_size
    if tp < 1:  # reported by the range check
        return []
    errors = []
    if (gpus > 1 or tp > 1) and gpus not in (0, tp):
        fix = (f"set cluster.gpus_per_rollout_worker={tp} (or 0 on CPUs)" if tp > 1 else
               "set cluster.gpus_per_rollout_worker=1 and raise rollout.num_workers to use more GPUs"
               + (f", or rollout.tensor_parallel_size={gpus:g} for one engine over {gpus:g} GPUs"
                  if gpus == int(gpus) else ""))
        errors.append(f"cluster.gpus_per_rollout_worker={gpus:g} with rollout.tensor_parallel_size={tp}: a rollout "
                      f"engine holds one whole GPU per tensor-parallel rank; {fix}")
    if tp > 1 and r.backend != "vllm":
        errors.append(f"rollout.tensor_parallel_size={tp} needs rollout.backend=vllm (rollout.backend={r.backend} "
                      "generates on one device): set rollout.backend=vllm or rollout.tensor_parallel_size=1")
    return errors


def _streaming_errors(cfg: Any) -> list[str]:
    """What `rollout.mode=streaming` needs: vLLM's AsyncLLM, engines that keep generating while the
    learner trains (never asleep) and a staleness bound that lets them run ahead."""
    r, a = cfg.rollout, cfg.algorithm
    if r.mode != "streaming":
        return []
    errors = []
    if r.backend != "vllm":
        errors.append(f"rollout.mode=streaming runs vLLM's AsyncLLM: set rollout.backend=vllm (not {r.backend!r}) "
                      "or rollout.mode=batch")
    if a.off_policy_steps < 1:
        errors.append("rollout.mode=streaming generates while the learner trains, so samples are up to "
                      "algorithm.off_policy_steps versions old (counted at their oldest token): set "
                      "algorithm.off_policy_steps=1 (or more)")
    if r.sleep_between_steps:
        errors.append("rollout.mode=streaming keeps the engines generating while the learner trains: they cannot "
                      "sleep; set rollout.sleep_between_steps=false (and cluster.placement_mode=disaggregated)")
    if cfg.trainer.weight_sync == "ipc":
        errors.append("rollout.mode=streaming loads weights through its engines' worker RPC: set "
                      "trainer.weight_sync=collective (or object_store)")
    return errors


def _task_rows_errors(t: Any) -> list[str]:
    """The task's own row settings (reasoning-gym's dataset names and configs are checked by
    launch.checks, which imports it); a system prompt needs the chat template it goes through."""
    errors = []
    if t.system_prompt and not t.chat_template:
        errors.append("task.system_prompt is set but task.chat_template=false: a system prompt is a chat message; "
                      "set task.chat_template=true, or put the instruction in the prompts")
    if t.datasets:
        if t.size < 1:
            errors.append(f"task.size={t.size}: task.datasets needs at least 1 training row, e.g. task.size=1000")
        if t.eval_size < 0:
            errors.append(f"task.eval_size={t.eval_size}: must be >= 0 (0 = no held-out rows)")
    return errors


def plain_dict(node: Any) -> dict[str, Any]:
    """A config mapping (a DictConfig, or a dict in the typed config) as plain Python values all the
    way down: what user code gets, and what another interpreter can unpickle without omegaconf."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return copy.deepcopy(dict(node or {}))


OPENENV_AGENT = "reward.agents.openenv:episode"
OPENENV_GENERIC_CLIENT = "openenv.core.generic_client:GenericEnvClient"  # openenv-core's dict-in, dict-out client


def expand_openenv(cfg: Any) -> None:
    """`task.env=openenv:<EnvClient class or server URL>`: an OpenEnv environment, whose server runs
    outside the trainer, so its episodes are agent episodes of reward/agents/openenv.py; task.agent
    and task.agent_kwargs are filled in from it (with task.env_kwargs and task.max_turns). A URL
    alone plays through openenv-core's GenericEnvClient, actions and observations as dicts."""
    env = cfg.task.env
    if not (isinstance(env, str) and env.startswith("openenv:")):
        return
    target = env[len("openenv:"):].strip()
    if cfg.task.agent:
        raise ConfigError(f"task.env={env!r} plays its episodes as task.agent={OPENENV_AGENT}, and task.agent="
                          f"{cfg.task.agent!r} is set too: set task.agent=null")
    kwargs = {"max_turns": cfg.task.max_turns, **plain_dict(cfg.task.agent_kwargs), **plain_dict(cfg.task.env_kwargs)}
    if target.startswith(("http://", "https://")):
        kwargs["server_url"] = target
        kwargs.setdefault("client", OPENENV_GENERIC_CLIENT)
    elif ":" in target:
        kwargs["client"] = target
        if not kwargs.get("server_url"):
            raise ConfigError(f"task.env={env!r} needs its server's address: task.env_kwargs.server_url=http://HOST:PORT "
                              "(or task.env=openenv:http://HOST:PORT with openenv-core's generic client)")
    else:
        raise ConfigError(f"task.env={env!r}: expected openenv:package.module:EnvClientClass or openenv:http://HOST:PORT")
    cfg.task.agent, cfg.task.env = OPENENV_AGENT, None
    cfg.task.agent_kwargs, cfg.task.env_kwargs = kwargs, {}
    if kwargs.get("server_url") and kwargs["server_url"] not in cfg.task.agent_endpoints:  # episodes reach it
        cfg.task.agent_endpoints = [*cfg.task.agent_endpoints, kwargs["server_url"]]


def endpoint_address(text: str) -> tuple[str, int]:
    """("host", port) of a task.agent_endpoints entry ("host:port" or a URL); ValueError naming the
    fix when it has no host or no port (a URL's default port is taken: 80, 443)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text if "//" in text else f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    port = port or {"http": 80, "https": 443}.get(parts.scheme)
    if port is None or not host:
        raise ValueError(f"{text!r} has no host or no port: write host:port or http://host:port")
    return host, port


def validate(cfg: Any) -> None:
    """Raise ConfigError listing every bad field of a merged TrainConfig, with the fix (after
    expanding `task.env=openenv:...`, the one shorthand a config may hold)."""
    expand_openenv(cfg)
    check_schema(cfg)
    errors: list[str] = []
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            errors.append(f"{key}={_get(cfg, key)!r}: choose one of {', '.join(map(str, choices))}")
    for i, text in enumerate(cfg.task.agent_endpoints):
        try:
            endpoint_address(str(text))
        except ValueError as err:
            errors.append(f"task.agent_endpoints[{i}]={text!r}: {err}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            errors.append(f"{key}={_get(cfg, key)}: must be a positive integer")
    errors += filter(None, (_range_error(key, _get(cfg, key)) for key in _RANGES))
    if cfg.cluster.num_cpus is not None and cfg.cluster.num_cpus <= 0:
        errors.append(f"cluster.num_cpus={cfg.cluster.num_cpus}: must be > 0, or null to count the actors")
    if 0 < cfg.rollout.max_model_len <= cfg.rollout.max_new_tokens:
        errors.append(
            f"rollout.max_model_len={cfg.rollout.max_model_len} leaves no room for a prompt before "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise rollout.max_model_len or lower "
            "rollout.max_new_tokens"
        )
    if 1 <= cfg.rollout.n < 2 and advantage_needs(cfg.algorithm.advantage, "group_ids"):
        errors.append(
            f"rollout.n={cfg.rollout.n}: group-relative advantages ({cfg.algorithm.advantage}) need at least 2 "
            "samples per prompt; set rollout.n=8 (or another value >= 2)"
        )
    c = cfg.cluster
    if c.gpus_per_learner > 1:
        errors.append(f"cluster.gpus_per_learner={c.gpus_per_learner:g}: at most 1; a learner rank computes on one "
                      "GPU: raise trainer.num_workers to use more")
    errors += _tensor_parallel_errors(cfg)
    errors += _streaming_errors(cfg)
    errors += _agent_errors(cfg)
    errors += _task_rows_errors(cfg.task)
    errors += _placement_mode_errors(cfg)
    errors += _shared_gpu_errors(cfg)
    if cfg.algorithm.lr <= 0:
        errors.append(f"algorithm.lr={cfg.algorithm.lr}: must be > 0, e.g. algorithm.lr=1e-5")
    if cfg.algorithm.kl_coef < 0:
        errors.append(f"algorithm.kl_coef={cfg.algorithm.kl_coef}: must be >= 0 (0 disables the reference model)")
    if cfg.algorithm.router_aux_loss_coef < 0:
        errors.append(f"algorithm.router_aux_loss_coef={cfg.algorithm.router_aux_loss_coef}: must be >= 0 (0 = no "
                      "load-balancing loss), e.g. 0.001")
    batch = cfg.task.prompts_per_step * cfg.rollout.n
    per_update = cfg.algorithm.mini_batches * cfg.trainer.num_workers
    if cfg.algorithm.mini_batches > 0 and cfg.trainer.num_workers > 0 and batch % per_update:
        errors.append(
            f"task.prompts_per_step*rollout.n={batch} samples per step do not split evenly into "
            f"algorithm.mini_batches={cfg.algorithm.mini_batches} x trainer.num_workers="
            f"{cfg.trainer.num_workers}; change one of them so the product divides {batch}"
        )
    a = cfg.algorithm
    if advantage_needs(a.advantage, "values") and not a.critic:
        errors.append(f"algorithm.advantage={a.advantage} needs a value model: set algorithm.critic=true "
                      "(or use algorithm=ppo)")
    if a.critic and not advantage_needs(a.advantage, "values"):
        users = advantages_needing("values")
        errors.append(f"algorithm.critic=true is only used by advantage={' or '.join(users)}, not "
                      f"{a.advantage!r}; set algorithm.critic=false or algorithm.advantage={users[0]}")
    if a.dynamic_sampling and not advantage_needs(a.advantage, "group_ids"):
        errors.append("algorithm.dynamic_sampling needs group-relative advantages "
                      f"({' or '.join(advantages_needing('group_ids'))})")
    if a.kl_in_reward and a.kl_coef <= 0:
        errors.append("algorithm.kl_in_reward=true needs algorithm.kl_coef > 0")
    if a.policy_loss == "ppo_dual_clip" and a.clip_ratio_c <= 1:
        errors.append(f"algorithm.clip_ratio_c={a.clip_ratio_c}: dual clip needs a value > 1, e.g. 3.0")
    if not 0 <= a.overlong_buffer < cfg.rollout.max_new_tokens:
        errors.append(f"algorithm.overlong_buffer={a.overlong_buffer}: must be in [0, rollout.max_new_tokens="
                      f"{cfg.rollout.max_new_tokens})")
    if a.kl_ctrl == "adaptive" and not (a.kl_target > 0 and a.kl_horizon > 0):
        errors.append(f"algorithm.kl_ctrl=adaptive needs algorithm.kl_target > 0 and algorithm.kl_horizon > 0 "
                      f"(got {a.kl_target}, {a.kl_horizon}), e.g. kl_target=0.01 kl_horizon=10000")
    if a.off_policy_steps > 0 and cfg.rollout.sleep_between_steps:
        errors.append(f"algorithm.off_policy_steps={a.off_policy_steps} generates while the learner trains, "
                      "so the rollout engines cannot sleep then: set rollout.sleep_between_steps=false "
                      "or algorithm.off_policy_steps=0")
    if a.max_sampling_rounds < 1:
        errors.append(f"algorithm.max_sampling_rounds={a.max_sampling_rounds}: must be at least 1")
    if not cfg.reward.functions and not cfg.task.env and not cfg.task.agent:
        errors.append("reward.functions is empty: name at least one, e.g. reward=arith or "
                      "'reward.functions=[{fn: my_rewards.py:score}]' (or an environment that rewards: task.env, "
                      "or an agent that returns its reward: task.agent)")
    errors += _episode_errors(cfg)
    errors += _lora_errors(cfg)
    errors += logger_errors(cfg.run.loggers)
    for i, fn in enumerate(cfg.reward.functions):
        if ":" not in fn.fn:
            errors.append(
                f"reward.functions[{i}].fn={fn.fn!r}: expected 'package.module:function' or "
                "'path/to/file.py:function'"
            )
    raise_errors(errors)


def _agent_errors(cfg: Any) -> list[str]:
    """What `task.agent` needs: one kind of episode, and engines that take calls as they come."""
    t, r = cfg.task, cfg.rollout
    if not t.agent:
        return [f"task.agent_python={t.agent_python!r} runs task.agent, which is not set: set task.agent, or "
                "task.agent_python=''"] if t.agent_python else []
    errors = []
    if ":" not in t.agent:
        errors.append(f"task.agent={t.agent!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    if t.env:
        errors.append(f"task.env={t.env!r} and task.agent={t.agent!r}: an episode comes from one of them; set the "
                      "other to null")
    if r.backend != "vllm":
        errors.append(f"task.agent serves the agents' calls as they come, which vLLM's AsyncLLM batches: set "
                      f"rollout.backend=vllm (not {r.backend!r})")
    if r.sleep_between_steps:
        errors.append("task.agent keeps the engines serving calls (they never sleep): set "
                      "rollout.sleep_between_steps=false")
    if not t.agent_host.strip():
        errors.append("task.agent_host is empty: use 127.0.0.1 (this machine only) or an address of this machine")
    if t.agent_python and not (os.path.isfile(t.agent_python) and os.access(t.agent_python, os.X_OK)):
        errors.append(f"task.agent_python={t.agent_python!r} is not an executable file: name a Python interpreter, "
                      "e.g. /path/to/venv/bin/python (python -m venv /path/to/venv makes one)")
    return errors


def _lora_errors(cfg: Any) -> list[str]:
    lora = cfg.model.lora
    if lora.rank == 0:
        return []
    errors = []
    if lora.rank < 0:
        errors.append(f"model.lora.rank={lora.rank}: must be >= 0 (0 = full fine-tuning), e.g. model.lora.rank=8")
    if lora.alpha <= 0:
        errors.append(f"model.lora.alpha={lora.alpha}: must be > 0, e.g. model.lora.alpha=16")
    if not 0 <= lora.dropout < 1:
        errors.append(f"model.lora.dropout={lora.dropout}: must be in [0, 1), e.g. model.lora.dropout=0.0")
    if not lora.target_modules:
        errors.append("model.lora.target_modules is empty: name the linear layers to adapt, e.g. "
                      "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    return errors


def _episode_errors(cfg: Any) -> list[str]:
    """Checks of the multi-turn (`task.env`) and evaluation keys."""
    t, e, errors = cfg.task, cfg.eval, []
    if t.env is not None and ":" not in t.env:
        errors.append(f"task.env={t.env!r}: expected 'package.module:Class' or 'path/to/file.py:Class'")
    for key, value in (("task.max_turns", t.max_turns), ("task.env_workers", t.env_workers),
                       ("task.max_observation_tokens", t.max_observation_tokens), ("eval.max_rows", e.max_rows)):
        if value < 1:
            errors.append(f"{key}={value}: must be a positive integer")
    if not t.env_timeout_s > 0:
        errors.append(f"task.env_timeout_s={t.env_timeout_s}: must be > 0 seconds, e.g. 60")
    if t.max_episode_tokens < 0:
        errors.append(f"task.max_episode_tokens={t.max_episode_tokens}: must be >= 0 (0 = up to rollout.max_model_len)")
    if t.observation_role not in ("tool", "user"):
        errors.append(f"task.observation_role={t.observation_role!r}: choose tool or user")
    if t.env and cfg.algorithm.overlong_buffer > 0:
        errors.append("algorithm.overlong_buffer penalises single completions near rollout.max_new_tokens; an "
                      "episode's length is limited by task.max_episode_tokens instead: set algorithm.overlong_buffer=0")
    if e.every_steps < 0:
        errors.append(f"eval.every_steps={e.every_steps}: must be >= 0 (0 = no evaluation)")
    if e.every_steps > 0 and not e.files and not (cfg.task.datasets and cfg.task.eval_size > 0):
        errors.append(f"eval.every_steps={e.every_steps} needs held-out rows: set eval.files=[path/to/test.jsonl] "
                      "(or eval.every_steps=0)")
    if e.n < 0:
        errors.append(f"eval.n={e.n}: must be >= 0 (0 = greedy answers only, no sampled ones)")
    a = cfg.algorithm
    if a.distill_coef > 0 and not a.teacher_path:
        errors.append(f"algorithm.distill_coef={a.distill_coef} distils from a teacher: set algorithm.teacher_path="
                      "<model folder or Hub id> (a model with the student's tokenizer)")
    if a.teacher_path and a.distill_coef <= 0:
        errors.append(f"algorithm.teacher_path={a.teacher_path!r} loads a teacher that algorithm.distill_coef=0 "
                      "never uses: set algorithm.distill_coef (1.0: distillation alone) or drop the teacher")
    if t.curriculum_epochs < 0:
        errors.append(f"task.curriculum_epochs={t.curriculum_epochs}: must be >= 0 (0 = no curriculum)")
    if t.curriculum_epochs > 0 and cfg.rollout.mode == "streaming":
        errors.append("task.curriculum_epochs sets prompts aside by their scored groups, which rollout.mode=streaming "
                      "draws ahead of: use rollout.mode=batch (algorithm.off_policy_steps works with it) or "
                      "task.curriculum_epochs=0")
    for k in e.k:
        if not 1 <= k <= max(e.n, 0):
            errors.append(f"eval.k={list(e.k)}: pass@{k} and maj@{k} need {k} sampled completions per row, and "
                          f"eval.n={e.n} samples {e.n}: set eval.n >= {k} or leave {k} out of eval.k")
    return errors
