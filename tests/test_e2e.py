"""End-to-end runs of `launch.train` on the real stack: local Ray, vLLM (CPU), DeepSpeed, gloo sync."""

from __future__ import annotations

import json
import math
import os
import statistics

import pytest
import ray
import torch

from launch.allocator import jemalloc_library
from launch.train import train
from rl.log.run_log import read_metrics
from tests.conftest import ray_left_free

pytestmark = pytest.mark.slow

# Each run shape twice: a few steps that check what flowed (the default lane) and a learning curve
# whose reward must rise (the full lane, `pytest -m full`).
MECHANICS = pytest.param(4, id="mechanics")
LEARNING = pytest.param(40, id="learning", marks=pytest.mark.full)


def _window_noise(values: list[float]) -> float:
    return statistics.pstdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def _assert_reward_rises(metrics: list[dict]) -> None:
    """The mean reward of the last 8 steps beats the first 8 by more than twice their noise."""
    rewards = [m["reward/mean"] for m in metrics]
    first, last = rewards[:8], rewards[-8:]
    noise = math.sqrt(_window_noise(first) ** 2 + _window_noise(last) ** 2)
    gain = statistics.fmean(last) - statistics.fmean(first)
    print(f"reward first 8 steps {statistics.fmean(first):.3f} -> last 8 steps {statistics.fmean(last):.3f}, "
          f"gain {gain:.3f}, noise {noise:.3f}")
    assert gain > 2 * noise and gain > 0.03, rewards


@pytest.mark.full
def test_default_run_improves_reward_and_saves_a_loadable_model(make_config):
    """The default job at reduced length: reward rises by more than its step-to-step noise."""
    cfg = make_config("run.steps=40")
    summary = train(cfg)
    # it ran on the session's Ray (tests/conftest.py) and left it running as it found it
    assert ray.is_initialized() and ray_left_free()
    metrics = read_metrics(cfg.run.dir)
    _assert_reward_rises(metrics)
    # after the first sync, learner and vLLM agree on the log-probs of the sampled tokens
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics[1:])
    assert all(m["policy/version_count"] == i + 1 for i, m in enumerate(metrics))

    _assert_saved_model_is_the_trained_policy(summary["final_model"], cfg.model.path, cfg.task.train_files[0],
                                              metrics)
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json"):
        assert os.path.getsize(os.path.join(cfg.run.dir, name)) > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(cfg.run.dir, "tb")))
    _assert_learner_malloc(cfg.run.dir)


def _assert_learner_malloc(run_dir: str) -> None:
    """The CPU learner ran on jemalloc where Ray ships it (launch/allocator.py), as actors.json says."""
    actors = json.load(open(os.path.join(run_dir, "actors.json")))
    learners = [a for a in actors if a["role"] == "learner"]
    assert learners and all(a["malloc"] == ("jemalloc" if jemalloc_library() else "glibc") for a in learners), learners


