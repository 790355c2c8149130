"""Issue 59 (3, 4): episodes whose prompt changes midway are trained in segments, and episodes that
fill the context end truncated with what they earned.

An OpenAI Agents SDK handoff between agents with `instructions` swaps the system message: the
call after it does not extend the one before. Driven here through the real agent server with the
real `openai` client (a scripted policy writes the model's turns): the episode is one Sample with
two segments, every sampled token is trained exactly once (one row per segment, both the
episode's, its reward counted once), and an assistant message the server did not sample is never
a trained token. Then a real agent in the real pool, run by `AgentRunner`, talks until the server
refuses a call for its context: the episode ends truncated with the agent's reward so far, marked
in the sample, its log row and the step's metrics (`agent/truncated_count`)."""

from __future__ import annotations

import textwrap

import openai
import pytest
import torch

from examples.calculator import calculator_tokenizer
from rl.data.agent_calls import episode_sample
from rl.data.batch import build_train_batch
from rl.data.types import GenerationRequest, Sample, ScoredSample
from rl.run.step_metrics import episode_metrics
from reward.agents.server import AgentServer

# the tiny calculator model's vocabulary: the two agents' instructions differ in their tokens
TRIAGE = "tool"
MATH = "calculator"
FORGED = "9*9"  # text the policy never writes


@pytest.fixture(scope="module")
def tok():
    return calculator_tokenizer()


def _scripted(tok, turns: list[str]):
    """A policy that writes `turns` in order (each ending with EOS)."""
    seen: list[GenerationRequest] = []

    def generate(request: GenerationRequest) -> Sample:
        seen.append(request)
        text = turns[(len(seen) - 1) % len(turns)]
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return Sample(request.prompt_ids, ids, [-0.25] * len(ids), "stop", 0, "", text, 0, 0)

    return generate


def _trained(batch, row: int) -> list[int]:
    """The tokens row `row` trains on (position t's loss is for token t+1)."""
    on = batch.loss_mask[row] > 0
    return batch.input_ids[row, 1:][on].tolist()


def test_a_handoff_that_swaps_the_system_message_is_a_second_segment_of_one_episode(tok):
    generate = _scripted(tok, ["7", "5", "5"])
    with AgentServer(tok, generate, max_new_tokens=16, temperature=1.0, top_p=1.0, max_model_len=256) as server:
        key, url = server.open_episode(seed_base=1)
        llm = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        user = {"role": "user", "content": "2+3"}
        triage = llm.chat.completions.create(model="policy", messages=[{"role": "system", "content": TRIAGE}, user])
        # the handoff: the SDK sends the conversation again under the next agent's instructions
        handed = [{"role": "system", "content": MATH}, user, triage.choices[0].message,
                  {"role": "user", "content": "call"}]
        math = llm.chat.completions.create(model="policy", messages=handed)
        # the math agent goes on, appending; the agent slips in an assistant turn the model never wrote
        llm.chat.completions.create(model="policy", messages=handed + [
            math.choices[0].message, {"role": "assistant", "content": FORGED}, {"role": "user", "content": "error"}])
        calls = server.close_episode(key)
    assert len(calls) == 3
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids)] != calls[0].prompt_ids  # the handoff does not extend

    sample = episode_sample(calls, prompt_text="2+3", group_id=4, sample_index=1, metadata={}, max_len=256,
                            decode=tok.decode)
    assert sample.error is None, sample.error
    [first] = sample.segments
    assert (first.prompt_ids, first.completion_ids) == (calls[0].prompt_ids, calls[0].completion_ids)
    assert first.completion_mask == [1] * len(calls[0].completion_ids)
    assert sample.prompt_ids == calls[1].prompt_ids and MATH in tok.decode(sample.prompt_ids)
    assert [t.role for t in sample.turns] == ["model", "observation", "model"]
    model = [i for i, m in zip(sample.completion_ids, sample.completion_mask) if m]
    assert model == calls[1].completion_ids + calls[2].completion_ids
    assert sample.completion_text == "5"

    # the learner's rows: the episode's own (its last segment), then its first segment; both its
    scored = [ScoredSample(sample, 1.0), ScoredSample(episode_sample(calls[:1], prompt_text="2+3", group_id=4,
                                                                     sample_index=0, metadata={}), 0.0)]
    batch = build_train_batch(scored, pad_id=0, version=0, segment_rows=True)
    assert len(batch) == 3 and batch.episode_index.tolist() == [0, 1, 0] and batch.group_ids.tolist() == [4, 4, 4]
    assert _trained(batch, 0) == calls[1].completion_ids + calls[2].completion_ids
    assert _trained(batch, 2) == calls[0].completion_ids
    sampled = sum(len(c.completion_ids) for c in calls)
    assert int(batch.loss_mask[[0, 2]].sum()) == sampled  # every sampled token trained exactly once
    assert torch.all(batch.rollout_logprobs[batch.loss_mask > 0] == -0.25)
    # the forged assistant turn is in the episode, but only where the loss does not look
    forged = tok(FORGED, add_special_tokens=False).input_ids
    assert FORGED in tok.decode(sample.completion_ids).replace(" ", "")
    assert not set(forged) & {t for r in (0, 2) for t in _trained(batch, r)}
    # without segment rows, the batch has one row per sample (the last segment), as before
    plain = build_train_batch(scored, pad_id=0, version=0)
    assert len(plain) == 2 and plain.episode_index is None
    # the sample log names the segment by its size and turns, not its ids
    row = ScoredSample(sample, 1.0).to_log()
    assert row["segments"][0]["completion_tokens"] == len(calls[0].completion_ids) and row["truncated"] is False
    assert episode_metrics([sample])["episode/turns_mean"] == 3.0  # the segment's turn counts


