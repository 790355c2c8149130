"""The built-in calculator task: multi-step sums solved with a calculator tool, over several turns.

The smallest multi-turn tool task: the prompt is a sum of three 2-digit numbers (`12+34+56`), the
model may call a calculator (`rl.data.tools` format) that adds two numbers at a time, and its last turn,
the one without a tool call, is its answer (`102`), right or wrong. A worked episode::

    <bos><|user|>12+34+56<|end|>
    <|assistant|><tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call><|end|>
    <|tool|>46<|end|>
    <|assistant|><tool_call>{"name":"calculator","arguments":{"expression":"46+56"}}</tool_call><|end|>
    <|tool|>102<|end|>
    <|assistant|>102<|end|>

- data: `sum_splits` (columns `prompt`, `answer`), written to OUT/data/{train,test}.jsonl;
- environment: `Calculator` (`task.env: examples.calculator:Calculator`), whose reward is 1.0 for a
  right final answer, else 0.0; tool calls are evaluated by `evaluate` (digits, + - * only);
- model: a tiny chat Llama (OUT/model) warmed up by SFT on such episodes (loss on the assistant
  turns only) just enough to solve them only some of the time at temperature 1.0, so GRPO has
  room to improve (`build`; `python -m examples.calculator`); `sample_episodes` plays episodes
  turn by turn in process, as the RL runner does, and is the build's measure of success.

`configs/task/calculator.yaml` (`task=calculator`) trains it; built on first use (`rl.data.builtins.ensure_builtin`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from examples.calculator_tool import evaluate  # the tool, light to import (agents import it alone)
from examples.tiny import (ProbeStop, Recipe, TaskBuild, at_two_temperatures, build_tokenizer, episode_logprobs, main,
                           warm_up_episodes)
from rl.data.env import Environment, StepResult, as_step_result
from rl.data.jsonl import write_jsonl
from rl.data.tools import BadToolCall, ToolCall, format_tool_call, parse_tool_calls

DEFAULT_DIR = "artifacts/tiny_calc"
TOOL = "calculator"
MAX_POSITIONS = 256  # the model's context: a whole episode is ~90 tokens


# ---- the tool and the environment ------------------------------------------------------------

# The environment's error observations, fixed texts the tokenizer knows (details go to `info`).
ERROR_BAD_CALL = "error: bad tool call"
ERROR_UNKNOWN_TOOL = "error: unknown tool"
ERROR_BAD_EXPRESSION = "error: bad expression"
WRONG_ANSWER = "wrong answer, try again"  # only with retries > 0 (task.env_kwargs)


class Calculator(Environment):
    """One episode of the calculator task (`task.env: examples.calculator:Calculator`).

    A turn with a tool call is answered with the tool's result (or an `error: ...` text) and the
    episode goes on, with reward 0.0 (so an episode that `task.max_turns` or the token budget cuts
    off before an answer earns 0, not "no reward"); a turn without one is the final answer: reward
    1.0 if it equals the row's `answer` (both stripped), else 0.0, and the episode ends. Only a
    turn's first call is run. `retries` (task.env_kwargs): a wrong answer is told so (a tool turn,
    `WRONG_ANSWER`, reward 0.0) and the model answers again, up to that many times.
    """

    def __init__(self, retries: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.retries = retries

    def reset(self, row: dict[str, Any]) -> None:
        self.answer = str(row["answer"]).strip()
        self.retries_left = self.retries

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        try:
            calls = parse_tool_calls(text)
        except BadToolCall as err:
            return StepResult(ERROR_BAD_CALL, reward=0.0, info={"error": str(err)})
        if not calls:
            answer = getattr(self, "answer", None)
            right = answer is not None and text.strip() == answer
            if not right and getattr(self, "retries_left", 0) > 0:
                self.retries_left -= 1
                return StepResult(WRONG_ANSWER, reward=0.0)
            return StepResult(None, reward=float(right), done=True)
        call = calls[0]
        if call.name != TOOL:
            return StepResult(ERROR_UNKNOWN_TOOL, reward=0.0, info={"error": f"unknown tool {call.name!r}"})
        try:
            value = evaluate(call.arguments.get("expression"))
        except ValueError as err:
            return StepResult(ERROR_BAD_EXPRESSION, reward=0.0, info={"error": str(err)})
        return StepResult(str(value), reward=0.0, info={"expression": call.arguments["expression"]})


# ---- data ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """A sum of 2-digit operands, e.g. prompt `12+34+56`, answer `102`."""

    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.operands))

    @property
    def answer(self) -> str:
        return str(sum(self.operands))

    def to_row(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer}

    def episode(self) -> list[dict[str, str]]:
        """The worked episode as chat messages: add left to right with the calculator, then answer."""
        messages = [{"role": "user", "content": self.prompt}]
        total = self.operands[0]
        for x in self.operands[1:]:
            call = ToolCall(TOOL, {"expression": f"{total}+{x}"})
            total += x
            messages += [{"role": "assistant", "content": format_tool_call(call)},
                         {"role": "tool", "content": str(total)}]
        return messages + [{"role": "assistant", "content": str(total)}]


def sum_splits(n_train: int, n_test: int, seed: int = 0, operands: int = 3, lo: int = 10,
               hi: int = 99) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train/test sets of sums of `operands` numbers in [lo, hi], fixed by `seed`
    (operand tuples drawn without replacement, so no test prompt appears in training)."""
    span = hi - lo + 1
    if lo < 0 or hi < lo or operands < 2:
        raise ValueError(f"need 0 <= lo <= hi and at least 2 operands, got lo={lo}, hi={hi}, operands={operands}")
    if n_train < 0 or n_test < 0 or n_train + n_test > span ** operands:
        raise ValueError(f"n_train + n_test = {n_train + n_test} must be in [0, {span ** operands}]")
    rng = random.Random(seed)
    problems = []
    for code in rng.sample(range(span ** operands), n_train + n_test):
        digits = []
        for _ in range(operands):
            code, d = divmod(code, span)
            digits.append(lo + d)
        problems.append(Problem(tuple(digits)))
    return problems[:n_train], problems[n_train:]


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, *, n_train: int = 5000, n_test: int = 500) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl (disjoint prompts, fixed by `seed`)."""
    train, test = sum_splits(n_train, n_test, seed=seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", (p.to_row() for p in problems))
            for name, problems in (("train", train), ("test", test))]


def calculator_tokenizer(model_max_length: int = MAX_POSITIONS) -> PreTrainedTokenizerFast:
    """The chat tokenizer (`examples.tiny.build_tokenizer(chat=True)`): a token per digit and
    symbol, the tool call's JSON words, and the environment's error texts."""
    call = format_tool_call(ToolCall(TOOL, {"expression": "0123456789+-*"}))
    corpus = [call, ERROR_BAD_CALL, ERROR_UNKNOWN_TOOL, ERROR_BAD_EXPRESSION]
    return build_tokenizer(corpus, chat=True, model_max_length=model_max_length)


# ---- playing episodes in process (the build's probe) -----------------------------------------

@torch.no_grad()
def sample_episodes(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict[str, Any]],
    *,
    temperature: float = 1.0,
    seed: int = 0,
    max_turns: int = 4,
    max_new_tokens: int = 40,
    max_observation_tokens: int = 16,
    max_len: int = MAX_POSITIONS,
    batch_size: int = 128,
) -> dict[str, float]:
    """Play one `Calculator` episode per row turn by turn with HF `generate`, as the RL runner
    does (prompt = the chat template of the user message; each turn sampled up to EOS; the
    observation tokenized by `rl.data.episodes.ObservationEncoder`): mean reward (`success`), model
    turns and tool calls per episode, and the share of episodes that ended with an answer.
    temperature 0 is greedy; sampling uses a forked RNG (the caller's state is untouched)."""
    from rl.data.episodes import ObservationEncoder

    encode = ObservationEncoder(tokenizer, chat=True, role="tool", cap=max_observation_tokens)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampling: dict[str, Any] = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                                if temperature > 0 else {"do_sample": False})
    reward = turns = calls = answered = 0.0
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            envs = [Calculator() for _ in chunk]
            ids = []
            for env, row in zip(envs, chunk):
                env.reset(row)
                out = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True)
                ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
            active = list(range(len(chunk)))
            for turn in range(max_turns):
                budget = min(max_new_tokens, max_len - max(len(ids[i]) for i in active))
                if budget <= 0:
                    break
                width = max(len(ids[i]) for i in active)
                input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in active])
                attention = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in active])
                gen = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=budget,
                                     eos_token_id=eos, pad_token_id=pad, **sampling)[:, width:].tolist()
                still = []
                for i, new in zip(active, gen):
                    new = new[: new.index(eos) + 1] if eos in new else new
                    ids[i] += new
                    text = tokenizer.decode(new, skip_special_tokens=True)
                    result = as_step_result(envs[i].step(text, new))
                    turns += 1
                    calls += "expression" in result.info
                    reward += result.reward or 0.0
                    answered += result.done
                    if not result.done and turn + 1 < max_turns:
                        ids[i] += encode(result.observation)
                        still.append(i)
                active = still
                if not active:
                    break
    model.train(was_training)
    n = max(1, len(rows))
    return {"success": reward / n, "turns": turns / n, "tool_calls": calls / n, "answered": answered / n,
            "n": float(len(rows))}


