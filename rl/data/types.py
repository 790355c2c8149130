"""Typed data passed between the stages of one RL step (generate, reward, score, train: `rl/loop.py`).

Plain dataclasses of Python lists and floats so they cross Ray process boundaries cheaply and
can be written to the run's sample log as JSON. Tensors appear only in `TrainBatch` and `Outcomes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a TrainBatch is made: reward and environment workers never need torch
    import torch


@dataclass
class GenerationRequest:
    """One completion to sample: a prompt, its place in the batch and its own sampling seed."""

    prompt_ids: list[int]
    prompt_text: str
    group_id: int  # index of the prompt in this step's batch; the n samples of a prompt share it
    sample_index: int  # 0..n-1 within the group
    seed: int  # derived from (run seed, step, group_id, sample_index): never global state
    metadata: dict[str, Any] = field(default_factory=dict)  # dataset columns, e.g. the answer
    max_tokens: int | None = None  # this request's token budget (an episode's turn); None = rollout.max_new_tokens
    temperature: float | None = None  # None = rollout.temperature (evaluation asks for 0: greedy)
    # A client's own sampling (the Tinker service, launch/tinker/): None = the run's
    adapter: str | None = None  # a peft LoRA folder to sample with (vLLM's LoRA; rollout.max_loras > 0)
    top_p: float | None = None
    top_k: int | None = None  # None or -1: no top-k
    stop: list[str] | None = None  # stop strings (the completion ends after the one that matched)
    stop_token_ids: list[int] | None = None  # more stop tokens besides EOS
    ignore_eos: bool = False  # run to max_tokens, EOS or not
    prompt_logprobs: bool = False  # also the prompt tokens' log-probs (Sample.prompt_logprobs)


@dataclass
class Sample:
    """A sampled completion with the per-token log-probs of the policy that produced it.

    An episode (multi-turn, `rl.data.episodes`) is one Sample too: `completion_ids` holds every token
    after the prompt, the model's turns exactly as sampled and the observations as tokenized once,
    `completion_mask` marks which are the model's (1) and `turns` says where each turn lies.

    An episode whose prompt changed midway (an agent handoff swapping the system message, a
    summary, a trimmed context) has `segments`: its earlier parts, each token-exact with a prompt
    of its own; the Sample's own prompt and completion are its last part (docs/environments-and-
    agents.md "Segments"). Every part trains with the episode's one reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling policy, one per completion token
    finish_reason: str  # "stop" (EOS / stop string) or "length" (hit max_tokens)
    policy_version: int
    prompt_text: str
    completion_text: str
    group_id: int
    sample_index: int
    metadata: dict[str, Any] = field(default_factory=dict)
    # Episodes only: 1 = model token, 0 = observation token (its log-prob is 0 and it is never
    # trained on); None = every completion token is the model's (single turn).
    completion_mask: list[int] | None = None
    turns: list[Turn] | None = None  # episodes only, in order
    error: str | None = None  # the episode failed (environment raised, hung, answered badly)
    # Streaming rollouts (in-flight weight updates): the policy version that sampled each completion
    # token (an observation token carries its turn's last one); None = all `policy_version`. A sample
    # may span versions; `policy_version` is then its first token's, the oldest.
    token_versions: list[int] | None = None
    # log p(prompt token t | earlier ones) for each prompt token (None for the first), when the
    # request asked for them (`GenerationRequest.prompt_logprobs`)
    prompt_logprobs: list[float | None] | None = None
    segments: list[Segment] | None = None  # episodes only: the parts before this one, in order
    truncated: bool = False  # the episode filled its context (a call refused for it) and ended there, kept

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Sample has {len(self.completion_ids)} completion tokens but {len(self.logprobs)} logprobs"
            )
        if self.completion_mask is not None and len(self.completion_mask) != len(self.completion_ids):
            raise ValueError(f"Sample has {len(self.completion_ids)} completion tokens but a mask of "
                             f"{len(self.completion_mask)}")
        if self.token_versions is not None and len(self.token_versions) != len(self.completion_ids):
            raise ValueError(f"Sample has {len(self.completion_ids)} completion tokens but "
                             f"{len(self.token_versions)} token versions")

    def oldest_version(self) -> int:
        """The policy version of the sample's oldest token (the staleness bound counts it)."""
        own = min(self.token_versions, default=self.policy_version) if self.token_versions else self.policy_version
        return min([own] + [v for seg in self.segments or () for v in seg.token_versions])

    def turn_rewards(self) -> list[tuple[int, float]]:
        """(index in completion_ids of the turn's last model token, reward) of each rewarded turn."""
        return [(t.end - 1, t.reward) for t in self.turns or () if t.role == "model" and t.reward is not None]