AGENT = '''
import openai


def solve(base_url, row):
    """Talks until the context is full; each answer earns 0.25: the reward so far when it stops."""
    llm = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages, earned = [{"role": "user", "content": row["prompt"]}], 0.0
    while True:
        try:
            reply = llm.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":
                return earned
            raise
        earned += 0.25
        messages += [reply.choices[0].message, {"role": "user", "content": "1+1"}]


def raises(base_url, row):
    """The same agent, letting the context refusal raise (as most agents do)."""
    llm = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = llm.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "1+1"}]
'''


class _NoRepairs:
    def repair(self) -> None:
        pass


@pytest.mark.slow  # the real agent pool (a zygote importing openai)
def test_an_agent_that_fills_the_context_ends_truncated_with_its_reward_so_far(tok, tmp_path):
    from reward.agents.pool import AgentLimits, AgentPool
    from reward.agents.runner import AgentRunner

    (tmp_path / "talker.py").write_text(textwrap.dedent(AGENT))
    samples = {}
    with AgentServer(tok, _scripted(tok, ["5"]), max_new_tokens=4, max_model_len=64) as server:
        for fn in ("solve", "raises"):
            pool = AgentPool(f"talker.py:{fn}", str(tmp_path), 1, AgentLimits(timeout_s=60),
                             endpoints=[(server.host, server.port, server.handoff_path)])
            runner = AgentRunner(server, pool, _NoRepairs(), name=f"talker.py:{fn}", prompt_key="prompt",
                                 timeout_s=60, workers=1, max_len=64, decode=tok.decode)
            try:
                [samples[fn]] = runner.run([GenerationRequest(prompt_ids=tok("2+3").input_ids, prompt_text="2+3",
                                                              group_id=0, sample_index=0, seed=1)])
            finally:
                runner.close()
    kept, raised = samples["solve"], samples["raises"]
    for s in (kept, raised):
        assert s.error is None and s.truncated, s.error
        turns = [t for t in s.turns if t.role == "model"]
        assert len(turns) > 3 and len(s.prompt_ids) + len(s.completion_ids) <= 64
    earned = 0.25 * sum(t.role == "model" for t in kept.turns)
    assert kept.turn_rewards() == [(kept.turns[-1].end - 1, earned)]  # what it had earned, on its last turn
    assert raised.turn_rewards() == []  # raised at the refusal: left to reward.functions (the task's rule)
    assert ScoredSample(kept, earned).to_log()["truncated"] is True
    assert episode_metrics([kept, raised])["agent/truncated_count"] == 2.0


