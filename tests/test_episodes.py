"""Multi-turn episodes: the runner's bookkeeping (token ids, masks, turns, limits), observation
tokens through a real chat template, environment failures in real Ray actors, and token
exactness against the rollout engine's own log-probs across a 3-turn episode."""

from __future__ import annotations

import os

import pytest
import torch

from rl.data.batch import build_train_batch
from rl.data.env import StepResult
from rl.data.episodes import Limits, ObservationEncoder, run_episodes, with_episode_rewards
from rl.run.evaluate import eval_metrics, pass_at_k
from rl.data.types import GenerationRequest, Sample, ScoredSample

HERE = os.path.dirname(os.path.abspath(__file__))
ENVS = os.path.join(HERE, "episode_envs.py")


class InProcessEnvs:
    """The `rl.data.episodes.Envs` protocol over environment objects in this process (the runner's
    unit tests; the Ray service is tested below)."""

    def __init__(self, make):
        self.make, self.envs = make, {}

    def reset(self, keys, rows):
        for k, row in zip(keys, rows):
            self.envs[k] = self.make()
            getattr(self.envs[k], "reset", lambda row: None)(row)
        return {k: None for k in keys}

    def step(self, keys, texts, token_ids):
        return {k: self.envs[k].step(t, ids) for k, t, ids in zip(keys, texts, token_ids)}

    def close(self, keys):
        for k in keys:
            self.envs.pop(k)


def scripted(turn_ids):
    """A generate function answering every request with `turn_ids` (log-prob -0.5 each),
    stopping at EOS 2 or the request's budget."""
    def generate(requests):
        out = []
        for r in requests:
            ids = turn_ids[: r.max_tokens]
            out.append(Sample(r.prompt_ids, ids, [-0.5] * len(ids), "stop" if ids[-1] == 2 else "length", 3,
                              r.prompt_text, f"turn{len(r.prompt_ids)}", r.group_id, r.sample_index, r.metadata))
        return out
    return generate


class Plain:
    """A tokenizer without a chat template: each character's code is its id."""
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()


def request(prompt_ids=(1, 5, 6), seed=11):
    return GenerationRequest(list(prompt_ids), "56", group_id=0, sample_index=0, seed=seed, metadata={"answer": "x"})


def test_an_episode_is_the_sampled_tokens_and_the_observation_tokens_with_a_model_only_mask():
    from tests.episode_envs import KeepGoing

    limits = Limits(max_turns=3, max_new_tokens=8, max_episode_tokens=100, max_model_len=100)
    (s,) = run_episodes([request()], scripted([7, 8, 2]), InProcessEnvs(lambda: KeepGoing(obs="ab")),
                        ObservationEncoder(Plain(), chat=False), limits)
    # three model turns [7, 8, 2] with the observation "ab" = [97, 98] between them, none after the last
    assert s.completion_ids == [7, 8, 2, 97, 98, 7, 8, 2, 97, 98, 7, 8, 2]
    assert s.completion_mask == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert s.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3
    assert [(t.role, t.start, t.end) for t in s.turns] == [
        ("model", 0, 3), ("observation", 3, 5), ("model", 5, 8), ("observation", 8, 10), ("model", 10, 13)]
    assert [t.reward for t in s.turns if t.role == "model"] == [3.0, 3.0, 3.0]
    assert s.turn_rewards() == [(2, 3.0), (7, 3.0), (12, 3.0)]
    assert s.prompt_ids == [1, 5, 6] and s.policy_version == 3 and s.error is None
    # the learner's batch: loss on model tokens only, each turn's reward on its last model token
    (scored,) = with_episode_rewards([s], None)
    assert scored.reward == 9.0 and scored.components == {"env": 9.0}
    batch = build_train_batch([scored], pad_id=0, version=3)
    p = len(s.prompt_ids) - 1  # completion token j is predicted at position p + j
    assert batch.loss_mask[0, p:].tolist() == s.completion_mask
    assert batch.loss_mask[0, :p].sum() == 0
    assert batch.rollout_logprobs[0, p:].tolist() == s.logprobs
    assert torch.nonzero(batch.turn_rewards[0]).flatten().tolist() == [p + 2, p + 7, p + 12]


