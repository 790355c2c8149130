"""Bad inputs: each ends with one `error: ...` line naming the field (and the file and line where
there is one) and the fix, exit code 2, no traceback, before Ray starts. Each case breaks one
thing of the valid built-in tiny model and data.

Every case runs the command line's checks in this process (`launch.checks.check_inputs`, then
`launch.cli.fail`, as `main` does); one case of each kind of check also runs through the real
command line, in its own process, and imports none of Ray, vLLM or DeepSpeed."""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

RAY_STARTED = "Started a local Ray instance"  # what ray.init prints when it starts one


def _lines(tiny: str, n: int = 6) -> list[str]:
    with open(f"{tiny}/data/train.jsonl") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def _data(tmp: Path, text: str, name: str = "train.jsonl") -> str:
    path = tmp / name
    path.write_text(text)
    return f"task.train_files=[{path}]"


def _line(number: int, text: str) -> Callable[[str, Path], list[str]]:
    """A data file whose line `number` (from 1) is `text`, the other lines valid."""

    def setup(tiny: str, tmp: Path) -> list[str]:
        lines = _lines(tiny)
        lines[number - 1] = text
        return [_data(tmp, "\n".join(lines) + "\n")]

    return setup


def _model_without(*names: str) -> Callable[[str, Path], list[str]]:
    """A copy of the tiny model folder without the files `names` (a glob each)."""

    def setup(tiny: str, tmp: Path) -> list[str]:
        model = tmp / "model"
        shutil.copytree(f"{tiny}/model", model)
        for pattern in names:
            for path in model.glob(pattern):
                path.unlink()
        return [f"model.path={model}"]

    return setup


def _overrides(*overrides: str) -> Callable[[str, Path], list[str]]:
    return lambda tiny, tmp: list(overrides)


def _agent(source: str, *overrides: str) -> Callable[[str, Path], list[str]]:
    """`task.agent` naming `solve` in a file holding `source`."""

    def setup(tiny: str, tmp: Path) -> list[str]:
        (tmp / "my_agent.py").write_text(source + "\n")
        return [f"task.agent={tmp}/my_agent.py:solve", "reward.functions=[]", *overrides]

    return setup