def _call(prompt: list[int], completion: list[int], version: int):
    from rl.data.agent_calls import RecordedCall

    return RecordedCall(prompt, completion, [-0.1] * len(completion), [version] * len(completion), "stop",
                        f"t{version}", version)


def test_a_call_that_does_not_extend_starts_a_segment_and_max_len_cuts_each():
    calls = [_call([1, 2], [3, 4], 0), _call([1, 9, 3, 4, 5], [6], 1), _call([1, 9, 3, 4, 5, 6, 7], [8], 2)]
    s = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={})
    assert s.error is None and [(g.prompt_ids, g.completion_ids, g.completion_mask) for g in s.segments] == [
        ([1, 2], [3, 4], [1, 1])]
    assert (s.prompt_ids, s.completion_ids, s.completion_mask) == ([1, 9, 3, 4, 5], [6, 7, 8], [1, 0, 1])
    assert (s.policy_version, s.oldest_version(), s.token_versions) == (0, 0, [1, 1, 2])
    # each segment is cut to max_len on its own (its prompt is its own)
    short = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=6)
    assert short.error is None and short.finish_reason == "length"
    assert short.segments[0].completion_ids == [3, 4] and short.completion_ids == [6]
    over = episode_sample(calls, prompt_text="p", group_id=0, sample_index=0, metadata={}, max_len=1)
    assert "over max_len=1" in over.error
    one = episode_sample(calls[:1], prompt_text="p", group_id=0, sample_index=0, metadata={})
    assert one.segments is None and one.completion_ids == [3, 4]


def test_an_episode_in_two_segments_counts_once_in_its_group_and_both_rows_train():
    """Two episodes of one group: A (reward 1) in two segments, B (reward 0) in one. The batch has a
    row per segment (A's earlier segment after the samples' rows); GRPO sees each episode once
    (advantages +-1/sqrt(2) with the unbiased std of [1, 0]) and both of A's rows get A's; RLOO +-1."""
    import math

    import torch

    from rl.algo.estimate import estimate_advantages
    from rl.config.schema import AlgorithmConfig
    from rl.data.agent_calls import RecordedCall
    from rl.data.batch import build_train_batch
    from rl.data.types import ScoredSample
    from rl.run.scoring import reward_tensors

    def call(p, c):
        return RecordedCall(p, c, [-0.1] * len(c), [0] * len(c), "stop", "t", 0)

    a = episode_sample([call([1, 2], [3, 4]), call([1, 9, 3, 4], [5])], prompt_text="p", group_id=0, sample_index=0,
                       metadata={})
    b = episode_sample([call([1, 2], [6])], prompt_text="p", group_id=0, sample_index=1, metadata={})
    scored = [ScoredSample(a, 1.0), ScoredSample(b, 0.0)]
    batch = build_train_batch(scored, 0, 0, segment_rows=True)
    assert batch.episode_index.tolist() == [0, 1, 0]  # A's last part, B, then A's first segment
    reward, valid, groups = reward_tensors(scored)
    for advantage, magnitude in (("grpo", 1 / math.sqrt(2)), ("rloo", 1.0)):
        est = estimate_advantages(AlgorithmConfig(advantage=advantage), reward, valid, groups, batch.loss_mask,
                                  episode_index=batch.episode_index)
        per_row = (est.advantages * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)
        assert torch.allclose(per_row, torch.tensor([magnitude, -magnitude, magnitude]), atol=1e-6), (advantage, per_row)