def test_the_token_budget_ends_an_episode_and_cuts_its_last_turn():
    from tests.episode_envs import KeepGoing

    limits = Limits(max_turns=5, max_new_tokens=8, max_episode_tokens=7, max_model_len=100)
    (s,) = run_episodes([request()], scripted([7, 8, 2]), InProcessEnvs(lambda: KeepGoing(obs="ab")),
                        ObservationEncoder(Plain(), chat=False), limits)
    # 3 model + 2 observation tokens leave 2 for the second turn, which is cut there: "length"
    assert s.completion_ids == [7, 8, 2, 97, 98, 7, 8] and s.finish_reason == "length"
    assert len(s.turns) == 3


def test_a_failing_environment_costs_its_episode_only():
    from tests.episode_envs import Moody

    limits = Limits(max_turns=2, max_new_tokens=4, max_episode_tokens=50, max_model_len=50)

    class Catching(InProcessEnvs):  # what EnvWorker does: an exception is that episode's answer
        def step(self, keys, texts, token_ids):
            out = {}
            for k, t, ids in zip(keys, texts, token_ids):
                try:
                    out[k] = self.envs[k].step(t, ids)
                    out[k] = out[k].send(None) if hasattr(out[k], "send") else out[k]
                except StopIteration as done:
                    out[k] = done.value
                except Exception as exc:
                    out[k] = f"{type(exc).__name__}: {exc}"
            return out

    reqs = [GenerationRequest([1], p, i, 0, i, {}) for i, p in enumerate(["12", "67"])]
    samples = run_episodes(reqs, scripted([7, 2]), Catching(Moody), ObservationEncoder(Plain(), chat=False), limits)
    assert samples[0].error == "environment step 1: KeyError: 'boom'"
    assert samples[1].error is None and samples[1].turn_rewards() == [(1, 1.0)]
    scored = with_episode_rewards(samples, None)
    assert scored[0].reward is None and scored[0].error.startswith("environment step 1")
    assert scored[1].reward == 1.0


def test_episode_rewards_add_to_the_reward_functions_and_a_failed_function_is_never_a_zero():
    s = Sample([1], [5, 2], [-1.0, -1.0], "stop", 0, "p", "c", 0, 0, completion_mask=[1, 1], turns=[])
    from rl.data.types import Turn

    s.turns = [Turn("model", 0, 2, "c", reward=0.5)]
    ok = ScoredSample(s, 2.0, {"f": 2.0})
    failed = ScoredSample(s, None, {"f": None}, error="f: ValueError: x")
    assert with_episode_rewards([s], [ok])[0].reward == 2.5
    assert with_episode_rewards([s], [failed])[0].error == "f: ValueError: x"
    s.turns[0].reward = None
    assert with_episode_rewards([s], None)[0].error.startswith("no reward")


def test_chat_observations_are_the_template_s_own_tokens_and_are_cut_to_the_cap():
    from examples.tiny import build_tokenizer

    tok = build_tokenizer(["12+34+56=102 error"], chat=True, model_max_length=256)
    user = [{"role": "user", "content": "12+34"}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    turn = tok("46", add_special_tokens=False).input_ids + [tok.eos_token_id]  # what the model samples
    encode = ObservationEncoder(tok, chat=True, role="tool", cap=64)
    obs = encode("46")
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "46"}, {"role": "tool", "content": "46"}],
                                    add_generation_prompt=True, tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert prompt + turn + obs == whole  # the episode is the template rendering of the conversation
    assert tok.convert_ids_to_tokens(obs) == ["<|tool|>", "4", "6", "<|end|>", "<|assistant|>"]
    capped = ObservationEncoder(tok, chat=True, role="tool", cap=6)("1234567890")
    # the content is cut, the template's own tokens around it stay: 3 of them + 3 digits
    assert tok.convert_ids_to_tokens(capped) == ["<|tool|>", "1", "2", "3", "<|end|>", "<|assistant|>"]
    with pytest.raises(ValueError, match="chat_template=false"):
        ObservationEncoder(Plain(), chat=False)([{"role": "tool", "content": "x"}])