def expected_success(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> float:
    """Mean probability that a T=1.0 episode is exactly the worked one (no sampling noise): a
    lower bound on the chance of success, as other ways to the right answer also count."""
    logp = episode_logprobs(model, tokenizer, [p.episode() for p in problems])
    return float(logp.exp().mean()) if len(problems) else 0.0


# head_dim 32 (vLLM CPU attention)
RECIPE = Recipe(hidden=64, heads=2, lr=3e-3, batch_size=32, probe_every=5, n_probe=128)


def build(
    out_dir: str = DEFAULT_DIR,
    seed: int = 0,
    *,
    target_success: float = 0.3,
    **recipe: Any,
) -> dict[str, Any]:
    """Generate data, train tokenizer and model, warm up, evaluate, save; returns the summary.

    The warm-up (`examples.tiny.warm_up_episodes`) runs at most `steps` SFT steps on worked
    episodes and stops as soon as the expected T=1.0 success (`expected_success`) on `n_probe`
    training problems, checked every `probe_every` steps, reaches `target_success` (0 or above 1
    disables it). The summary's `sampled_success_t1` plays `n_eval` test episodes
    (`sample_episodes`). `recipe`: any field of `Recipe`.
    """
    with TaskBuild(out_dir, seed, RECIPE, recipe) as task:
        r = task.recipe
        train, test = sum_splits(r.n_train, r.n_test, seed=seed)
        write_data(out_dir, seed, n_train=r.n_train, n_test=r.n_test)
        tokenizer = calculator_tokenizer()
        model = task.model(tokenizer, max_positions=MAX_POSITIONS)
        probe_set = train[-r.n_probe:]
        stop = ProbeStop("success", target_success, r.probe_every,
                         lambda: expected_success(model, tokenizer, probe_set))
        _, sft_summary = warm_up_episodes(model, tokenizer, [p.episode() for p in train], r, seed, stop_fn=stop)
        eval_set = test[:r.n_eval]
        eval_rows = [p.to_row() for p in eval_set]
        sampled = at_two_temperatures(functools.partial(sample_episodes, model, tokenizer, eval_rows), seed)
        expected = {"eval_n": len(eval_set), "expected_success_t1": expected_success(model, tokenizer, eval_set)}
        return task.finish(model, tokenizer, train, test, stop.figures(), sft_summary, sampled, expected)


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
