"""Unit tests for reward loading and scoring (no Ray)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reward import RewardFunctionSpec, RewardLoadError, RewardScorer, load_reward_function
from reward.builtin import exact_answer, format_number
from rl.data.types import Sample, ScoredSample


def make_sample(completion: str, i: int = 0, finish_reason: str = "stop", **metadata: object) -> Sample:
    ids = [ord(c) for c in completion]
    return Sample(
        prompt_ids=[1, 2],
        completion_ids=ids,
        logprobs=[-0.5] * len(ids),
        finish_reason=finish_reason,
        policy_version=0,
        prompt_text=f"prompt {i}",
        completion_text=completion,
        group_id=i // 2,
        sample_index=i % 2,
        metadata=dict(metadata),
    )


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


USER_REWARDS = """
    import asyncio
    import time

    def boom(prompts, completions, **kwargs):
        out = []
        for c in completions:
            if c == "boom":
                raise RuntimeError(f"cannot score {c!r}")
            out.append(float(len(c)))
        return out

    async def async_len(prompts, completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    async def async_slow(prompts, completions, **kwargs):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    def sleepy(prompts, completions, **kwargs):
        time.sleep(30)
        return [1.0] * len(completions)

    def short_list(prompts, completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    def not_a_list(prompts, completions, **kwargs):
        return 1.0

    def bad_value(prompts, completions, **kwargs):
        return ["high" if c == "x" else float("nan") if c == "nan" else 0.5 for c in completions]

    def seen_kwargs(prompts, completions, completion_ids, finish_reasons, **kwargs):
        seen_kwargs.calls.append(dict(kwargs, prompts=prompts, completions=completions,
                                      completion_ids=completion_ids, finish_reasons=finish_reasons))
        return [0.0] * len(completions)
    seen_kwargs.calls = []

    def no_kwargs(prompts, completions):
        return [0.0] * len(completions)

    NOT_CALLABLE = 3
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    return write(tmp_path / "user_rewards.py", USER_REWARDS)


def spec(path: Path, fn: str, weight: float = 1.0, name: str | None = None) -> RewardFunctionSpec:
    return RewardFunctionSpec(fn=f"{path}:{fn}", weight=weight, name=name)


# ---------------------------------------------------------------- loading


def test_load_by_module_path() -> None:
    assert load_reward_function("reward.builtin:exact_answer") is exact_answer


def test_load_by_absolute_file_path_outside_repo(rewards_file: Path) -> None:
    fn = load_reward_function(f"{rewards_file}:boom")
    assert fn(["p"], ["abc"]) == [3.0]
    # loading the same file again reuses the module instead of executing it twice
    assert load_reward_function(f"{rewards_file}:boom") is fn


def test_load_relative_path_with_base_dir(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "r.py", USER_REWARDS)
    fn = load_reward_function("sub/r.py:async_len", base_dir=str(tmp_path))
    assert fn.__name__ == "async_len"


def test_two_files_with_same_name_do_not_collide(tmp_path: Path) -> None:
    for d, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / d).mkdir()
        write(tmp_path / d / "rewards.py", f"def r(prompts, completions, **kw):\n    return [{value}]\n")
    assert load_reward_function("a/rewards.py:r", str(tmp_path))([], []) == [1.0]
    assert load_reward_function("b/rewards.py:r", str(tmp_path))([], []) == [2.0]


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("reward.builtin.exact_answer", ["missing ':'", "package.module:function"]),
        ("reward.builtin:", ["missing ':'"]),
        ("nope_missing.py:f", ["not found", "nope_missing.py", "absolute path"]),
        ("no_such_pkg_xyz.mod:f", ["module 'no_such_pkg_xyz.mod' not found", "PYTHONPATH"]),
        ("reward.builtin:no_such_fn", ["has no attribute 'no_such_fn'", "exact_answer"]),
    ],
)
def test_loader_errors_name_spec_and_fix(bad: str, expected: list[str], tmp_path: Path) -> None:
    with pytest.raises(RewardLoadError) as info:
        load_reward_function(bad, base_dir=str(tmp_path), field="reward.functions[1].fn")
    msg = str(info.value)
    assert msg.startswith(f"reward.functions[1].fn={bad!r}: ")
    for part in expected:
        assert part in msg


