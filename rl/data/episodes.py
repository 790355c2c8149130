"""Multi-turn episodes, kept as token ids from start to end (docs/architecture.md "Episodes").

A turn is one generation request whose prompt is the whole episode so far, recorded as a model
call exactly as an agent's calls are (`rl.data.agent_calls`: an environment is an agent the
framework drives), and the trajectory is built from those calls by the same `episode_sample`: the
sampled ids appended exactly as generated (with their log-probs), the environment's answer
tokenized once and appended with mask 0. Nothing decoded is ever tokenized again, so the learner
trains on the very tokens the rollout sampled, and its loss mask covers the model's tokens only.

Pure code over two small protocols (a `generate` function and `Envs`); the Ray side is
`reward.envs.EnvService`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rl.data.dataset import derive_seed
from rl.data.env import Observation, StepResult
from rl.data.agent_calls import RecordedCall, episode_sample
from rl.data.types import GenerationRequest, Sample, ScoredSample


class Envs(Protocol):
    """Environments by episode key. `reset` and `step` return, per key, None or the StepResult,
    or the error (a string) that ends that episode."""

    def reset(self, keys: list[int], rows: list[dict[str, Any]]) -> dict[int, str | None]: ...
    def step(self, keys: list[int], texts: list[str], token_ids: list[list[int]]) -> dict[int, StepResult | str]: ...
    def close(self, keys: list[int]) -> None: ...


@dataclass
class Limits:
    max_turns: int  # model turns
    max_new_tokens: int  # per model turn
    max_episode_tokens: int  # model + observation tokens after the prompt
    max_model_len: int  # prompt + episode


class ObservationEncoder:
    """An observation's token ids, tokenized once. With a chat template, text becomes a message
    of `role` and messages are rendered as the template renders them after an assistant turn
    (with the generation prompt of the next one); without, text is tokenized as it is. An
    observation over `cap` tokens has its (last message's) content cut to fit.

    The observation is what the template writes after the assistant turn's end-of-turn token.
    Templates that rewrite earlier turns once a later one follows (Qwen3 drops an earlier turn's
    `<think>` block, and writes an empty one into the last turn) render the turns before it
    differently; only the tokens after that end-of-turn token are taken, so the episode keeps
    the tokens the model saw (its own reasoning included) and is never re-rendered."""

    _BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer: Any, chat: bool, role: str = "tool", cap: int = 64):
        self.tokenizer, self.chat, self.role, self.cap = tokenizer, chat, role, cap
        if chat:
            prefix = self._render(self._BASE, generation_prompt=False)
            eos = tokenizer.eos_token_id
            if eos not in prefix:
                raise ValueError("task.chat_template=true but the tokenizer's chat template does not end an assistant "
                                 "turn with its EOS token; set task.chat_template=false or fix the template")
            # the model's turn ends at EOS: what the template puts after it belongs to the observation
            self._turn_ends = prefix.count(eos)  # EOS tokens up to and including the assistant turn's
            self._check_role()

    def _check_role(self) -> None:
        """The template must render a text observation's role with its content (some templates
        raise on roles they do not know, others drop them silently)."""
        fix = ("set task.observation_role to a role the template renders (tool or user), or use a model whose "
               "template has that role")
        try:  # two contents of different lengths (any tokenizer, unknown words too, tells them apart)
            short, long = (self._ids([{"role": self.role, "content": text}]) for text in ("1", "2 2 2 2"))
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError, the template's own raise_exception...
            raise ValueError(f"task.observation_role={self.role!r}: the tokenizer's chat template cannot render a "
                             f"{self.role!r} message ({type(err).__name__}: {err}); {fix}") from None
        if short == long:
            raise ValueError(f"task.observation_role={self.role!r}: the tokenizer's chat template drops "
                             f"{self.role!r} messages, so the model would never see an observation; {fix}")

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def _ids(self, messages: list[dict[str, Any]]) -> list[int]:
        full = self._render(self._BASE + messages, generation_prompt=True)
        ends = [i for i, t in enumerate(full) if t == self.tokenizer.eos_token_id]
        if len(ends) < self._turn_ends:
            raise ValueError("the chat template no longer ends the assistant turn with its EOS token once an "
                             "observation follows, so the observation's tokens cannot be told apart; set "
                             "task.chat_template=false or use a template that closes every assistant turn with EOS")
        return full[ends[self._turn_ends - 1] + 1:]

    def __call__(self, obs: Observation) -> list[int]:
        if obs is None or obs == "" or obs == []:
            return []
        if not self.chat:
            if not isinstance(obs, str):
                raise ValueError("the environment returned chat messages but task.chat_template=false; "
                                 "return text, or set task.chat_template=true")
            return list(self.tokenizer(obs, add_special_tokens=False).input_ids)[: self.cap]
        messages = [{"role": self.role, "content": obs}] if isinstance(obs, str) else [dict(m) for m in obs]
        ids = self._ids(messages)
        if len(ids) <= self.cap:
            return ids
        content = self.tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids
        keep = max(0, len(content) - (len(ids) - self.cap))
        while True:  # the template's own tokens around the content stay whole
            messages[-1]["content"] = self.tokenizer.decode(content[:keep])
            ids = self._ids(messages)
            if len(ids) <= self.cap or keep == 0:
                return ids[: self.cap] if keep == 0 else ids
            keep -= 1


@dataclass(eq=False)
class _Episode:
    """An episode in progress: its model calls as recorded (the same record an agent's calls get,
    `rl.data.agent_calls`), and what the environment said after each."""

    request: GenerationRequest
    calls: list[RecordedCall] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token after the prompt so far
    rewards: list[float | None] = field(default_factory=list)  # per call
    infos: list[dict[str, Any]] = field(default_factory=list)  # per call
    observations: list[str] = field(default_factory=list)  # the text of each observation appended
    error: str | None = None
    done: bool = False
    cut: bool = False  # ended by its token budget

    def call(self, out: Sample) -> None:
        """Record one model call: its prompt is the whole episode so far."""
        versions = out.token_versions or [out.policy_version] * len(out.completion_ids)
        self.calls.append(RecordedCall(list(self.request.prompt_ids) + self.ids, list(out.completion_ids),
                                       list(out.logprobs), list(versions), out.finish_reason, out.completion_text,
                                       out.policy_version))
        self.ids += out.completion_ids
        self.rewards.append(None)
        self.infos.append({})

    def sample(self) -> Sample:
        """The calls as one token-exact trajectory (`episode_sample`), with the environment's
        rewards on the model turns and its texts on the observations."""
        r = self.request
        s = episode_sample(self.calls, prompt_ids=r.prompt_ids, prompt_text=r.prompt_text, group_id=r.group_id,
                           sample_index=r.sample_index, metadata=r.metadata)
        model = [t for t in s.turns or () if t.role == "model"]
        for turn, i in zip(model, [i for i, c in enumerate(self.calls) if c.completion_ids]):
            turn.reward, turn.info = self.rewards[i], self.infos[i]
        for turn, text in zip([t for t in s.turns or () if t.role == "observation"], self.observations):
            turn.text = text
        if self.cut:
            s.finish_reason = "length"
        s.error = self.error or s.error
        return s


class Episodes:
    """What the loop holds to run episodes: the environments, the observation encoder, the limits,
    and a counter that keeps episode keys unique across batches (asynchronous rollouts and
    evaluation run batches side by side)."""

    def __init__(self, envs: Envs, encode: ObservationEncoder, limits: Limits, prompt_key: str = "prompt"):
        self.envs, self.encode, self.limits, self.prompt_key = envs, encode, limits, prompt_key
        self._next_key, self._lock = 0, threading.Lock()

    def run(self, requests: list[GenerationRequest],
            generate: Callable[[list[GenerationRequest]], list[Sample]]) -> list[Sample]:
        with self._lock:  # the rollout pipeline's thread and evaluation may both start batches
            first, self._next_key = self._next_key, self._next_key + len(requests)
        return run_episodes(requests, generate, self.envs, self.encode, self.limits, first, self.prompt_key)


def run_episodes(requests: list[GenerationRequest], generate: Callable[[list[GenerationRequest]], list[Sample]],
                 envs: Envs, encode: ObservationEncoder, limits: Limits, first_key: int = 0,
                 prompt_key: str = "prompt") -> list[Sample]:
    """One episode per request, all turns batched: each turn generates for every live episode at
    once, then every environment answers. An episode ends when its environment says done, after
    `max_turns` model turns (the environment still rewards the last one), when its token budget
    is spent (finish_reason "length"), or with the error its environment raised. Episode keys are
    `first_key + index` (unique among episodes in flight). The trajectory ends at the last model
    turn (an observation after it is never seen by the model)."""
    episodes = {first_key + i: _Episode(r) for i, r in enumerate(requests)}
    for key, err in envs.reset(list(episodes), [{prompt_key: e.request.prompt_text, **e.request.metadata}
                                                for e in episodes.values()]).items():
        if err is not None:
            episodes[key].error, episodes[key].done = f"environment reset: {err}", True
    try:
        for turn in range(limits.max_turns):
            live = {k: e for k, e in episodes.items() if not e.done and _budget(e, limits) > 0}
            for e in episodes.values():
                if not e.done and e not in live.values():
                    e.done, e.cut = True, True
            if not live:
                break
            asks = [GenerationRequest(e.request.prompt_ids + e.ids, e.request.prompt_text, e.request.group_id,
                                      e.request.sample_index, derive_seed(e.request.seed, turn), e.request.metadata,
                                      max_tokens=min(limits.max_new_tokens, _budget(e, limits)),
                                      temperature=e.request.temperature) for e in live.values()]
            for e, out in zip(live.values(), generate(asks)):
                if out.error is not None:  # the engine refused the turn: it ends this episode only
                    e.error, e.done = f"model call {len(e.calls) + 1}: {out.error}", True
                else:
                    e.call(out)
            live = {k: e for k, e in live.items() if not e.done}
            if not live:
                continue
            answers = envs.step(list(live), [e.calls[-1].completion_text for e in live.values()],
                                [e.calls[-1].completion_ids for e in live.values()])
            for key, e in live.items():
                _answer(e, answers.get(key, "no answer"), turn + 1 == limits.max_turns, encode, limits)
    finally:
        envs.close(list(episodes))
    return [e.sample() for e in episodes.values()]


def _budget(e: _Episode, limits: Limits) -> int:
    return min(limits.max_episode_tokens - len(e.ids), limits.max_model_len - len(e.request.prompt_ids) - len(e.ids))


def _answer(e: _Episode, answer: StepResult | str, last_turn: bool, encode: ObservationEncoder,
            limits: Limits) -> None:
    if isinstance(answer, str):
        e.error, e.done = f"environment step {len(e.calls)}: {answer}", True
        return
    e.rewards[-1], e.infos[-1] = answer.reward, answer.info
    if answer.done or last_turn:
        e.done = True
        return
    try:
        obs = encode(answer.observation)
    except ValueError as err:
        e.error, e.done = f"observation: {err}", True
        return
    obs = obs[: max(0, _budget(e, limits))]
    if obs:
        e.ids += obs
        e.observations.append(answer.observation if isinstance(answer.observation, str) else
                              "\n".join(m["content"] for m in answer.observation))


def with_episode_rewards(samples: list[Sample], scored: list[ScoredSample] | None) -> list[ScoredSample]:
    """Each episode's reward: the sum of its turn rewards (component "env") plus what the reward
    functions gave (`scored`, None when there are none); a single completion's is the functions'.
    A failed sample (its episode, or a request the engine refused) keeps its error."""
    out = []
    for i, s in enumerate(samples):
        base = scored[i] if scored is not None else None
        if s.error is not None:
            out.append(ScoredSample(s, None, base.components if base else {}, error=s.error))
            continue
        if s.turns is None and base is not None:  # a single completion: the reward functions' alone
            out.append(base)
            continue
        turn = [r for _, r in s.turn_rewards()]
        env = sum(turn) if turn else None
        components = {**(base.components if base else {}), "env": env}
        if base is not None and base.error is not None:  # a reward function failed: never a silent 0
            out.append(ScoredSample(s, None, components, error=base.error))
        elif base is None and env is None:
            out.append(ScoredSample(s, None, components, error="no reward: the environment rewarded no turn and "
                                                               "reward.functions is empty"))
        else:
            out.append(ScoredSample(s, (base.reward if base is not None else 0.0) + (env or 0.0), components))
    return out
