"""An agent's recorded model calls made into one training episode (docs/architecture.md "Agents",
"Episodes").

The agent server (`reward.agents.server`) records every call of one episode token-exactly: the
prompt ids it rendered, the ids the model sampled with their log-probs and policy versions. A
well-behaved agent only appends to its conversation, so each call's prompt is the previous call's
prompt + completion + new ids (tool results, user turns: the template's tokens, tokenized once).
That chain is one trajectory, the same `Sample` an in-process episode (`rl.data.episodes`) is: the
first prompt, then model turns (mask 1) and observation turns (mask 0, log-prob 0.0).

An agent that does not only append (an Agents SDK handoff swaps the system message, a framework
summarises or trims its context, switches agents or tools) breaks the chain: what the model was
conditioned on at that call is not a continuation of the trajectory so far. Never spliced, never
cut: that call starts a new segment of the same episode (`rl.data.types.Segment`), its prompt its
own and its tokens as sampled, trained with the episode's reward like the rest. An assistant
message the server did not sample is, wherever it appears, prompt or observation (mask 0).

Pure: stdlib and `rl.data.types` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rl.data.types import Sample, Segment, Turn


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


@dataclass
class _Part:
    """One segment being built: its prompt, then the tokens after it."""

    prompt: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[Turn]

    def add(self, role: str, ids: list[int], logprobs: list[float], versions: list[int], text: str) -> None:
        self.turns.append(Turn(role, len(self.ids), len(self.ids) + len(ids), text))
        self.ids += ids
        self.mask += [int(role == "model")] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def cut(self, max_len: int | None) -> bool:
        """Cut to `max_len` tokens in all (prompt included); True when something was cut."""
        if max_len is None or len(self.prompt) + len(self.ids) <= max_len:
            return False
        keep = max(0, max_len - len(self.prompt))
        self.ids, self.mask, self.logprobs, self.versions = (self.ids[:keep], self.mask[:keep],
                                                             self.logprobs[:keep], self.versions[:keep])
        self.turns = [Turn(t.role, t.start, min(t.end, keep), t.text, t.reward, t.info)
                      for t in self.turns if t.start < keep]
        return True


def episode_sample(calls: list[RecordedCall], *, prompt_ids: list[int] | tuple[int, ...] = (), prompt_text: str,
                   group_id: int, sample_index: int,
                   metadata: dict[str, Any] | None = None, max_len: int | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> Sample:
    """One episode's calls as one Sample (an episode, like `rl.data.episodes` makes).

    The prompt is the first call's prompt (`prompt_ids`, the request's, without calls); a later
    call that extends (previous prompt + previous completion) continues the segment: the ids in
    between become an observation turn (mask 0, log-prob 0.0, the version of the last model token
    before it), the completion a model turn (mask 1). A call that does not extend it starts a new
    segment with its own prompt; the earlier ones are the Sample's `segments`, the last is the
    Sample's own prompt and completion. No call at all is an error.
    `policy_version` is the oldest token's (versions only grow: the first model token's).
    `finish_reason` is the last call's; the episode's text is its last model turn's, as in
    `rl.data.episodes`. `decode` (a tokenizer's) gives observation turns their text; without, "".

    `max_len` (rollout.max_model_len): a segment longer than that (prompt + everything after) is
    cut to it, finish_reason "length". Cutting the tail is sound for a causal model: no kept token's
    log-prob depends on a dropped one; the episode simply ends where a context of that size would
    have ended it. A server that caps every call's prompt + max_tokens at max_model_len (the agent
    server does) never needs the cut. A first prompt already over `max_len` leaves nothing to train
    on: an error sample.
    """
    metadata = dict(metadata or {})
    if not calls:  # dated and shaped by the request's own prompt, so a batch of them is still a batch
        return Sample(list(prompt_ids), [], [], "stop", 0, prompt_text, "", group_id, sample_index, metadata,
                      completion_mask=[], turns=[], error="agent episode made no model call: nothing was "
                      "sampled at its base URL (did the agent use the episode's base_url?)", token_versions=[])
    parts: list[_Part] = []
    last_version = calls[0].policy_version
    for call in calls:
        part = parts[-1] if parts else None
        head = part.prompt + part.ids if part else None
        if head is None or call.prompt_ids[: len(head)] != head:  # a new segment: the prompt changed
            part = _Part(list(call.prompt_ids), [], [], [], [], [])
            parts.append(part)
        else:
            obs = list(call.prompt_ids[len(head):])
            if obs:
                part.add("observation", obs, [0.0] * len(obs), [last_version] * len(obs), decode(obs) if decode else "")
        if call.completion_ids:
            part.add("model", list(call.completion_ids), list(call.logprobs), list(call.token_versions),
                     call.completion_text)
            last_version = call.token_versions[-1]
        else:
            last_version = call.policy_version
    finish = calls[-1].finish_reason
    if any([part.cut(max_len) for part in parts]):
        finish = "length"
    error = None
    if max_len is not None and len(parts[0].prompt) > max_len:
        error = (f"agent episode's first prompt is {len(parts[0].prompt)} tokens, over max_len={max_len} "
                 "(rollout.max_model_len): nothing of it fits")
    last = parts[-1]
    model_turns = [t for p in parts for t in p.turns if t.role == "model"]
    versions = [v for p in parts for v in p.versions]
    segments = [Segment(p.prompt, p.ids, p.logprobs, p.mask, p.versions, p.turns) for p in parts[:-1]]
    return Sample(prompt_ids=last.prompt, completion_ids=last.ids, logprobs=last.logprobs, finish_reason=finish,
                  policy_version=min(versions, default=calls[0].policy_version), prompt_text=prompt_text,
                  completion_text=model_turns[-1].text if model_turns else "", group_id=group_id,
                  sample_index=sample_index, metadata=metadata, completion_mask=last.mask, turns=last.turns,
                  error=error, token_versions=last.versions, segments=segments or None)