@dataclass
class Turn:
    """One turn of an episode: completion_ids[start:end] are the model's tokens or an observation's."""

    role: str  # "model" or "observation"
    start: int
    end: int
    text: str
    reward: float | None = None  # the environment's reward for this model turn
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Segment:
    """An earlier part of an episode (`Sample.segments`): a prompt of its own (the calls before
    it are not its prefix), then its turns as in a Sample, its own training row."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    completion_mask: list[int]
    token_versions: list[int]
    turns: list[Turn]

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if not len(self.logprobs) == len(self.completion_mask) == len(self.token_versions) == n:
            raise ValueError(f"Segment has {n} completion tokens but {len(self.logprobs)} logprobs, a mask of "
                             f"{len(self.completion_mask)} and {len(self.token_versions)} token versions")


@dataclass
class ScoredSample:
    """A sample with its combined reward, or the error that prevented scoring it.

    `reward` is None exactly when `error` is set: such a sample is excluded from advantage
    estimation and training, counted in metrics, and written to the sample log with its error.
    """

    sample: Sample
    reward: float | None
    components: dict[str, float | None] = field(default_factory=dict)  # per reward function, unweighted
    error: str | None = None

    def to_log(self) -> dict[str, Any]:
        """The sample log's row: prompt, completion, the dataset columns the reward saw (`data`,
        e.g. the answer), reward and its components, error; then the rest of the sample."""
        rest = asdict(self.sample)
        for key in ("prompt_ids", "completion_ids", "logprobs", "completion_mask", "token_versions", "error"):
            rest.pop(key)  # an episode's error is the ScoredSample's (below)
        if rest["turns"] is None:
            rest.pop("turns")
        segments = rest.pop("segments")
        if segments:  # an earlier part's size and model turns, not its ids
            rest["segments"] = [{"prompt_tokens": len(seg["prompt_ids"]),
                                 "completion_tokens": len(seg["completion_ids"]), "turns": seg["turns"]}
                                for seg in segments]
        row = {"prompt_text": rest.pop("prompt_text"), "completion_text": rest.pop("completion_text"),
               "data": rest.pop("metadata"), "reward": self.reward, "components": self.components, "error": self.error}
        return {**row, **rest}


@dataclass
class Outcomes:
    """A step's rewards, one per sample (an episode in several rows: one per episode): what the
    learners need from the driver, besides the batch, to estimate the advantages where the batch
    is (trainer/advantages.py). Small: the batch's tensors cross to the learners once."""

    reward: torch.Tensor  # [S] float64, 0 where not valid
    valid: torch.Tensor  # [S] bool: the reward could be computed
    group_ids: torch.Tensor  # [S] long: the sample's group (prompt)


@dataclass
class TrainBatch:
    """Right-padded token tensors for the learner; row i is prompt + completion of one sample.

    `loss_mask[i, t]` is 1 where token t+1 of row i is a (model-sampled) completion token, i.e. it aligns with the
    log-prob of predicting input_ids[:, 1:]. All per-token tensors have shape [B, T-1].
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T-1] float
    rollout_logprobs: torch.Tensor  # [B, T-1] float, sampling-policy log-probs (0 off-mask)
    advantages: torch.Tensor  # [B, T-1] float
    group_ids: torch.Tensor  # [B] long
    policy_version: int
    old_logprobs: torch.Tensor | None = None  # [B, T-1], filled by the learner before updating
    ref_logprobs: torch.Tensor | None = None  # [B, T-1], reference model, when KL is used
    values: torch.Tensor | None = None  # [B, T-1], the critic's values before the update (PPO)
    returns: torch.Tensor | None = None  # [B, T-1], the critic's targets (PPO)
    turn_rewards: torch.Tensor | None = None  # [B, T-1], episodes: each turn's reward on its last model token
    teacher_logprobs: torch.Tensor | None = None  # [B, T-1], the teacher's (on-policy distillation)
    # episodes with segments: the sample (index in the scored list) each row is a part of; rows
    # 0..n-1 are the samples' own, the earlier segments' rows follow. None: row i is sample i
    episode_index: torch.Tensor | None = None  # [B] long

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor | list[int]) -> "TrainBatch":
        """Rows `index`, trimmed to the longest remaining sequence (keeps micro-batches small)."""
        import torch

        index = torch.as_tensor(index, dtype=torch.long)
        width = int(self.attention_mask[index].sum(dim=1).max().item()) if len(index) else 1

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index, : width - 1]

        return TrainBatch(
            input_ids=self.input_ids[index, :width],
            attention_mask=self.attention_mask[index, :width],
            loss_mask=rows(self.loss_mask),
            rollout_logprobs=rows(self.rollout_logprobs),
            advantages=rows(self.advantages),
            group_ids=self.group_ids[index],
            policy_version=self.policy_version,
            old_logprobs=rows(self.old_logprobs),
            ref_logprobs=rows(self.ref_logprobs),
            values=rows(self.values),
            returns=rows(self.returns),
            turn_rewards=rows(self.turn_rewards),
            teacher_logprobs=rows(self.teacher_logprobs),
            episode_index=None if self.episode_index is None else self.episode_index[index],
        )
