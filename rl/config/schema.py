"""Structured config schema: every key a run accepts, with its type and default.

Hydra merges `configs/train.yaml` and its groups into `TrainConfig`, so a misspelled key or a
value of the wrong type fails before anything starts, naming the field. The checks a type cannot
express (ranges, choices, combinations) are `rl/config/validation.py`; a shorthand a config may
hold (`task.env=openenv:...`) is expanded before that, by the code it expands to. This module
holds the data only (with `ConfigError` and `plain_dict`, how user code is handed a mapping of it).
No torch/ray imports here: the CLI must reject bad input in well under a second.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# metric sinks of `run.loggers` (rl/log/loggers.py writes them)
LOGGERS = ("tensorboard", "jsonl", "wandb", "mlflow")


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
    # every single-turn completion runs to max_new_tokens, EOS or not (vLLM's ignore_eos): equal work
    # per step whatever the policy learns, as throughput benchmarks need (bench/bounds.py); not for training
    ignore_eos: bool = False
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
    # "openenv:<EnvClient class or http://server>": an OpenEnv environment, a shorthand expanded before
    # validation into agent episodes of reward/agents/openenv.py (reward/agents/openenv_task.py; env_kwargs theirs)
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
    # overflow skip) before the run stops naming the cause (rl/actors/faults.py NotLearning)
    max_skipped_steps: int = 3
    # each micro-batch's rows packed end to end into rows of its longest one (trainer/packing.py):
    # the layers see no padding; used only if the model gives packed rows their padded values
    padding_free: bool = True
    # the rows of a group (one prompt, n completions; episodes with common first turns) computed
    # as one prefix tree, each shared token once (trainer/prefix_tree.py). auto: where the
    # model's FLOPs say the tree costs less than separate rows; on: wherever possible; off
    shared_prefix: str = "auto"
    offload_optimizer: bool = False
    # a CPU learner's malloc, freed memory kept for the next step (launch/allocator.py): jemalloc
    # (Ray's own copy; glibc where a Ray build has none) or glibc
    cpu_allocator: str = "jemalloc"
    ref_offload: bool = False  # keep the frozen reference model's weights on CPU (ZeRO-3 param offload)
    zero3_persistence_threshold: int = 0  # DeepSpeed's 1e5 keeps small tensors whole; 0 shards all
    # collective (gloo/NCCL broadcast) | object_store (Ray) | ipc (CUDA IPC on a shared GPU, with
    # cluster.placement_mode=hybrid: vLLM's ipc weight-transfer engine)
    weight_sync: str = "collective"
    # Delta syncs (collective only): each bucket sends the values that changed since the last sync
    # with their positions and a CRC-32 of the whole bucket, checked by the receiver; a bucket whose
    # change exceeds delta_sync_max_fraction of its bytes goes whole, and a refused checksum makes
    # the sync whole. Saves bytes on the wire (bf16 weights change by a few % a step); both ends keep
    # a host copy of the weights (rl/wire/delta.py)
    delta_sync: bool = False
    delta_sync_max_fraction: float = 0.5
    logprob_warn_threshold: float = 0.05  # warn when learner and rollout log-probs differ more


@dataclass
class ClusterConfig:
    address: str | None = None  # None: start a local Ray; "auto" or ray://...: join a cluster
    num_cpus: int | None = None  # logical CPUs of the local Ray (default: enough for all actors)
    threads_per_worker: int = 0  # torch/OMP threads per rollout/learner actor; 0 = the cores shared by the roles computing at once
    # CPU priority (nice) of the actors of a local Ray this run starts (with `address` the cluster's
    # own setting holds). Ray's default, 15, lets every process at normal priority (the raylet, the
    # driver, a browser) preempt a training thread at once, and the rest of its OpenMP team waits at
    # the next barrier: SmolLM2's bf16 train phase took 5.67 s a step at 15 vs 4.5-5.1 s at 0.
    worker_niceness: int = 0
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


def local_ray_config(cluster: ClusterConfig) -> dict[str, Any]:
    """Ray's system config for a local Ray that a command starts (`ray.init(_system_config=...)`):
    its actors' CPU priority, `cluster.worker_niceness`."""
    return {"worker_niceness": cluster.worker_niceness}


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
    # metric sinks (rl/log/loggers.py): tensorboard, jsonl (always written), wandb (offline unless
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


def plain_dict(node: Any) -> dict[str, Any]:
    """A config mapping (a DictConfig, or a dict in the typed config) as plain Python values all the
    way down: what user code gets, and what another interpreter can unpickle without omegaconf."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return copy.deepcopy(dict(node or {}))

