"""The built-in code agent task: the code speed-up task as an episode with sandbox feedback.

The problems are those of `examples.code_speedup` (make a slow C function `long f(long n)`
faster without changing its results). The user turn is the slow reference; every model turn is
a whole program (the only action is "submit", so no tool-call wrapper is needed); the sandbox
judges it exactly as the single-turn reward does (`reward.code_speedup.judge`: compile, visible
and hidden tests, benchmark output checked, instructions counted) and the environment answers
with one of a few fixed feedback texts; the model may revise up to `task.max_turns`. A worked
episode (C tokens separated by spaces, as in the single-turn task)::

    <bos><|user|>long f ( long n ) { ... slow loop ... }<|end|>
    <|assistant|>long f ( long n ) { ... off by one ... }<|end|>
    <|tool|>wrong answer<|end|>
    <|assistant|>long f ( long n ) { ... steps by a instead of testing i % a ... }<|end|>
    <|tool|>correct faster<|end|>
    <|assistant|>long f ( long n ) { return ... closed form ... ; }<|end|>

- environment: `CodeAgent` (`task.env: examples.code_agent:CodeAgent`). Feedback: `compile
  error`, `wrong answer` (failed a test, crashed, ran out of time or memory, or printed something
  else when measured), `correct slow` (speed-up under `faster_at`), `correct faster`, `correct
  fast` (speed-up of at least `fast_at`, which ends the episode: nothing left to gain). The
  episode's reward is that of its *best* program (`speedup_reward`'s scale: 0 if wrong, 0.2 for
  a copy of the reference, 1 for `max_speedup`), paid as per-turn increments of the best so far
  (so turn rewards sum to the best, and GAE sees when an improvement happened). A sandbox
  failure (not the program's fault) raises: the episode is recorded as an error, never a 0.
- data: the code speed-up split, the user message being the reference (OUT/data/{train,test}.jsonl);
- model: a tiny chat Llama over the C-token vocabulary plus the feedback words (OUT/model),
  warmed up by SFT on worked episodes (`worked_episode`: a first attempt drawn like the
  single-turn task's warm-up mix, then revisions that are mostly better after each feedback)
  until a first attempt is an exactly correct program about half of the time.

`configs/task/code_agent.yaml` (`task=code_agent`) trains it; built on first use (`rl.data.builtins.ensure_builtin`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tokenizers import decoders, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from examples.code_speedup import (CORRECT_KINDS, DEFAULT_MIX, KINDS, CodeProblem, all_code_problems, code_corpus,
                                   code_speedup_splits, kinds_stop_fn)
from examples.tiny import Recipe, TaskBuild, build_tokenizer, episode_logprobs, main, warm_up_episodes
from reward.code_speedup import SandboxFailure, judge, speedup_to_reward
from rl.data.env import Environment, StepResult
from rl.data.jsonl import write_jsonl
from sandbox.job import Status

DEFAULT_DIR = "artifacts/tiny_code_agent"
MAX_POSITIONS = 256  # a 3-turn episode is at most ~215 tokens

# The environment's answers: fixed texts the tokenizer knows (details go to the turn's `info`).
COMPILE_ERROR, WRONG, SLOW, FASTER, FAST = ("compile error", "wrong answer", "correct slow", "correct faster",
                                            "correct fast")
FEEDBACK = (COMPILE_ERROR, WRONG, SLOW, FASTER, FAST)
# What each warm-up variant kind is told (the generator's medium rewrites are 1.6-22x faster,
# its closed forms ~50-70x: see examples/code_speedup.py), with the default thresholds below.
KIND_FEEDBACK = {"slow": SLOW, "medium": FASTER, "fast": FAST, "wrong": WRONG}


# ---- the environment -------------------------------------------------------------------------

def feedback_of(status: Status, speedup: float | None, faster_at: float = 1.5, fast_at: float = 30.0) -> str:
    """The feedback text for a judged program: its status, or its speed-up bucket if correct."""
    if status is Status.COMPILE_ERROR:
        return COMPILE_ERROR
    if status is not Status.OK or speedup is None:
        return WRONG
    return FAST if speedup >= fast_at else FASTER if speedup >= faster_at else SLOW


class CodeAgent(Environment):
    """One episode of the code agent task (`task.env: examples.code_agent:CodeAgent`).

    Every turn's text is a program, judged in the sandbox against the row's reference (the
    sandbox pool of the run when there is one, else a `backend` sandbox in this process). The
    reward is paid as the increase of the best program's reward so far; the episode ends on a
    `correct fast` program (or at `task.max_turns`).
    """

    def __init__(self, max_speedup: float = 100.0, correct_bonus: float = 0.2, method: str = "instructions",
                 backend: str = "process", faster_at: float = 1.5, fast_at: float = 30.0) -> None:
        if not 1.0 < faster_at <= fast_at:
            raise ValueError(f"need 1 < faster_at <= fast_at, got faster_at={faster_at}, fast_at={fast_at}")
        self.max_speedup, self.correct_bonus = max_speedup, correct_bonus
        self.method, self.backend = method, backend
        self.faster_at, self.fast_at = faster_at, fast_at

    def reset(self, row: dict[str, Any]) -> None:
        self.row, self.best = row, 0.0

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        verdict = judge([text.strip()], [self.row], method=self.method, backend=self.backend)[0]
        if verdict.error is not None:
            raise SandboxFailure(f"could not judge the program: {verdict.error}")
        score = 0.0 if verdict.speedup is None else speedup_to_reward(verdict.speedup, self.max_speedup,
                                                                      self.correct_bonus)
        gain, self.best = max(0.0, score - self.best), max(self.best, score)
        feedback = feedback_of(verdict.result.status, verdict.speedup, self.faster_at, self.fast_at)
        info = {"status": verdict.result.status.value, "speedup": verdict.speedup, "program_reward": score}
        return StepResult(feedback, reward=gain, done=feedback == FAST, info=info)


# ---- data ------------------------------------------------------------------------------------

def agent_row(problem: CodeProblem) -> dict[str, Any]:
    """The single-turn task's row with the reference alone as the user message."""
    return {**problem.to_row(), "prompt": problem.reference}


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl: the code speed-up split (`agent_row`)."""
    train, test = code_speedup_splits(seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", (agent_row(p) for p in problems))
            for name, problems in (("train", train), ("test", test))]


def agent_tokenizer(model_max_length: int = MAX_POSITIONS) -> PreTrainedTokenizerFast:
    """A chat tokenizer (`examples.tiny.build_tokenizer(chat=True)`) with one token per C token
    of every problem and variant, and per feedback word; decoding joins words with one space."""
    return build_tokenizer(code_corpus(all_code_problems()) + list(FEEDBACK), chat=True,
                           pre_tokenizer=pre_tokenizers.WhitespaceSplit(),
                           decoder=decoders.WordPiece(prefix="##", cleanup=False),
                           model_max_length=model_max_length)


# What the warm-up writes next after each feedback: mostly a better program, sometimes a near miss.
NEXT_MIX: dict[str, dict[str, float]] = {
    WRONG: {"slow": 0.4, "medium": 0.3, "fast": 0.1, "wrong": 0.2},
    SLOW: {"medium": 0.45, "fast": 0.15, "wrong": 0.2, "slow": 0.2},
    FASTER: {"fast": 0.35, "medium": 0.35, "wrong": 0.3},
}


def _draw(rng: random.Random, problem: CodeProblem, mix: dict[str, float]) -> tuple[str, str]:
    kinds = [k for k in KINDS if mix.get(k, 0) > 0 and problem.variants.get(k)]
    kind = rng.choices(kinds, weights=[mix[k] for k in kinds])[0]
    return kind, rng.choice(problem.variants[kind])


def worked_episode(problem: CodeProblem, rng: random.Random, max_turns: int = 3,
                   first_mix: dict[str, float] | None = None) -> list[dict[str, str]]:
    """A warm-up episode as chat messages: a first program drawn by `first_mix` (the single-turn
    warm-up's `DEFAULT_MIX`), each answered with its kind's feedback and followed by a revision
    drawn by `NEXT_MIX`, until a fast program or `max_turns` programs."""
    messages = [{"role": "user", "content": problem.reference}]
    kind, source = _draw(rng, problem, first_mix or DEFAULT_MIX)
    for turn in range(max_turns):
        messages.append({"role": "assistant", "content": source})
        feedback = KIND_FEEDBACK[kind]
        if feedback == FAST or turn + 1 == max_turns:
            break
        messages.append({"role": "tool", "content": feedback})
        kind, source = _draw(rng, problem, NEXT_MIX[feedback])
    return messages


def first_turn_kinds(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                     problems: list[CodeProblem]) -> dict[str, float]:
    """Mean chance over `problems` that a T=1.0 first program is exactly a known variant of each
    kind (teacher-forced, no sampling noise); `correct` sums the correct kinds."""
    pairs = [(p, kind, src) for p in problems for kind in KINDS for src in p.variants.get(kind, ())]
    convs = [[{"role": "user", "content": p.reference}, {"role": "assistant", "content": src}] for p, _, src in pairs]
    probs = episode_logprobs(model, tokenizer, convs).exp().tolist() if pairs else []
    out = {k: 0.0 for k in KINDS}
    for (_, kind, _), prob in zip(pairs, probs):
        out[kind] += prob / max(1, len(problems))
    out["correct"] = sum(out[k] for k in CORRECT_KINDS)
    return out


RECIPE = Recipe(hidden=64, heads=2, probe_every=25, batch_size=32)  # ~140K parameters: builds in ~50 s on one thread


def build(
    out_dir: str = DEFAULT_DIR,
    seed: int = 0,
    *,
    episodes_per_problem: int = 40,
    max_turns: int = 3,
    target_correct: float = 0.5,
    target_faster: float = 0.07,
    **recipe: Any,
) -> dict[str, Any]:
    """Write the data, train tokenizer and model, warm up, save; returns the summary.

    The warm-up runs at most `steps` SFT steps on `episodes_per_problem` worked episodes per
    training problem (`worked_episode`) and stops once the teacher-forced chance that a first
    program is exactly correct (`first_turn_kinds`, over the training problems, every
    `probe_every` steps) reaches `target_correct` and that it is a medium and a fast rewrite
    each reaches `target_faster` (target_correct 0 or above 1: never stop early).
    `recipe`: any field of `Recipe`.
    """
    with TaskBuild(out_dir, seed, RECIPE, recipe) as task:
        train, test = code_speedup_splits(seed)
        write_data(out_dir, seed)
        tokenizer = agent_tokenizer()
        model = task.model(tokenizer, max_positions=MAX_POSITIONS)
        rng = random.Random(seed)
        episodes = [worked_episode(p, rng, max_turns) for p in train for _ in range(episodes_per_problem)]
        probes: list[dict[str, float]] = []
        reached_target = kinds_stop_fn(lambda: first_turn_kinds(model, tokenizer, train), probes, task.recipe,
                                       target_correct, target_faster)
        _, sft_summary = warm_up_episodes(model, tokenizer, episodes, task.recipe, seed, stop_fn=reached_target)
        return task.finish(model, tokenizer, train, test, {
            "n_sft_episodes": len(episodes),
            "sft_turns_mean": sum(m["role"] == "assistant" for e in episodes for m in e) / max(1, len(episodes)),
            "max_positions": MAX_POSITIONS,
            "sft_target_correct": target_correct,
            "sft_target_faster": target_faster,
            "sft_probes": probes,
            "first_turn_kinds_train": first_turn_kinds(model, tokenizer, train),
            "first_turn_kinds_test": first_turn_kinds(model, tokenizer, test),
            **sft_summary,
        })


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