# A ChatML-style template (the layout Qwen-style models use): a newline after each turn's end
# token, tool answers rendered as a user turn wrapped in <tool_response> tags.
CHATML_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|{{ 'user' if m['role'] == 'tool' else m['role'] }}|>\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>{% else %}{{ m['content'] }}"
    "{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_what_a_template_writes_after_the_end_of_turn_token_belongs_to_the_observation():
    """The model's turn stops at its EOS; the template's newline after it is not the model's, so
    it opens the observation: the episode is still exactly the template's rendering."""
    from examples.tiny import build_tokenizer

    tok = build_tokenizer(["12+34", "46", "\n"], chat=True, model_max_length=256)
    tok.chat_template = CHATML_LIKE
    user = [{"role": "user", "content": "12+34"}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"]
    turn = tok("46", add_special_tokens=False).input_ids + [tok.eos_token_id]
    obs = ObservationEncoder(tok, chat=True, role="tool", cap=64)("46")
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "46"}, {"role": "tool", "content": "46"}],
                                    add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompt + turn + obs == whole
    assert tok.convert_ids_to_tokens(obs)[:2] == ["\n", "<|user|>"]


def test_pass_at_k_and_eval_figures_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2) / C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0

    def scored(group, reward):
        s = Sample([1], [2], [0.0], "stop", 0, "p", "c", group, 0)
        return ScoredSample(s, reward, error=None if reward is not None else "x")

    greedy = [scored(0, 1.1), scored(1, 0.1)]
    sampled = [scored(0, 1.0), scored(0, 0.0), scored(1, None), scored(1, 0.0)]
    m = eval_metrics(greedy, sampled, n=2, threshold=1.0)
    assert m["eval/greedy_pass_frac"] == 0.5 and m["eval/greedy_mean_reward"] == pytest.approx(0.6)
    assert m["eval/sampled_mean_reward"] == 0.25 and m["eval/errors_count"] == 1
    assert m["eval/pass_at_1"] == pytest.approx((0.5 + 0.0) / 2) and m["eval/pass_at_2"] == pytest.approx(0.5)


# ---- real Ray actors ------------------------------------------------------------------------------


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_environment_workers_record_raises_hangs_and_bad_answers_per_episode(ray_local):
    """Real EnvService actors, loading the class by path: each misbehaving episode gets its own
    error and the others their answers; a hang costs env_timeout_s, not the step."""
    import time

    from reward.envs import EnvService

    envs = EnvService(f"{ENVS}:Moody", {}, num_workers=2, timeout_s=2.0)
    try:
        keys = [0, 1, 2, 3, 4, 5]
        rows = [{"prompt": p} for p in ("12", "23", "34", "45", "56", "67")]
        reset = envs.reset(keys, rows)
        assert reset[4] == "RuntimeError: no such row" and all(reset[k] is None for k in (0, 1, 2, 3, 5))
        t0 = time.monotonic()
        out = envs.step([0, 1, 2, 3, 5], ["x"] * 5, [[7, 2]] * 5)
        took = time.monotonic() - t0
        envs.close(keys)
    finally:
        envs.shutdown()
    assert out[0] == "KeyError: 'boom'"
    assert out[1] == "no answer within task.env_timeout_s=2 s"
    assert out[2].startswith("MalformedStep: step returned str")
    assert out[3].startswith("MalformedStep: step returned an observation of type int")
    assert out[5] == StepResult(None, 1.0, True, {})
    assert took < 10, took


def test_a_bad_environment_name_fails_before_any_episode(ray_local):
    from reward.envs import EnvService
    from reward.loader import RewardLoadError

    with pytest.raises(RewardLoadError, match=r"task.env=.*has no attribute 'Nope'"):
        EnvService(f"{ENVS}:Nope", {}, num_workers=1)