def _gguf(folder: bool) -> Callable[[str, Path], list[str]]:
    """model.path naming a GGUF checkpoint: the file itself, or a folder holding only it."""

    def setup(tiny: str, tmp: Path) -> list[str]:
        (tmp / "smol").mkdir()
        (tmp / "smol" / "model.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
        return [f"model.path={tmp / 'smol' if folder else tmp / 'smol' / 'model.Q4_1.gguf'}"]

    return setup


# A chat template that knows user and assistant turns only (as some models' templates do).
TWO_ROLE_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                     "{{ raise_exception('role ' ~ m['role'] ~ ' is not supported') }}{% endif %}"
                     "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


def _two_role_chat_model(tiny: str, tmp: Path) -> list[str]:
    """The tiny model with TWO_ROLE_TEMPLATE, running the calculator environment (tool observations)."""
    model = tmp / "model"
    shutil.copytree(f"{tiny}/model", model)
    (model / "chat_template.jinja").write_text(TWO_ROLE_TEMPLATE)
    return [f"model.path={model}", "task.chat_template=true", "task.env=examples.calculator:Calculator",
            "reward.functions=[]", "task.observation_role=tool"]


def _architecture(name: str) -> Callable[[str, Path], list[str]]:
    """The tiny model with config.json naming architecture `name`."""

    def setup(tiny: str, tmp: Path) -> list[str]:
        import json

        model = tmp / "model"
        shutil.copytree(f"{tiny}/model", model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": [name]}))
        return [f"model.path={model}"]

    return setup


def _tokens_past_the_embedding(tiny: str, tmp: Path) -> list[str]:
    """Tokens added to the tiny model's tokenizer beyond its embedding rows (never resized), and
    a data row that uses the last of them."""
    import json

    from transformers import AutoTokenizer

    model = tmp / "model"
    shutil.copytree(f"{tiny}/model", model)
    tok = AutoTokenizer.from_pretrained(model)
    rows = json.loads((model / "config.json").read_text())["vocab_size"]
    added = [f"<x{i}>" for i in range(rows - len(tok) + 2)]  # the last one's id is past the embedding
    tok.add_special_tokens({"additional_special_tokens": added})
    tok.save_pretrained(model)
    lines = _lines(tiny)
    lines[2] = json.dumps({"prompt": f"1+2{added[-1]}=", "answer": "3"})
    return [f"model.path={model}", _data(tmp, "\n".join(lines) + "\n")]


# id -> (what the case sets up: overrides, given the tiny task dir and a temp dir; text the error names)
CASES: dict[str, tuple[Callable[[str, Path], list[str]], list[str]]] = {
    "prompt_empty_in_row_4": (_line(4, '{"prompt": "", "answer": "3"}'),
                              ["task.prompt_key='prompt'", "train.jsonl line 4", "empty string"]),
    "prompt_is_a_number": (_line(3, '{"prompt": 17, "answer": "3"}'),
                           ["task.prompt_key='prompt'", "train.jsonl line 3", "17 (a number), not a string"]),
    "prompt_null_in_last_row": (_line(6, '{"prompt": null, "answer": "3"}'),
                                ["task.prompt_key='prompt'", "train.jsonl line 6", "no value"]),
    "prompt_column_missing_in_a_row": (_line(5, '{"question": "1+2=", "answer": "3"}'),
                                       ["task.prompt_key='prompt'", "train.jsonl line 5", "no 'prompt' column"]),
    "malformed_line_3": (_line(3, '{"prompt": "1+2=", "answer": '),
                         ["task.train_files", "train.jsonl line 3 is not valid JSON"]),
    "line_not_an_object": (_line(2, '["1+2=", "3"]'), ["task.train_files", "train.jsonl line 2 is a list"]),
    "empty_file": (lambda tiny, tmp: [_data(tmp, "", "empty.jsonl")], ["task.train_files", "empty.jsonl is empty"]),
    "blank_lines_only": (lambda tiny, tmp: [_data(tmp, "\n\n", "blank.jsonl")],
                         ["task.train_files", "blank.jsonl holds no rows"]),
    "data_file_missing": (lambda tiny, tmp: [f"task.train_files=[{tmp}/nope.jsonl]"],
                          ["task.train_files", "nope.jsonl does not exist"]),
    "model_without_config_json": (_model_without("config.json"), ["model.path=", "has no config.json"]),
    "model_without_tokenizer": (_model_without("tokenizer*"), ["model.path=", "tokenizer does not load"]),
    "architecture_vllm_does_not_serve": (_architecture("XGLMForCausalLM"),
                                         ["model.path=", "XGLMForCausalLM", "architectures in", "rollout.backend=hf"]),
    "architecture_nobody_knows": (_architecture("NoSuchForCausalLM"),
                                  ["model.path=", "NoSuchForCausalLM", "transformers has no class"]),
    "prompt_token_past_the_embedding": (_tokens_past_the_embedding,
                                        ["task.train_files", "row 2", "embedding has", "resize_token_embeddings"]),
    "max_model_len_above_position_limit": (_overrides("rollout.max_model_len=128"),
                                           ["rollout.max_model_len=128", "max_position_embeddings", "=64 or less"]),
    "prompt_longer_than_the_budget": (_overrides("rollout.max_new_tokens=60"),
                                      ["rollout.max_model_len - rollout.max_new_tokens = 4", "row 0"]),
    "top_p_zero": (_overrides("rollout.top_p=0"), ["rollout.top_p=0.0", "(0, 1]"]),
    "top_p_above_one": (_overrides("rollout.top_p=1.5"), ["rollout.top_p=1.5", "(0, 1]"]),
    "kv_cache_gib_zero": (_overrides("rollout.kv_cache_gib=0"), ["rollout.kv_cache_gib=0", "> 0"]),
    "reward_timeout_zero": (_overrides("reward.timeout_s=0"), ["reward.timeout_s=0.0", "> 0"]),
    "rollout_n_zero_grpo": (_overrides("rollout.n=0"), ["rollout.n=0", ">= 1"]),
    "rollout_n_zero_reinforce_pp": (_overrides("algorithm=reinforce_pp", "rollout.n=0"), ["rollout.n=0", ">= 1"]),
    "ignore_eos_on_hf": (_overrides("rollout.ignore_eos=true", "rollout.backend=hf"),
                         ["rollout.ignore_eos=true", "rollout.backend=vllm"]),
    "ignore_eos_with_agent": (_agent("def solve(base_url, row):\n    return 1.0", "rollout.ignore_eos=true",
                                     "rollout.mode=streaming", "algorithm.off_policy_steps=1"),
                              ["rollout.ignore_eos=true", "task.agent", "rollout.ignore_eos=false"]),
    "save_every_negative": (_overrides("run.save_every=-1"), ["run.save_every=-1", ">= 0"]),
    "call_timeout_factor_below_one": (_overrides("run.call_timeout_factor=0.5"), ["run.call_timeout_factor=0.5"]),
    "env_file_missing": (lambda tiny, tmp: [f"task.env={tmp}/no_env.py:Game", "reward.functions=[]"],
                         ["task.env=", "no_env.py not found"]),
    "agent_file_missing": (lambda tiny, tmp: [f"task.agent={tmp}/no_agent.py:solve", "reward.functions=[]",
                                              "rollout.mode=streaming", "algorithm.off_policy_steps=1"],
                           ["task.agent=", "no_agent.py not found"]),
    "agent_not_callable": (_agent("solve = 3"), ["task.agent=", "'solve' is a int, not callable"]),
    "agent_taking_one_parameter": (_agent("def solve(base_url):\n    return 1.0"),
                                   ["task.agent=", "takes 1 positional parameter(s)", "fn(base_url, row"]),
    "agent_kwargs_it_does_not_take": (_agent("def solve(base_url, row):\n    return 1.0", "+task.agent_kwargs.tries=3"),
                                      ["task.agent=", "task.agent_kwargs", "'tries'"]),
    "agent_on_the_hf_backend": (lambda tiny, tmp: [*_agent("def solve(base_url, row):\n    return 1.0")(tiny, tmp),
                                                   "rollout=hf"],
                                ["task.agent serves the agents' calls", "set rollout.backend=vllm"]),
    "agent_timeout_zero": (_overrides("task.agent_timeout_s=0"), ["task.agent_timeout_s=0.0", "> 0"]),
    "agent_memory_tiny": (_overrides("task.agent_memory_mb=1"), ["task.agent_memory_mb=1", ">= 64"]),
    "agent_port_out_of_range": (_overrides("task.agent_port=70000"), ["task.agent_port=70000", "in [0, 65535]"]),
    "agent_reward_bound_zero": (_overrides("task.agent_reward_bound=0"), ["task.agent_reward_bound=0.0", "> 0"]),
    "max_skipped_steps_zero": (_overrides("trainer.max_skipped_steps=0"), ["trainer.max_skipped_steps=0", ">= 1"]),
    "agent_max_calls_zero": (_overrides("task.agent_max_calls=0"), ["task.agent_max_calls=0", ">= 1"]),
    # rollout settings vLLM itself would refuse inside the worker
    "temperature_above_two": (_overrides("rollout.temperature=3"), ["rollout.temperature=3.0", "in (0, 2]"]),
    "temperature_zero": (_overrides("rollout.temperature=0"), ["rollout.temperature=0.0", "in (0, 2]"]),
    "eval_temperature_above_two": (_overrides("eval.temperature=2.5"), ["eval.temperature=2.5", "in [0, 2]"]),
    "gpu_memory_utilization_zero": (_overrides("rollout.gpu_memory_utilization=0"),
                                    ["rollout.gpu_memory_utilization=0.0", "(0, 1]"]),
    "max_new_tokens_zero": (_overrides("rollout.max_new_tokens=0"), ["rollout.max_new_tokens=0", "positive"]),
    "pause_timeout_zero": (_overrides("rollout.pause_timeout_s=0"), ["rollout.pause_timeout_s=0.0", "> 0"]),
    "max_restarts_negative": (_overrides("rollout.max_restarts=-1"), ["rollout.max_restarts=-1", ">= 0"]),
    "tensor_parallel_not_dividing_heads": (_overrides("rollout.tensor_parallel_size=3"),
                                           ["rollout.tensor_parallel_size=3 does not divide the model's 4 attention "
                                            "heads", "use one of 1, 2, 4"]),
    "eval_without_files": (_overrides("eval.every_steps=5"), ["eval.every_steps=5", "eval.files=["]),
    "chat_template_without_one": (_overrides("task.chat_template=true"),
                                  ["task.chat_template=true", "has no chat template"]),
    "model_path_is_a_gguf_file": (_gguf(folder=False), ["model.path=", "GGUF", "python -m launch.convert_gguf",
                                                        "model.Q4_1-hf"]),
    "model_path_is_a_gguf_folder": (_gguf(folder=True), ["model.path=", "GGUF", "python -m launch.convert_gguf"]),
    "math_answer_without_answer_column": (
        lambda tiny, tmp: [_data(tmp, '{"prompt": "1+2="}\n{"prompt": "3+4="}\n'),
                           "reward.functions=[{fn: reward.builtin:math_answer}]"],
        ["reward.functions[0].fn=reward.builtin:math_answer", "needs the dataset column(s) answer",
         "task.train_files="]),
    "observation_role_not_in_template": (_two_role_chat_model,
                                         ["task.observation_role='tool'", "cannot render", "role tool is not supported"]),
    "run_dir_not_writable": (_overrides("run.dir=/proc/rlpost-run"), ["run.dir=/proc/rlpost-run", "cannot write"]),
    "run_dir_below_a_file": (lambda tiny, tmp: [f"run.dir={tiny}/data/train.jsonl/run"], ["is a file, not a folder"]),
    "gpus_on_a_machine_without_cuda": (_overrides("cluster.gpus_per_learner=1"),
                                       ["cluster.gpus_per_learner=1 x trainer.num_workers=1", "sees no GPU",
                                        "RLPOST_EXTRA=cuda"]),
    "shared_gpu_with_a_collective_sync": (_overrides("cluster.gpus_per_learner=0.5",
                                                     "cluster.gpus_per_rollout_worker=0.5"),
                                          ["cluster.gpus_per_learner=0.5", "NCCL refuses",
                                           "trainer.weight_sync=object_store"]),
    "two_gpus_per_learner_rank": (_overrides("cluster.gpus_per_learner=2"),
                                  ["cluster.gpus_per_learner=2: at most 1", "trainer.num_workers"]),
    "tensor_parallel_size_zero": (_overrides("rollout.tensor_parallel_size=0"),
                                  ["rollout.tensor_parallel_size=0", ">= 1"]),
    "tensor_parallel_with_hf_backend": (_overrides("rollout=hf", "rollout.tensor_parallel_size=2"),
                                        ["rollout.tensor_parallel_size=2 needs rollout.backend=vllm",
                                         "rollout.tensor_parallel_size=1"]),
    "tensor_parallel_on_one_gpu": (_overrides("rollout.tensor_parallel_size=2", "cluster.gpus_per_rollout_worker=1"),
                                   ["cluster.gpus_per_rollout_worker=1 with rollout.tensor_parallel_size=2",
                                    "set cluster.gpus_per_rollout_worker=2"]),
    "two_gpus_per_rollout_engine_without_tp": (_overrides("cluster.gpus_per_rollout_worker=2"),
                                               ["cluster.gpus_per_rollout_worker=2 with rollout.tensor_parallel_size=1",
                                                "or rollout.tensor_parallel_size=2"]),
    "lora_target_not_in_model": (_overrides("model.lora.rank=8", "model.lora.target_modules=[q_proj,qkv]"),
                                 ["model.lora.target_modules=['q_proj', 'qkv']", "qkv not found", "v_proj"]),
    # reasoning-gym's datasets (task=reasoning_gym): checked against the installed package
    "reasoning_gym_unknown_dataset": (_overrides("task=reasoning_gym", "task.datasets=[{name: basic_arithmatic}]"),
                                      ["task.datasets[0].name='basic_arithmatic' is not a reasoning-gym dataset",
                                       "e.g. basic_arithmetic"]),
    "reasoning_gym_unknown_config_key": (_overrides("task=reasoning_gym",
                                                    "task.datasets=[{name: chain_sum, config: {min_term: 2}}]"),
                                         ["task.datasets[0].config has min_term", "its keys: allow_negation"]),
    "reasoning_gym_config_it_refuses": (_overrides("task=reasoning_gym",
                                                   "task.datasets=[{name: chain_sum, config: {max_digits: 0}}]"),
                                        ["task.datasets[0].config={'max_digits': 0}: chain_sum refuses it"]),
    "reasoning_gym_unknown_extractor": (_overrides("task=reasoning_gym", "reward.functions.0.kwargs.extract_answer=xml"),
                                        ["reward.functions[0].kwargs.extract_answer='xml': choose one of tags, "
                                         "final_answer"]),
    "reasoning_gym_no_rows": (_overrides("task=reasoning_gym", "task.size=0"),
                              ["task.size=0: task.datasets needs at least 1 training row"]),
    "system_prompt_without_chat_template": (_overrides("task.system_prompt=Be brief."),
                                            ["task.system_prompt is set but task.chat_template=false"]),
    "eval_group_by_not_a_column": (lambda tiny, tmp: ["eval.every_steps=5", f"eval.files=[{tiny}/data/test.jsonl]",
                                                      "eval.group_by=level"],
                                   ["eval.group_by='level' is not a column of eval.files", "columns: prompt, answer"]),
}


# One case of each kind of check (config, data rows, prompt lengths, host) also runs through the
# real command line: a process of its own, its exit code, stderr and wall time. (The model-folder
# kind goes through it in tests/test_config.py: model.path=/no/such/model.)
COMMAND_LINE_CASES = ["top_p_zero", "prompt_empty_in_row_4", "prompt_longer_than_the_budget",
                      "gpus_on_a_machine_without_cuda"]


def _case_overrides(case: str, tiny_dir: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    setup, expected = CASES[case]
    overrides = [f"model.path={tiny_dir}/model", f"task.train_files=[{tiny_dir}/data/train.jsonl]",
                 f"run.dir={tmp_path}/run", "run.progress=false", *setup(tiny_dir, tmp_path)]
    return overrides, expected


def _check_error(stderr: str, expected: list[str]) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    for text in expected:
        assert text in stderr, f"{text!r} not in {stderr!r}"
    assert "Traceback" not in stderr
    return errors[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_naming_the_field(case, tiny_dir, tmp_path, capsys, monkeypatch):
    import ray

    from launch.cli import INPUT_ERRORS, fail
    from launch.checks import check_inputs
    from rl.config.compose import compose

    def no_ray(*args, **kwargs):
        raise AssertionError("the checks started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    overrides, expected = _case_overrides(case, tiny_dir, tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        try:  # what launch.train's main does with the config Hydra composed
            check_inputs(compose("train", overrides), overrides)
        except INPUT_ERRORS as err:
            fail(err)
    assert exited.value.code == 2
    print(f"{case}: {_check_error(capsys.readouterr().err, expected)}")


# Modules a refused command must never import: they start (or come with) Ray, the engines and the learner.
HEAVY_MODULES = frozenset({"ray", "vllm", "deepspeed"})


def _imported(stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported (its stderr's `import time:` lines)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and not line.endswith("imported package"):
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize("case", COMMAND_LINE_CASES)
def test_bad_input_fails_fast_naming_the_field(case, tiny_dir, tmp_path):
    """The real command line refuses before anything heavy loads: no Ray, vLLM or DeepSpeed is even
    imported (checked from the interpreter's own import log, not a wall-clock bound, which varies
    2x between hosts of one kind); the seconds are printed for the record."""
    overrides, expected = _case_overrides(case, tiny_dir, tmp_path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "launch.train", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    error = _check_error(proc.stderr, expected)
    assert RAY_STARTED not in output
    imported = _imported(proc.stderr)
    assert "hydra" in imported and "launch" in imported, "no import log: the check below would pass vacuously"
    assert not imported & HEAVY_MODULES, f"a refused command imported {sorted(imported & HEAVY_MODULES)}"
    print(f"{case}: {wall:.1f} s wall, {cpu:.1f} s CPU: {error}")


# The supervised entry points share the model and data-file checks.
SUPERVISED_CASES = {
    "sft_model_without_config_json": ("launch.train_sft", _model_without("config.json"),
                                      ["model.path=", "has no config.json"]),
    "rm_model_without_config_json": ("launch.train_rm", _model_without("config.json"),
                                     ["model.path=", "has no config.json"]),
    "sft_malformed_line_2": ("launch.train_sft", _line(2, '{"prompt": "1+2=", "answer": "3"'),
                             ["data.train_files", "train.jsonl line 2 is not valid JSON"]),
    "rm_empty_file": ("launch.train_rm", lambda tiny, tmp: [_data(tmp, "", "empty.jsonl")],
                      ["data.train_files", "empty.jsonl is empty"]),
}


# One case also runs through its real command line (the SFT one's goes through it in
# tests/test_train_sft.py, with a config error).
SUPERVISED_COMMAND_LINE_CASES = ["rm_empty_file"]


def _supervised_overrides(case: str, tiny_dir: str, tmp_path: Path) -> tuple[str, list[str], list[str]]:
    module, setup, expected = SUPERVISED_CASES[case]
    overrides = [o.replace("task.train_files", "data.train_files") for o in setup(tiny_dir, tmp_path)]
    if not any(o.startswith("model.path=") for o in overrides):
        overrides.append(f"model.path={tiny_dir}/model")
    return module, [*overrides, "data.test_files=[]", f"run.dir={tmp_path}/run"], expected


@pytest.mark.parametrize("case", list(SUPERVISED_CASES))
def test_supervised_bad_input_is_refused_naming_the_field(case, tiny_dir, tmp_path, capsys, monkeypatch):
    from launch.cli import INPUT_ERRORS, fail
    from launch.supervised_cli import supervised_main
    from rl.config.compose import compose
    from rl.config.supervised import validate_rm, validate_sft

    module, overrides, expected = _supervised_overrides(case, tiny_dir, tmp_path)
    app = module.removeprefix("launch.")
    validate, train = {"train_sft": (validate_sft, "trainer.sft:train_sft"),
                       "train_rm": (validate_rm, "trainer.reward_model:train_rm")}[app]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        try:  # what the entry point's main does with the config Hydra composed
            cfg = compose(app, overrides)
        except INPUT_ERRORS as err:
            fail(err)
        supervised_main(cfg, validate, train)
    assert exited.value.code == 2
    _check_error(capsys.readouterr().err, expected)


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize("case", SUPERVISED_COMMAND_LINE_CASES)
def test_supervised_bad_input_fails_naming_the_field(case, tiny_dir, tmp_path):
    module, overrides, expected = _supervised_overrides(case, tiny_dir, tmp_path)
    proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _check_error(proc.stderr, expected)


@pytest.mark.parametrize("bad, error, says", [
    (["task.env=nope.py:Env"], "RewardLoadError", "task.env='nope.py:Env'"),
    (["reward.functions=[{fn: nope.py:score}]"], "RewardLoadError", "reward.functions[0].fn='nope.py:score'"),
    (["task.train_files=[{tmp}/train.jsonl]"], "DataError", "train.jsonl line 2"),
])
def test_bad_user_inputs_are_refused_before_a_built_in_model_is_built(bad, error, says, tmp_path, monkeypatch):
    """The calculator task in a launch directory where its tiny model is not built yet (a build of
    ~2 minutes), with one bad input of the user's (an environment, a reward function, a data row):
    refused naming it before anything is built. (`task.env=nope.py:Env` was refused only after the
    build, issue 61.)"""
    import launch.checks
    from rl.config.compose import compose

    built = []
    monkeypatch.setattr(launch.checks, "ensure_builtin", lambda paths, seed=0: built.append(list(paths)) or [])
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+2="}\n{"prompt": ""}\n')
    monkeypatch.chdir(tmp_path)  # a fresh launch directory: no built-in task there
    overrides = ["task=calculator", *(o.replace("{tmp}", str(tmp_path)) for o in bad)]
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        launch.checks.check_inputs(compose("train", overrides), overrides)
    assert type(err.value).__name__ == error and built == []


@pytest.mark.parametrize("app, data, says", [
    ("train_sft", '{"prompt": "1+2=", "completion": "3"}\n', "data.completion_key"),  # its column is "answer"
    ("train_rm", '{"prompt": "1+2=", "chosen": "3"}\n', "data.rejected_key"),
])
def test_supervised_bad_rows_are_refused_before_a_built_in_model_is_built(app, data, says, tmp_path, monkeypatch):
    """launch.train_sft / train_rm on the built-in tiny model, not built yet in this launch
    directory, with the user's own rows missing a column: refused naming the column's field
    before anything is built (a build takes minutes)."""
    import launch.checks
    from rl.config.compose import compose

    built = []
    monkeypatch.setattr(launch.checks, "ensure_builtin", lambda paths, seed=0: built.append(list(paths)) or [])
    (tmp_path / "rows.jsonl").write_text(data)
    monkeypatch.chdir(tmp_path)  # a fresh launch directory: no built-in task there
    cfg = compose(app, [f"data.train_files=[{tmp_path}/rows.jsonl]", "data.test_files=[]", "data.test_fraction=0.5"])
    with pytest.raises(ValueError, match=re.escape(says)):
        launch.checks.supervised_inputs(cfg)
    assert built == []