def _assert_saved_model_is_the_trained_policy(saved_dir: str, start_dir: str, train_file: str,
                                              metrics: list[dict]) -> None:
    """`saved_dir` loads with plain transformers (model and tokenizer) and holds the policy the run
    trained, not the one it started from: the starting model's tokenizer and architecture, every
    weight finite and some changed, and its exact chance of a right answer at the rollout
    temperature (1.0, no sampling noise) on the training prompts at least what the run measured
    over its last steps, well above the starting model's. Its greedy answers are well formed."""
    from examples.arith import Problem, expected_accuracy, sample_accuracy

    model, tok, start, start_tok = _assert_saved_model_loads_and_moved(saved_dir, start_dir)

    with open(train_file) as f:
        problems = [Problem(row["prompt"], row["answer"]) for row in map(json.loads, f)][:2000]
    acc, acc_start = expected_accuracy(model, tok, problems), expected_accuracy(start, start_tok, problems)
    run_last = statistics.fmean(m["reward/exact_answer_mean"] for m in metrics[-8:])  # sampled, T=1.0
    print(f"P(right answer) on {len(problems)} training prompts: start {acc_start:.3f} -> saved {acc:.3f}; "
          f"the run's last 8 steps sampled {run_last:.3f}")
    assert acc > acc_start + 0.03 and acc > run_last - 0.05, (acc_start, acc, run_last)

    prompt = tok("12+34=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, prompt.input_ids.shape[1]:].tolist()
    assert tok.eos_token_id in out and tok.decode(out[:out.index(tok.eos_token_id)]).isdigit(), tok.decode(out)
    assert sample_accuracy(model, tok, problems[:500], temperature=0.0, seed=0)["well_formed"] >= 0.95


def _assert_saved_model_loads_and_moved(saved_dir: str, start_dir: str) -> tuple:
    """`saved_dir` loads with plain transformers, with the starting model's tokenizer, shapes and
    dtypes, every weight finite and some changed; returns (model, tokenizer) saved and started from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(saved_dir), AutoTokenizer.from_pretrained(saved_dir)
    start, start_tok = AutoModelForCausalLM.from_pretrained(start_dir), AutoTokenizer.from_pretrained(start_dir)
    assert tok.get_vocab() == start_tok.get_vocab()
    assert (tok.eos_token_id, tok.pad_token_id) == (start_tok.eos_token_id, start_tok.pad_token_id)
    saved, initial = model.state_dict(), start.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in initial.items()}
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert any(not torch.equal(saved[k], initial[k]) for k in saved), "the saved weights are the starting ones"
    return model, tok, start, start_tok


def _rewind(run_dir: str, last: int, to: int, first_run: str) -> None:
    """Make the run resume from its step-`to` checkpoint (the step-`last` one removed) and move its
    samples.jsonl into `first_run`, so the resumed run's samples can be compared with the first's."""
    import shutil

    shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{last:06d}"))
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{to:06d}")
    os.makedirs(first_run)
    os.replace(os.path.join(run_dir, "samples.jsonl"), os.path.join(first_run, "samples.jsonl"))


def _samples_by_step(run_dir: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            out.setdefault(row["step"], []).append(row)
    return out


@pytest.mark.parametrize("steps", [MECHANICS, LEARNING])
def test_async_rollouts_learn_and_resume_without_losing_a_prompt(make_config, tmp_path, steps):
    """off_policy_steps=1: the next batch is generated while the learner trains, from weights one
    version old (the default behaviour_clip correction); over 40 steps the reward still rises. A
    checkpoint halfway keeps the batch generated ahead, so the run resumed from it trains each
    step's prompts exactly once, and that batch as it was generated (not again, from newer weights)."""
    from launch.checks import check_run_dir

    half = steps // 2
    common = ("algorithm.off_policy_steps=1", f"run.save_every={half}", "run.log_samples_per_step=256",
              "run.save_final_model=false")
    cfg = make_config(f"run.steps={steps}", *common)
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    print(f"async: step {statistics.median(m['time/step_s'] for m in metrics[1:]):.2f} s, "
          f"mismatch {statistics.fmean(m['sync/logprob_abs_diff'] for m in metrics[1:]):.4f} nats, "
          f"ESS {min(m['is/ess_frac'] for m in metrics):.3f}")
    if steps >= 16:
        _assert_reward_rises(metrics)
    assert [m["policy/staleness_max"] for m in metrics] == [0.0] + [1.0] * (steps - 1)  # step 0's batch: version 0
    assert all(0 < m["is/ess_frac"] <= 1 and m["actor/clip_frac"] < 0.2 for m in metrics)
    assert all(m["perf/mfu"] > 0 and "time/wait_rollout_s" in m for m in metrics)
    assert all(m["reward/errors_count"] == 0 for m in metrics)
    _assert_learner_malloc(cfg.run.dir)

    # resume from the halfway checkpoint (its batch for that step was generated ahead, one version before)
    run_dir = cfg.run.dir
    assert os.path.exists(os.path.join(run_dir, "checkpoints", f"step_{half:06d}", "in_flight.pkl"))
    first_run = str(tmp_path / "first_run")
    _rewind(run_dir, last=steps, to=half, first_run=first_run)
    again = make_config(f"run.steps={half + 2}", *common, "run.resume=true")
    train(again, resume_from=check_run_dir(again))
    before, after = _samples_by_step(first_run), _samples_by_step(run_dir)
    assert sorted(after) == [half, half + 1]
    for step in (half, half + 1):
        key = lambda r: (r["group_id"], r["sample_index"])  # noqa: E731
        assert sorted(map(key, after[step])) == sorted(map(key, before[step]))  # each prompt once
        assert [r["prompt_text"] for r in sorted(after[step], key=key)] == \
            [r["prompt_text"] for r in sorted(before[step], key=key)]
    # the halfway batch is the one generated before the checkpoint: same completions, one version old
    assert {r["policy_version"] for r in after[half]} == {half - 1}
    assert [r["completion_text"] for r in after[half]] == [r["completion_text"] for r in before[half]]


@pytest.mark.parametrize("steps", [MECHANICS, LEARNING])
def test_streaming_rollouts_learn_and_resume_without_losing_a_prompt(make_config, tmp_path, steps):
    """rollout.mode=streaming: AsyncLLM engines generate while the learner trains, weights land
    mid-generation (requests kept), every step's samples are at most 1 version old at their oldest
    token, and over 40 steps the reward rises. The halfway checkpoint records the groups finished
    and in flight: the resumed run trains none of the prompts trained before, and each of those
    groups is either trained in its two steps or recorded in flight by its final checkpoint:
    nothing lost, nothing repeated."""
    import pickle

    from launch.checks import check_run_dir

    half = steps // 2
    common = ("rollout.mode=streaming", "algorithm.off_policy_steps=1", f"run.save_every={half}",
              "run.log_samples_per_step=1024", "run.save_final_model=false")  # every sample of a step
    cfg = make_config(f"run.steps={steps}", *common)
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    print(f"streaming: step {statistics.median(m['time/step_s'] for m in metrics[1:]):.2f} s, spanning samples "
          f"{statistics.fmean(m['policy/spanning_samples_frac'] for m in metrics):.3f}, stale groups "
          f"{sum(m['stream/stale_groups_count'] for m in metrics):.0f}")
    if steps >= 16:
        _assert_reward_rises(metrics)
    assert all(m["policy/staleness_max"] <= 1 and m["policy/token_staleness_max"] <= 1 for m in metrics)
    assert all(m["rollout/streaming"] == 1 and m["policy/staleness_bound"] == 1 for m in metrics)
    assert all(m["reward/errors_count"] == 0 and m["sync/weights_mb"] > 0 for m in metrics[1:])

    run_dir = cfg.run.dir
    def kept_at(step: int) -> set[int]:
        with open(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "in_flight.pkl"), "rb") as f:
            state = pickle.load(f)["streaming"]
        return {g.requests[0].group_id for g in state["ready"]} | {r.group_id for r in state["pending"]}

    kept = kept_at(half)
    first_run = str(tmp_path / "first_run")
    _rewind(run_dir, last=steps, to=half, first_run=first_run)
    again = make_config(f"run.steps={half + 2}", *common, "run.resume=true")
    train(again, resume_from=check_run_dir(again))
    before, after = _samples_by_step(first_run), _samples_by_step(run_dir)
    trained_before = {r["group_id"] for step in range(half) for r in before[step]}
    trained_after = {r["group_id"] for step in (half, half + 1) for r in after[step]}
    assert len(kept) == cfg.task.prompts_per_step  # the learner one version behind: half+1 batches started
    assert kept <= trained_after | kept_at(half + 2) and not trained_after & trained_before
    rows = [(r["group_id"], r["sample_index"]) for step in (half, half + 1) for r in after[step]]
    assert len(rows) == len(set(rows)) == 2 * cfg.task.prompts_per_step * cfg.rollout.n
    assert all(m["policy/staleness_max"] <= 1 for m in read_metrics(run_dir)[half:])


