"""The built-in calculator task (examples/calculator.py): the safe evaluator, the environment,
the data, the warm-up episodes' token ids, and (slow) the built model's success at temperature 1."""

from __future__ import annotations

import json

import pytest

from examples.calculator import (ERROR_BAD_CALL, ERROR_BAD_EXPRESSION, ERROR_UNKNOWN_TOOL, Calculator, Problem,
                                 calculator_tokenizer, evaluate, sum_splits, write_data)
from rl.data.env import StepResult, as_step_result

CALL_12_34 = '<tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call>'


def env_for(answer: str = "102") -> Calculator:
    env = Calculator()
    env.reset({"prompt": "12+34+56", "answer": answer})
    return env


@pytest.mark.parametrize("expression, value", [
    ("12+34", 46), ("46+56", 102), ("2*3-4", 2), ("2+3*4", 14), ("7-10", -3), (" 1 + 2 ", 3), ("007", 7),
    ("12*10*10", 1200),
])
def test_evaluate(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", [
    "", " ", "1/2", "2**3", "(1+2)", "-3", "1+", "+1", "1++2", "abc", "__import__('os')", "1e3", "1.5+1", "0x10",
    "1" * 65, None, 5, ["1+1"],
])
def test_evaluate_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_step_runs_the_tool_call():
    out = as_step_result(env_for().step(CALL_12_34, [1, 2, 3]))
    assert (out.observation, out.reward, out.done) == ("46", 0.0, False)
    # text around the call and spaces in the JSON do not matter; arguments as a JSON string neither
    text = 'first <tool_call> {"name": "calculator", "arguments": "{\\"expression\\": \\"46+56\\"}"} </tool_call>'
    assert env_for().step(text, []).observation == "102"


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", ERROR_BAD_CALL),
    ('<tool_call>{"arguments":{"expression":"1+2"}}</tool_call>', ERROR_BAD_CALL),
    ('<tool_call>{"name":"search","arguments":{"query":"1+2"}}</tool_call>', ERROR_UNKNOWN_TOOL),
    ('<tool_call>{"name":"calculator","arguments":{"expression":"12/4"}}</tool_call>', ERROR_BAD_EXPRESSION),
    ('<tool_call>{"name":"calculator","arguments":{"expr":"1+2"}}</tool_call>', ERROR_BAD_EXPRESSION),
    ('<tool_call>{"name":"calculator","arguments":{"expression":12}}</tool_call>', ERROR_BAD_EXPRESSION),
])
def test_bad_tool_call_is_an_error_observation(text, error):
    out = as_step_result(env_for().step(text, []))
    assert (out.observation, out.reward, out.done) == (error, 0.0, False)
    assert out.observation.startswith("error: ") and out.info["error"]


@pytest.mark.parametrize("text, reward", [("102", 1.0), (" 102\n", 1.0), ("103", 0.0), ("", 0.0), ("102 102", 0.0),
                                          ("<tool_call>102", 0.0)])
def test_final_answer(text, reward):
    out = env_for().step(text, [])
    assert isinstance(out, StepResult)
    assert (out.observation, out.reward, out.done) == (None, reward, True)


def test_reset_starts_a_new_episode():
    env = env_for("102")
    env.reset({"prompt": "10+10+10", "answer": 30})
    assert env.step("30", []).reward == 1.0 and env.step("102", []).reward == 0.0


def test_data_splits_are_disjoint_and_right(tmp_path):
    train, test = sum_splits(2000, 300, seed=3)
    assert len(train) == 2000 and len(test) == 300
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.prompt for p in train + test}) == 2300
    for p in train + test:
        a, b, c = (int(x) for x in p.prompt.split("+"))
        assert all(10 <= x <= 99 for x in (a, b, c)) and p.answer == str(a + b + c)
    assert sum_splits(50, 10, seed=3) != sum_splits(50, 10, seed=4)
    assert Problem((12, 34, 56)).to_row() == {"prompt": "12+34+56", "answer": "102"}

    paths = write_data(str(tmp_path), seed=1, n_train=100, n_test=20)
    rows = [[json.loads(line) for line in open(path)] for path in paths]
    assert [len(r) for r in rows] == [100, 20]
    assert set(rows[0][0]) == {"prompt", "answer"}
    assert not {r["prompt"] for r in rows[0]} & {r["prompt"] for r in rows[1]}


def test_worked_episode():
    assert Problem((12, 34, 56)).episode() == [
        {"role": "user", "content": "12+34+56"},
        {"role": "assistant", "content": CALL_12_34},
        {"role": "tool", "content": "46"},
        {"role": "assistant",
         "content": '<tool_call>{"name":"calculator","arguments":{"expression":"46+56"}}</tool_call>'},
        {"role": "tool", "content": "102"},
        {"role": "assistant", "content": "102"},
    ]


