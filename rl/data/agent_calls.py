"""An agent's recorded model calls made into one training episode (docs/architecture.md "Agents",
"Episodes").

The agent server (`reward.agents.server`) records every call of one episode token-exactly: the
prompt ids it rendered, the ids the model sampled with their log-probs and policy versions. A
well-behaved agent only appends to its conversation, so each call's prompt is the previous call's
prompt + completion + new ids (tool results, user turns: the template's tokens, tokenized once).
That chain is one trajectory, the same `Sample` an in-process episode (`rl.data.episodes`) is: the
first prompt, then model turns (mask 1) and observation turns (mask 0, log-prob 0.0).

An agent that rewrites its history (drops or edits earlier messages, summarises its context,
changes its tools) breaks the chain: what the model was conditioned on at that call is not a
continuation of the trajectory so far. The episode is then cut before that call and marked with an
error (the loop does not train on it), never silently spliced.

Pure: stdlib and `rl.data.types` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rl.data.types import Sample, Turn


@dataclass
class RecordedCall:
    """One model call as served: the exact ids in and out, and who sampled them."""

    prompt_ids: list[int]
    completion_ids: list[int]  # as sampled (EOS included when the model stopped)
    logprobs: list[float]  # one per completion token, under the sampling distribution
    token_versions: list[int]  # policy version that sampled each completion token
    finish_reason: str  # the engine's: "stop" (EOS) or "length" (hit max_tokens)
    completion_text: str
    policy_version: int = 0  # the engine's version for the call (dates an empty completion)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise ValueError(f"RecordedCall has {n} completion tokens but {len(self.logprobs)} logprobs and "
                             f"{len(self.token_versions)} token versions")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def episode_sample(calls: list[RecordedCall], *, prompt_ids: list[int] | tuple[int, ...] = (), prompt_text: str,
                   group_id: int, sample_index: int,
                   metadata: dict[str, Any] | None = None, max_len: int | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> Sample:
    """One episode's calls as one Sample (an episode, like `rl.data.episodes` makes).

    The prompt is the first call's prompt (`prompt_ids`, the request's, without calls); each later
    call must extend (previous prompt + previous
    completion): the ids in between become an observation turn (mask 0, log-prob 0.0, the version of
    the last model token before it), the completion a model turn (mask 1). A call that does not
    extend it cuts the episode there, with `error` saying so; no call at all is an error too.
    `policy_version` is the oldest token's (versions only grow: the first model token's).
    `finish_reason` is the last call's; the episode's text is its last model turn's, as in
    `rl.data.episodes`. `decode` (a tokenizer's) gives observation turns their text; without, "".

    `max_len` (rollout.max_model_len): a trajectory longer than that (prompt + everything after) is
    cut to it, finish_reason "length". Cutting the tail is sound for a causal model: no kept token's
    log-prob depends on a dropped one; the episode simply ends where a context of that size would
    have ended it. A server that caps every call's prompt + max_tokens at max_model_len (the agent
    server does) never needs the cut: the trajectory is the last call's prompt + completion. A first
    prompt already over `max_len` leaves nothing to train on: an error sample.
    """
    metadata = dict(metadata or {})
    if not calls:  # dated and shaped by the request's own prompt, so a batch of them is still a batch
        return Sample(list(prompt_ids), [], [], "stop", 0, prompt_text, "", group_id, sample_index, metadata,
                      completion_mask=[], turns=[], error="agent episode made no model call: nothing was "
                      "sampled at its base URL (did the agent use the episode's base_url?)", token_versions=[])
    prompt = list(calls[0].prompt_ids)
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    turns: list[Turn] = []
    error: str | None = None
    finish = calls[0].finish_reason
    last_version = calls[0].policy_version
    for i, call in enumerate(calls):
        if i:
            head = prompt + ids
            if call.prompt_ids[: len(head)] != head:
                at = _first_difference(call.prompt_ids, head)
                error = (f"agent rewrote its history: call {i}'s prompt ({len(call.prompt_ids)} tokens) does not "
                         f"extend call {i - 1}'s prompt + completion ({len(head)} tokens; first difference at "
                         f"token {at}), so calls {i}..{len(calls) - 1} are not one trajectory; the episode is cut "
                         "before it. Append to the conversation (send back the assistant message as returned) "
                         "instead of editing, dropping or summarising earlier messages")
                break
            obs = list(call.prompt_ids[len(head):])
            if obs:
                turns.append(Turn("observation", len(ids), len(ids) + len(obs), decode(obs) if decode else ""))
                ids += obs
                mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)
                versions += [last_version] * len(obs)
        if call.completion_ids:
            turns.append(Turn("model", len(ids), len(ids) + len(call.completion_ids), call.completion_text))
            ids += call.completion_ids
            mask += [1] * len(call.completion_ids)
            logprobs += call.logprobs
            versions += call.token_versions
            last_version = call.token_versions[-1]
        else:
            last_version = call.policy_version
        finish = call.finish_reason
    if max_len is not None and len(prompt) + len(ids) > max_len:
        keep = max_len - len(prompt)
        if keep < 0:
            error = error or (f"agent episode's first prompt is {len(prompt)} tokens, over max_len={max_len} "
                              "(rollout.max_model_len): nothing of it fits")
            keep = 0
        ids, mask, logprobs, versions = ids[:keep], mask[:keep], logprobs[:keep], versions[:keep]
        turns = [Turn(t.role, t.start, min(t.end, keep), t.text, t.reward, t.info) for t in turns if t.start < keep]
        finish = "length"
    model_turns = [t for t in turns if t.role == "model"]
    return Sample(prompt_ids=prompt, completion_ids=ids, logprobs=logprobs, finish_reason=finish,
                  policy_version=min(versions, default=calls[0].policy_version), prompt_text=prompt_text,
                  completion_text=model_turns[-1].text if model_turns else "", group_id=group_id,
                  sample_index=sample_index, metadata=metadata, completion_mask=mask, turns=turns, error=error,
                  token_versions=versions)