FLAKY_REWARD = '''
def flaky(prompts, completions, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        if c.strip().endswith("7"):
            raise ValueError(f"refusing {c!r}")
        out.append(float(c.strip() == a))
    return out
'''


def test_zero3_two_ranks_sync_and_a_failing_user_reward(make_config, tmp_path):
    """ZeRO-3 over 2 DeepSpeed ranks with gradient accumulation, 2 epochs x 2 mini-batches, weights
    gathered and broadcast to 2 vLLM workers over one gloo group; a user reward file outside the repo raises for some
    samples: they are recorded, the run goes on."""
    reward_file = tmp_path / "outside" / "my_reward.py"
    reward_file.parent.mkdir()
    reward_file.write_text(FLAKY_REWARD)
    cfg = make_config(
        "run.steps=3", "trainer.zero_stage=3", "trainer.num_workers=2", "task.prompts_per_step=16",
        "rollout.num_workers=2",
        "algorithm.kl_coef=0.01", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
        "trainer.micro_batch_size=16", f'reward.functions=[{{fn: "{reward_file}:flaky"}}]',
    )
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 3
    assert all(m["actor/updates_count"] == 4 for m in metrics)  # 2 epochs x 2 mini-batches
    assert all(m["sync/logprob_abs_diff"] < 1e-3 for m in metrics)
    assert metrics[-1]["actor/kl_nats"] > 0  # the policy moved away from the reference...
    assert metrics[1]["sync/weights_mb"] > 0  # ...and vLLM sampled from the moved policy
    assert sum(m["reward/errors_count"] for m in metrics) > 0
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "samples.jsonl"))]
    errors = [r for r in rows if r["error"]]
    assert errors and all("ValueError: refusing" in r["error"] and r["reward"] is None for r in errors)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(os.path.join(cfg.run.dir, "final_model"))
    assert all(torch.isfinite(p).all() for p in saved.parameters())