def test_warm_up_ids_are_what_the_runner_builds():
    """The SFT example of an episode = the chat template of the whole conversation, and also the
    runner's pieces put end to end: prompt ids, each turn's ids, each observation's ids
    (rl.data.episodes.ObservationEncoder); the loss covers the assistant turns (content + <|end|>) only."""
    from rl.data.episodes import ObservationEncoder
    from trainer.sft import IGNORE_INDEX, chat_example

    tok = calculator_tokenizer()
    episode = Problem((12, 34, 56)).episode()
    input_ids, labels = chat_example(tok, episode)
    whole = tok.apply_chat_template(episode, tokenize=True)
    assert input_ids == list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert input_ids.count(tok.bos_token_id) == 1 and input_ids[0] == tok.bos_token_id

    prompt = tok.apply_chat_template(episode[:1], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert tok.convert_ids_to_tokens(prompt) == ["<bos>", "<|user|>", "1", "2", "+", "3", "4", "+", "5", "6",
                                                 "<|end|>", "<|assistant|>"]
    encode = ObservationEncoder(tok, chat=True, role="tool", cap=16)
    turns = [list(tok(m["content"], add_special_tokens=False).input_ids) + [tok.eos_token_id]
             for m in episode if m["role"] == "assistant"]
    assert tok.convert_ids_to_tokens(encode("46")) == ["<|tool|>", "4", "6", "<|end|>", "<|assistant|>"]
    runner = prompt + turns[0] + encode("46") + turns[1] + encode("102") + turns[2]
    mask = [0] * len(prompt) + [1] * len(turns[0]) + [0] * 5 + [1] * len(turns[1]) + [0] * 6 + [1] * len(turns[2])
    assert input_ids == runner
    assert [int(label != IGNORE_INDEX) for label in labels] == mask
    assert [label for label in labels if label != IGNORE_INDEX] == turns[0] + turns[1] + turns[2]
    assert tok.decode(turns[2], skip_special_tokens=True) == "102"
    assert tok.decode(turns[0], skip_special_tokens=True) == CALL_12_34  # the env reads what the model wrote
    assert len(input_ids) < 128


def test_config_composes():
    from rl.config.compose import compose

    cfg = compose("train", ["task=calculator"])
    assert cfg.task.env == "examples.calculator:Calculator" and cfg.task.chat_template is True
    assert cfg.model.path == "artifacts/tiny_calc/model" and list(cfg.reward.functions) == []
    assert list(cfg.eval.files) == ["artifacts/tiny_calc/data/test.jsonl"] and cfg.eval.pass_threshold == 1.0
    assert cfg.rollout.max_model_len <= 256 and cfg.task.max_turns >= 3  # the model's context; 3 turns solve it


@pytest.mark.slow
def test_build_solves_some_episodes(tiny_calc):
    """The built model solves some but not all episodes at T=1 (GRPO's room), the saved model too."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.calculator import sample_episodes

    out, summary = tiny_calc
    tmp_path = Path(out)
    assert 0.1 < summary["sampled_success_t1"] < 0.8, summary
    assert summary["sampled_answered_t1"] > 0.9 and summary["sampled_tool_calls_t1"] > 1.0, summary
    assert summary["greedy_success"] > summary["sampled_success_t1"], summary
    saved = json.loads((tmp_path / "prepare_summary.json").read_text())
    assert saved["sampled_success_t1"] == summary["sampled_success_t1"]

    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 32  # what vLLM's CPU attention supports
    assert config.max_position_embeddings >= 256
    rows = [json.loads(line) for line in open(tmp_path / "data" / "test.jsonl")][:200]
    played = sample_episodes(model, tok, rows, temperature=1.0, seed=1)
    assert 0.1 < played["success"] < 0.8, played
    assert sample_episodes(model, tok, rows[:50], temperature=0.0)["success"] > played["success"] - 0.1



# each run twice: 2 steps of 8 prompts that check what flowed (default lane), a learning curve of
# 16-prompt steps (full lane)
MECHANICS = pytest.param(2, id="mechanics")


def _prompts_per_step(steps: int) -> int:
    return 8 if steps <= 2 else 16


def _eval_every(steps: int) -> int:
    """Evaluations before the first update and after the last (mechanics), and halfway (learning)."""
    return steps if steps <= 2 else steps // 2


@pytest.mark.slow
@pytest.mark.parametrize("steps", [MECHANICS, pytest.param(40, id="learning", marks=pytest.mark.full)])
def test_calculator_task_learns_end_to_end_with_whole_episodes(tiny_calc, tmp_path, steps):
    """`task=calculator` through train(): vLLM plays the episodes, the Calculator runs in its Ray
    actor, DeepSpeed trains on the model's tokens only, and over 40 steps the reward rises (16
    prompts each, half the task config's batch); samples.jsonl holds whole episodes with tool
    calls, tool answers and turn boundaries; eval runs before the first update, halfway and after."""
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config
    from tests.test_e2e import _assert_reward_rises

    out, _ = tiny_calc
    cfg = compose_config(["task=calculator", f"model.path={out}/model", f"task.train_files=[{out}/data/train.jsonl]",
                          f"eval.files=[{out}/data/test.jsonl]", f"eval.every_steps={_eval_every(steps)}",
                          f"eval.max_rows={_prompts_per_step(steps)}",
                          f"run.dir={tmp_path}/run", "run.progress=false", f"run.steps={steps}",
                          f"task.prompts_per_step={_prompts_per_step(steps)}", "run.save_every=0", "run.save_final_model=false"])
    train(cfg)
    *metrics, final = read_metrics(cfg.run.dir)  # the steps, then the evaluation after the last
    every = _eval_every(steps)
    assert len(metrics) == steps and all("eval/pass_at_1" in m for m in (metrics[0], *metrics[every::every], final))
    for m in metrics:
        assert m["reward/errors_count"] == 0 and m["episode/errors_count"] == 0
        assert 0 < m["reward/mean"] < 1 and m["episode/turns_mean"] > 1.5
        assert m["sync/logprob_max_abs_diff"] < 1e-3  # learner and rollout agree on every model token
    assert all(m["sync/weights_mb"] > 0 for m in metrics[1:])
    if steps >= 16:
        _assert_reward_rises(metrics)
    rows = [json.loads(line) for line in open(f"{cfg.run.dir}/samples.jsonl")]
    solved = [r for r in rows if r["reward"] == 1.0 and len(r["turns"]) >= 5]
    assert solved, "no solved multi-turn episode logged"
    turns = solved[0]["turns"]
    assert [t["role"] for t in turns[:2]] == ["model", "observation"] and "<tool_call>" in turns[0]["text"]
    assert all(a["end"] == b["start"] for a, b in zip(turns, turns[1:]))


@pytest.mark.slow
# the default lane's agent run is tests/test_hostile_agents.py's (2 steps, same task, sync checked)
@pytest.mark.parametrize("steps", [pytest.param(2, id="mechanics", marks=pytest.mark.full),
                                   pytest.param(30, id="learning", marks=pytest.mark.full)])
def test_calculator_agent_written_with_the_openai_client_learns(tiny_calc, tmp_path, steps):
    """`task=calculator_agent`: the calculator episode as plain `openai`-client agent code
    (examples/calculator_agent.py) served by the streaming engines through the agent server. Over
    30 steps the reward rises; every trajectory is token-exact across its calls: at step 0 (samples and learner
    both version 0) the learner's log-probs of every model token match the engine's (< 1e-3 fp32)."""
    from launch.train import train
    from rl.log.run_log import read_metrics
    from tests.conftest import compose_config
    from tests.test_e2e import _assert_reward_rises

    out, _ = tiny_calc
    cfg = compose_config(["task=calculator_agent", f"model.path={out}/model", f"task.train_files=[{out}/data/train.jsonl]",
                          f"run.dir={tmp_path}/run", "run.progress=false", f"run.steps={steps}",
                          f"task.prompts_per_step={_prompts_per_step(steps)}", "run.save_every=0", "run.save_final_model=false",
                          "run.log_samples_per_step=8"])
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == steps and all(m["rollout/streaming"] == 1 for m in metrics)
    assert metrics[0]["sync/logprob_max_abs_diff"] < 1e-3 and metrics[0]["policy/staleness_max"] == 0
    for m in metrics:
        assert m["reward/errors_count"] == 0 and m["episode/turns_mean"] > 1.5 and m["policy/staleness_max"] <= 1
    assert all(m["sync/weights_mb"] > 0 for m in metrics[1:])
    if steps >= 16:
        _assert_reward_rises(metrics)
    rows = [json.loads(line) for line in open(f"{cfg.run.dir}/samples.jsonl")]
    solved = [r for r in rows if r["reward"] == 1.0 and len(r["turns"]) >= 5]
    assert solved, "no solved multi-call episode logged"
    turns = solved[0]["turns"]
    assert [t["role"] for t in turns[:2]] == ["model", "observation"] and "<tool_call>" in turns[0]["text"]
