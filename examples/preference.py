"""The built-in tiny preference task: which of two answers to `a+b=` is better, and its reward model.

Pairs live in the tiny arithmetic policy's own space (prompt `a+b=`, completion a digit string),
so a reward model trained on them scores exactly what that policy generates, and the policy can
raise the score by changing its answers. The preference is "closer to the true sum is better":

- a well-formed answer `c` has distance |c - (a+b)| (0 for the correct sum);
- a malformed answer (empty, or digits mixed with `+`/`=`) is worse than every well-formed one;
- `chosen` is strictly and clearly closer than `rejected`.

Half of the pairs put the correct sum against a wrong answer (a dropped or extra carry (+/-10),
swapped digits, off by 3..20, a far-off number, or a malformed one); the other half compare two
wrong answers with |d_rejected| >= 2 |d_chosen| + 5, which teaches a graded "how far off" score
rather than only "right or wrong". A reward model trained on this gives GRPO a dense signal: a
policy moves up the score by getting closer to the sum.

Off-by-1/2 answers are deliberately never used as the worse answer. Measured (2-core CPU): an RM
initialised from the tiny policy stays at chance on "correct vs s+/-1 or 2" after 2 minutes of
training (checking a ones digit is an XOR-like interaction that gives BT no first-order signal),
and mixing such pairs in also stalled learning of every other kind (~65% held-out overall).
Without them the same RM reaches ~90% held-out pairwise accuracy in about 30 s (95-97% after
the default 3 epochs). So the built-in RM resolves distances of about 3 and more, not the last
digit: it rewards "roughly right", and is nearly flat within +/-2 of the sum.

That flat band is what GRPO against this RM over-optimises (measured, 40 steps, defaults): the
RM score rises (5.48 -> 5.79) while exact-match accuracy falls (0.29 -> 0.06 at T=1): group-
normalised advantages amplify the RM's small, arbitrary preferences among answers within +/-2
(e.g. round numbers), and the policy drifts there. A larger KL coefficient slows this
(kl_coef=0.05 without std normalisation: 0.29 -> 0.19). It makes the built-in RM a faithful
demonstration of reward-model training, serving and reward hacking, not a way to teach addition.

- data: `preference_splits` (columns prompt, chosen, rejected, kind; test prompts never occur in
  training), written to OUT/data/{train,test}.jsonl;
- model: a reward model trained on them by `trainer.reward_model.train_rm` (the same code as
  `python -m launch.train_rm`) from the tiny arithmetic policy, in OUT/model (`build`;
  `python -m examples.preference`, 1-2 minutes on a CPU); the training run stays in OUT/run;
- reward: `configs/reward/model.yaml` (`reward=model`): `reward.model_reward:score` serving OUT/model.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples import arith
from examples.arith import addition_prompt, addition_splits
from examples.tiny import main, write_summary
from rl.data.jsonl import write_jsonl

DEFAULT_DIR = "artifacts/tiny_rm"

# How a wrong answer is made from the true sum s (kind -> weight when sampling one).
WRONG_KINDS: dict[str, float] = {
    "carry": 0.25,  # s +/- 10: a dropped or spurious carry
    "swap": 0.15,  # the digits of s reversed (a carry error when that changes nothing)
    "near": 0.25,  # s +/- 3..20
    "far": 0.25,  # any 1-3 digit number at least 21 away
    "malformed": 0.1,  # not a number at all
}
CORRECT_VS_WRONG = 0.5  # share of pairs whose chosen answer is the correct sum
MIN_GAP = 5  # two wrong answers: |d_rejected| >= 2 |d_chosen| + MIN_GAP


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    kind: str  # how the pair was made, e.g. "correct>carry" or "wrong>far" (for per-kind accuracy)

    def to_row(self) -> dict[str, str]:
        return {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected, "kind": self.kind}


def answer_distance(prompt: str, completion: str) -> float:
    """|completion - true sum| for an `a+b=` prompt; inf for a completion that is not a number."""
    a, b = prompt.rstrip("=").split("+")
    text = completion.strip()
    if not text.isdigit():
        return float("inf")
    return float(abs(int(text) - (int(a) + int(b))))


def _wrong_answer(s: int, kind: str, rng: random.Random) -> str:
    if kind == "carry":
        return str(s + 10 if s < 10 or rng.random() < 0.5 else s - 10)
    if kind == "swap":
        swapped = int(str(s)[::-1])
        return str(swapped) if abs(swapped - s) >= 3 else _wrong_answer(s, "carry", rng)  # e.g. 55, 101
    if kind == "near":
        return str(max(0, s + rng.choice((-1, 1)) * rng.randint(3, 20)))
    if kind == "far":
        while True:
            c = rng.randint(0, 999 if rng.random() < 0.2 else 199)
            if abs(c - s) >= 21:
                return str(c)
    if kind == "malformed":
        digits = str(s)
        return rng.choice(("", f"{digits}+", f"{digits[0]}+{digits[1:] or '0'}", f"={digits}", "++"))
    raise ValueError(f"unknown wrong-answer kind {kind!r}; one of {', '.join(WRONG_KINDS)}")


def _pick_kind(rng: random.Random) -> str:
    return rng.choices(list(WRONG_KINDS), weights=list(WRONG_KINDS.values()))[0]


def preference_pair(a: int, b: int, rng: random.Random) -> PreferencePair:
    """One labelled pair for `a+b=`, drawn with `rng` (see the module doc for the rules)."""
    prompt, s = addition_prompt(a, b), a + b
    if rng.random() < CORRECT_VS_WRONG:
        kind = _pick_kind(rng)
        return PreferencePair(prompt, str(s), _wrong_answer(s, kind, rng), f"correct>{kind}")
    # Two wrong answers: the closer one must be clearly closer (see MIN_GAP).
    while True:
        first, second = _wrong_answer(s, _pick_kind(rng), rng), _wrong_answer(s, _pick_kind(rng), rng)
        d1, d2 = answer_distance(prompt, first), answer_distance(prompt, second)
        if d1 > d2:
            first, second, d1, d2 = second, first, d2, d1
        if d1 < float("inf") and d2 >= 2 * d1 + MIN_GAP:
            kind = "malformed" if d2 == float("inf") else ("far" if d2 >= 21 else "near")
            return PreferencePair(prompt, first, second, f"wrong>{kind}")


def preference_splits(
    n_train: int, n_test: int, seed: int = 0, pairs_per_prompt: int = 2
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Train/test pairs over disjoint `a+b=` prompts (operands 10..99), fixed by `seed`.

    Test prompts never occur in training, so test accuracy measures generalisation to new sums.
    """
    prompts_train = -(-n_train // pairs_per_prompt)
    prompts_test = -(-n_test // pairs_per_prompt)
    train_problems, test_problems = addition_splits(prompts_train, prompts_test, seed=seed)
    rng = random.Random(seed * 7919 + 17)

    def pairs(problems, n: int) -> list[PreferencePair]:
        out = []
        for p in problems:
            a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
            out += [preference_pair(a, b, rng) for _ in range(pairs_per_prompt)]
        return out[:n]

    return pairs(train_problems, n_train), pairs(test_problems, n_test)


def write_data(out_dir: str = DEFAULT_DIR, seed: int = 0, *, n_train: int = 8000, n_test: int = 1000) -> list[str]:
    """OUT/data/train.jsonl and OUT/data/test.jsonl; returns their paths."""
    train, test = preference_splits(n_train, n_test, seed=seed)
    return [write_jsonl(Path(out_dir) / "data" / f"{name}.jsonl", (p.to_row() for p in pairs))
            for name, pairs in (("train", train), ("test", test))]


def build(
    out_dir: str = DEFAULT_DIR,
    seed: int = 0,
    *,
    policy_path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Data, then a trained RM in OUT/model; returns the training summary.

    `policy_path` is the causal LM the RM starts from (default: the built-in tiny policy, built
    when missing). `overrides` are extra `launch.train_rm` config overrides (e.g. "algorithm.epochs=2").
    """
    from rl.config.compose import compose
    from trainer.reward_model import train_rm

    out = Path(out_dir)
    if policy_path is None:
        policy_path = os.path.join(arith.DEFAULT_DIR, "model")
        if not os.path.isdir(policy_path):
            arith.build(arith.DEFAULT_DIR, seed=seed)
    train_file, test_file = write_data(str(out), seed=seed)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished earlier build
    summary = train_rm(compose("train_rm", [
        f"model.path={os.path.abspath(policy_path)}",
        f"data.train_files=[{os.path.abspath(train_file)}]",
        f"data.test_files=[{os.path.abspath(test_file)}]",
        f"run.dir={os.path.abspath(run_dir)}",
        f"run.seed={seed}",
        "data.group_key=kind",  # eval accuracy per kind of pair, too
        "run.progress=false",
        *overrides,
    ]))
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(summary["final_model"], model_dir)  # same filesystem: atomic
    return write_summary(out, {**summary, "final_model": str(model_dir), "policy_path": policy_path,
                               "train_file": train_file, "test_file": test_file})


if __name__ == "__main__":
    main(build, DEFAULT_DIR, __doc__)