def test_hf_backend_zero1_two_ranks_object_store_sync(make_config):
    """The transformers backend behind the same protocol, ZeRO-1, weights through the Ray object store."""
    cfg = make_config(
        "rollout=hf", "run.steps=2", "trainer.num_workers=2", "trainer.zero_stage=1",
        "trainer.weight_sync=object_store",
        "task.prompts_per_step=8", "run.save_final_model=false",
    )
    train(cfg)
    metrics = read_metrics(cfg.run.dir)
    assert len(metrics) == 2
    assert metrics[1]["sync/logprob_abs_diff"] < 1e-3
    assert 0 <= metrics[1]["reward/mean"] <= 1.1


@pytest.mark.full  # the Hub recipe: the full lane
def test_a_hub_id_in_the_cache_works_as_model_path(tiny_dir, tmp_path, monkeypatch):
    """The docs' recipe (docs/models-and-data.md): a Qwen2-architecture model (random
    init, its own config) put in a Hugging Face cache as `tiny-org/qwen2-tiny`, and the task's
    prompts as the Hub dataset `tiny-org/arith` (config `main`, parquet shards as the Hub keeps
    them), train through vLLM and DeepSpeed when model.path and task.train_files name their ids
    (offline; the run's checks resolve them to the cached snapshots, which every actor loads), as
    `python -m launch.train` does it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from launch.checks import check_inputs
    from rl.config.compose import compose
    from tests.hub_cache import add_snapshot, offline_cache

    tok = AutoTokenizer.from_pretrained(f"{tiny_dir}/model")
    folder = tmp_path / "qwen2-tiny"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    snapshot = add_snapshot(tmp_path / "hub", "tiny-org/qwen2-tiny", folder, "c" * 40)
    rows = [json.loads(line) for line in open(f"{tiny_dir}/data/train.jsonl")][:64]
    data = tmp_path / "arith"
    (data / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), data / "main" / "train-00000-of-00001.parquet")
    (data / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                    "    path: main/train-*\n---\n")
    add_snapshot(tmp_path / "hub", "tiny-org/arith", data, "d" * 40, kind="datasets")
    offline_cache(monkeypatch, tmp_path / "hub")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    overrides = ["model.path=tiny-org/qwen2-tiny", "task.train_files=[tiny-org/arith:main:train]",
                 f"run.dir={tmp_path}/run", "run.progress=false", "run.steps=2", "task.prompts_per_step=8"]
    cfg = compose("train", overrides)
    inputs, _ = check_inputs(cfg, overrides)
    assert cfg.model.path == str(snapshot)
    summary = train(cfg, inputs)
    metrics = read_metrics(cfg.run.dir)
    assert metrics[1]["sync/logprob_abs_diff"] < 1e-3  # tied embeddings survive the sync too
    from transformers import AutoModelForCausalLM

    assert isinstance(AutoModelForCausalLM.from_pretrained(summary["final_model"]), Qwen2ForCausalLM)