def test_loader_file_not_found_shows_absolute_path(tmp_path: Path) -> None:
    with pytest.raises(RewardLoadError, match="relative to the base directory") as info:
        load_reward_function("foo.py:bar", base_dir=str(tmp_path))
    assert f"file {tmp_path / 'foo.py'} not found" in str(info.value)


def test_loader_not_callable_and_signature(rewards_file: Path) -> None:
    with pytest.raises(RewardLoadError, match="is a int, not callable"):
        load_reward_function(f"{rewards_file}:NOT_CALLABLE")
    with pytest.raises(RewardLoadError, match=r"must accept \*\*kwargs"):
        load_reward_function(f"{rewards_file}:no_kwargs")


def test_loader_module_that_fails_to_import(tmp_path: Path) -> None:
    write(tmp_path / "broken.py", "import definitely_not_installed_pkg\n")
    with pytest.raises(RewardLoadError, match="running .*broken.py raised ModuleNotFoundError"):
        load_reward_function("broken.py:f", base_dir=str(tmp_path))
    write(tmp_path / "broken_dep_mod.py", "import definitely_not_installed_pkg\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RewardLoadError, match="importing module 'broken_dep_mod' failed.*dependency"):
            load_reward_function("broken_dep_mod:f")
    finally:
        sys.path.remove(str(tmp_path))


def test_scorer_validates_at_construction(rewards_file: Path) -> None:
    with pytest.raises(RewardLoadError, match=r"reward.functions\[1\].fn='reward.builtin:nope'"):
        RewardScorer([RewardFunctionSpec("reward.builtin:exact_answer"), RewardFunctionSpec("reward.builtin:nope")])
    with pytest.raises(RewardLoadError, match="already used by reward.functions\\[0\\]"):
        RewardScorer([RewardFunctionSpec("reward.builtin:exact_answer")] * 2)
    with pytest.raises(RewardLoadError, match="weight"):
        RewardScorer([RewardFunctionSpec("reward.builtin:exact_answer", weight=float("nan"))])


def test_importing_scorer_does_not_import_ray() -> None:
    code = "import sys, reward, reward.scorer, reward.loader, reward.builtin; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ---------------------------------------------------------------- builtins


def test_builtins() -> None:
    assert exact_answer([""] * 3, [" 42\n", "41", "x"], answer=["42", " 42 ", None]) == [1.0, 0.0, None]
    assert exact_answer(["", ""], ["42", "x"]) == [None, None]
    completions = ["42", " -7 \n", "4.2", "42", "", "12a"]
    reasons = ["stop", "stop", "stop", "length", "stop", "stop"]
    assert format_number([""] * 6, completions, finish_reasons=reasons) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- scoring


def test_weights_combine() -> None:
    scorer = RewardScorer(
        [
            RewardFunctionSpec("reward.builtin:exact_answer", weight=1.0),
            RewardFunctionSpec("reward.builtin:format_number", weight=0.1),
        ]
    )
    out = scorer.score([make_sample("42", answer="42"), make_sample("41", answer="42"), make_sample("x y", answer="x")])
    assert [o.reward for o in out] == pytest.approx([1.1, 0.1, 0.0])
    assert out[0].components == {"exact_answer": 1.0, "format_number": 1.0}
    assert all(o.error is None for o in out)
    assert isinstance(out[0], ScoredSample) and out[1].sample.completion_text == "41"


def test_none_is_skipped_and_no_value_is_error() -> None:
    scorer = RewardScorer(
        [
            RewardFunctionSpec("reward.builtin:exact_answer", weight=2.0),
            RewardFunctionSpec("reward.builtin:format_number", weight=0.5, name="fmt"),
        ]
    )
    out = scorer.score([make_sample("7"), make_sample("7", answer="7")])  # first has no answer
    assert out[0].reward == pytest.approx(0.5) and out[0].components == {"exact_answer": None, "fmt": 1.0}
    assert out[1].reward == pytest.approx(2.5)

    only_answer = RewardScorer([RewardFunctionSpec("reward.builtin:exact_answer")])
    out = only_answer.score([make_sample("7"), make_sample("7", answer="7")])
    assert out[0].reward is None and out[0].error == "no reward function returned a value"
    assert out[1].reward == 1.0 and out[1].error is None


def test_raising_for_one_sample_isolates_it(rewards_file: Path) -> None:
    scorer = RewardScorer([spec(rewards_file, "boom"), RewardFunctionSpec("reward.builtin:format_number")])
    out = scorer.score([make_sample("ab"), make_sample("boom", 1), make_sample("12", 2)])
    assert [o.reward for o in out] == [2.0 + 0.0, None, 2.0 + 1.0]
    assert [o.error for o in out] == [None, "boom: RuntimeError: cannot score 'boom'", None]
    assert out[1].components == {"boom": None, "format_number": 0.0}


def test_async_function(rewards_file: Path) -> None:
    scorer = RewardScorer([spec(rewards_file, "async_len", weight=0.5)])
    assert [o.reward for o in scorer.score([make_sample("abcd"), make_sample("ab")])] == [2.0, 1.0]


@pytest.mark.parametrize("fn", ["sleepy", "async_slow"])
def test_timeout_is_prompt_and_recorded(rewards_file: Path, fn: str) -> None:
    scorer = RewardScorer([spec(rewards_file, fn), RewardFunctionSpec("reward.builtin:format_number")], timeout_s=0.3)
    start = time.monotonic()
    out = scorer.score([make_sample("1"), make_sample("2", 1)])
    assert time.monotonic() - start < 3.0
    for o in out:
        assert o.reward is None
        assert o.error is not None and o.error.startswith(f"{fn}: ") and "timeout" in o.error
        assert o.components["format_number"] == 1.0


def test_wrong_length_or_type_names_the_function(rewards_file: Path) -> None:
    for fn, text in (("short_list", "returned 1 values for 2 samples"), ("not_a_list", "returned float")):
        out = RewardScorer([spec(rewards_file, fn)]).score([make_sample("a"), make_sample("b", 1)])
        assert all(o.reward is None and o.error.startswith(f"{fn}: ") and text in o.error for o in out)


def test_non_number_values_are_per_sample_errors(rewards_file: Path) -> None:
    out = RewardScorer([spec(rewards_file, "bad_value", name="bv")]).score(
        [make_sample("x"), make_sample("nan", 1), make_sample("ok", 2)]
    )
    assert out[0].error == "bv: returned str, expected a finite float or None"
    assert out[1].error == "bv: returned nan, expected a finite float or None"
    assert out[2].reward == 0.5 and out[2].error is None


def test_kwargs_include_metadata_columns(rewards_file: Path) -> None:
    fn = load_reward_function(f"{rewards_file}:seen_kwargs")
    fn.calls.clear()
    RewardScorer([spec(rewards_file, "seen_kwargs")]).score(
        [make_sample("hi", 0, "length", answer="1", level=3), make_sample("yo", 1, answer="2")]
    )
    (call,) = fn.calls
    assert call["prompts"] == ["prompt 0", "prompt 1"]
    assert call["completions"] == ["hi", "yo"]
    assert call["completion_ids"] == [[104, 105], [121, 111]]
    assert call["finish_reasons"] == ["length", "stop"]
    assert call["answer"] == ["1", "2"] and call["level"] == [3, None]


def test_reserved_metadata_column_is_rejected() -> None:
    scorer = RewardScorer([RewardFunctionSpec("reward.builtin:format_number")])
    with pytest.raises(ValueError, match="column 'prompts' clashes"):
        scorer.score([make_sample("1", prompts="x")])


def test_empty_batch() -> None:
    assert RewardScorer([RewardFunctionSpec("reward.builtin:format_number")]).score([]) == []
