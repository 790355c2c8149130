"""Batch geometry: how one step's examples become optimizer updates, micro-batches and forward
passes on every data-parallel rank. The one place this is computed: the RL learner's DeepSpeed
config and micro-batch cuts (trainer/learner.py), the supervised trainers (trainer/supervised.py)
and the memory planner (rl/plan/memory_plan.py) all read a `BatchGeometry`, so the planner
provisions the micro-batch the learner runs. Plain integers: no torch.

`micro_batch_size` (the config's `trainer.micro_batch_size`, in RL, SFT and RM alike) has one
meaning: the most *sequences* (rows of the model's input) one forward or forward-backward pass on
one rank takes. An example of the batch is one sequence (an RL sample, an SFT row) or, with
`rows_per_example=2`, a preference pair (chosen and rejected in one pass), so a micro-batch holds
at most `micro_batch_size // rows_per_example` examples (`examples_cap`). A rank's share of one
optimizer update (`examples_per_update`) is cut into the fewest micro-batches that respect that
cap (`accumulation_steps`), of near-equal size (`micro_batch_sizes`: what `torch.tensor_split`
gives); scoring passes (forward only) take runs of `examples_cap`; a token budget
(`max_tokens_per_micro_batch`) caps a micro-batch's rows x longest row on top.

Worked example: 32 prompts x 8 samples = 256 sequences, 2 ranks, 2 mini-batches, micro_batch_size
48: a rank's share of an update is 256 / (2 x 2) = 64 rows, cut into ceil(64 / 48) = 2 micro-batches
of 32 rows; DeepSpeed is told micro-batch 32, gradient accumulation 2.
"""

from __future__ import annotations

from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BatchGeometry:
    """The cuts of one step. Inputs are the fields; everything else is derived from them."""

    samples: int  # examples per step, all ranks together (RL: prompts_per_step x n; SFT rows; RM pairs)
    world_size: int = 1  # data-parallel ranks the step is sharded over
    mini_batches: int = 1  # optimizer updates per pass over the step's examples
    micro_batch_size: int = 0  # the most sequences per forward(-backward) pass on a rank; 0 = no cap
    rows_per_example: int = 1  # sequences one example puts in a pass (a preference pair: 2)
    max_tokens_per_micro_batch: int = 0  # > 0: a micro-batch's rows x longest row stays within it

    def __post_init__(self) -> None:
        for name in ("samples", "world_size", "mini_batches", "rows_per_example"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch geometry: {name}={getattr(self, name)} must be >= 1")
        if self.micro_batch_size < 0 or self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"batch geometry: micro_batch_size={self.micro_batch_size} and max_tokens_per_micro_batch="
                             f"{self.max_tokens_per_micro_batch} must be >= 0")
        if 0 < self.micro_batch_size < self.rows_per_example:
            raise ValueError(f"batch geometry: micro_batch_size={self.micro_batch_size} sequences cannot hold one "
                             f"example of {self.rows_per_example}")
        if self.samples < self.world_size * self.mini_batches:
            raise ValueError(f"batch geometry: {self.samples} examples per step leave a rank nothing for one of "
                             f"{self.mini_batches} update(s) over {self.world_size} rank(s)")

    @property
    def examples_per_rank(self) -> int:
        """A rank's shard of the step (what it scores), the largest one when the step does not divide."""
        return _ceil_div(self.samples, self.world_size)

    @property
    def examples_per_update(self) -> int:
        """A rank's share of one optimizer update (one mini-batch), the largest when it does not divide."""
        return _ceil_div(self.examples_per_rank, self.mini_batches)

    @property
    def examples_cap(self) -> int:
        """The most examples one pass takes: micro_batch_size // rows_per_example (no cap: a rank's share)."""
        if self.micro_batch_size == 0:
            return self.examples_per_rank
        return self.micro_batch_size // self.rows_per_example

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches (backward passes) per optimizer update on every rank: DeepSpeed's
        gradient_accumulation_steps."""
        return max(1, _ceil_div(self.examples_per_update, self.examples_cap))

    @property
    def micro_batch_examples(self) -> int:
        """Examples of the largest micro-batch of a row-cut update: DeepSpeed's
        train_micro_batch_size_per_gpu."""
        return _ceil_div(self.examples_per_update, self.accumulation_steps)

    def micro_batch_sizes(self, examples: int | None = None) -> list[int]:
        """Examples of each micro-batch when `examples` (default: `examples_per_update`) are cut
        into `accumulation_steps` near-equal runs, the larger first (`torch.tensor_split`)."""
        n = self.examples_per_update if examples is None else examples
        base, extra = divmod(n, self.accumulation_steps)
        return [base + 1] * extra + [base] * (self.accumulation_steps - extra)

    def forward_sizes(self, examples: int) -> list[int]:
        """Examples of each scoring (forward-only) pass over `examples`: runs of `examples_cap`
        (`torch.split`)."""
        cap = self.examples_cap
        return [min(cap, examples - start) for start in range(0, examples, cap)]

    def micro_batch_rows(self, seq_len: int = 0) -> int:
        """Sequences of the largest training micro-batch: the row cut's, or with a token budget
        the most sequences `seq_len` tokens long the budget holds (at least one, at most
        `examples_cap` examples and a rank's update), as `rl.data.batch.plan_micro_batches` cuts."""
        if self.max_tokens_per_micro_batch <= 0:
            return self.micro_batch_examples * self.rows_per_example
        fit = max(1, self.max_tokens_per_micro_batch // max(1, seq_len)) // self.rows_per_example
        return max(1, min(self.examples_cap, self.examples_per_update, fit)) * self.rows_per_example