@pytest.mark.slow
def test_three_turn_episode_log_probs_of_every_model_token_match_the_learner_s(ray_local, tiny_dir):
    """vLLM samples three turns (observations between them tokenized once); the learner-side
    forward over the whole trajectory gives every model token the rollout's log-prob (fp32,
    the same bound as single-turn samples)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reward.envs import EnvService
    from rl.config.schema import ModelConfig, RolloutConfig
    from rollout.fleet import RolloutFleet
    from rollout.protocol import RolloutSpec
    from rollout.vllm_engine import vllm_env
    from trainer.logprobs import token_logprobs

    tok = AutoTokenizer.from_pretrained(f"{tiny_dir}/model")
    rollout = RolloutConfig(backend="vllm", num_workers=1, max_new_tokens=6, max_model_len=64, kv_cache_gib=1)
    fleet = RolloutFleet(RolloutSpec(ModelConfig(path=f"{tiny_dir}/model"), rollout, seed=0, threads=1),
                         env_vars={"OMP_NUM_THREADS": "1", **vllm_env(1, 1)})
    envs = EnvService(f"{ENVS}:KeepGoing", {"obs": "+1="}, num_workers=1, timeout_s=10)
    try:
        reqs = [GenerationRequest(tok(p).input_ids, p, i, k, 100 * i + k, {}) for i, p in enumerate(["37+25=", "61+18="])
                for k in range(2)]
        samples = run_episodes(reqs, fleet.generate, envs, ObservationEncoder(tok, chat=False),
                               Limits(max_turns=3, max_new_tokens=6, max_episode_tokens=40, max_model_len=64))
    finally:
        envs.shutdown()
        fleet.shutdown()
    model = AutoModelForCausalLM.from_pretrained(f"{tiny_dir}/model", dtype=torch.float32).eval()
    for s in samples:
        assert s.error is None and [t.role for t in s.turns] == ["model", "observation"] * 2 + ["model"]
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        learner = lp[0, len(s.prompt_ids) - 1:]
        mine = torch.tensor(s.completion_mask, dtype=torch.bool)
        assert learner[mine].tolist() == pytest.approx([x for x, m in zip(s.logprobs, s.completion_mask) if m],
                                                       abs=1e-4)
        # the observations are the tokens of "+1=" as tokenized once, never the model's
        for t in s.turns:
            if t.role == "observation":
                assert s.completion_ids[t.start:t.end] == tok("+1=", add_special_tokens=False).input_ids



def test_a_thinking_template_that_drops_earlier_reasoning_keeps_the_episode_token_exact():
    """Qwen3's template writes an earlier turn's `<think>` block out of the conversation once a
    later turn follows. The episode is not re-rendered: each turn's prompt is the previous prompt
    + the sampled ids (reasoning included) + the observation's own tokens, exactly what vLLM was
    given; the learner trains on that sequence, which a re-rendering would not reproduce."""
    from tests.episode_envs import KeepGoing

    from tests.arch_zoo import thinking_tokenizer

    tok = thinking_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    turn = ids("<think>\nr r\n</think>\n\n46") + [tok.eos_token_id]  # what the model samples
    # (both roles were refused before: the template renders the turn before them differently)
    tool = ObservationEncoder(tok, chat=True, role="tool", cap=64)
    assert tool("ok") == ids("\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n")
    # a user turn starts a new query: from then on the template drops the earlier turn's reasoning
    encode = ObservationEncoder(tok, chat=True, role="user", cap=64)
    assert encode("ok") == ids("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")

    user = [{"role": "user", "content": "12+34"}]
    prompt = list(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"])
    seen: list[list[int]] = []

    def generate(requests):
        seen.extend(list(r.prompt_ids) for r in requests)
        return scripted(turn)(requests)

    limits = Limits(max_turns=2, max_new_tokens=16, max_episode_tokens=200, max_model_len=256)
    (s,) = run_episodes([request(prompt)], generate, InProcessEnvs(lambda: KeepGoing(obs="ok")), encode, limits)
    obs = encode("ok")
    assert s.error is None and s.completion_ids == turn + obs + turn
    assert s.completion_mask == [1] * len(turn) + [0] * len(obs) + [1] * len(turn)
    assert seen == [prompt, prompt + turn + obs]  # turn 2 was conditioned on turn 1's reasoning
    # the template's own rendering of the same conversation drops that reasoning: not what was seen
    history = user + [{"role": "assistant", "content": tok.decode(turn[:-1])}, {"role": "user", "content": "ok"}]
    rendered = list(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert rendered != seen[1] and tok.convert_tokens_to_ids("<think>") not in rendered
    assert seen[1].count(tok.convert_tokens_to_ids("<think>")) == 1
