"""A difficulty curriculum (`task.curriculum_epochs`): a prompt whose latest group was all solved
or all failed carries no GRPO signal (every advantage is zero), so it is set aside for that many
epochs of the prompt stream and the next prompts are drawn instead (the "easy/hard pool" of
prime-rl's and ROLL's curricula, kept as a rest period here: a set-aside prompt comes back).

State: the stream position the next draw starts at (`cursor`) and, per resting row, the position
from which it may be drawn again. Both go into checkpoints (`to_dict`), so a resumed run draws
exactly the prompts the uninterrupted one would. Plain Python: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Curriculum:
    """`rows`: the prompt table's size (one epoch of the stream); `rest_epochs`: how long a flat
    prompt rests; `pass_reward`: a sample solves its prompt at this reward or above."""

    rows: int
    rest_epochs: int
    pass_reward: float = 1.0
    cursor: int = 0
    resting: dict[int, int] = field(default_factory=dict)  # row -> first stream position it may be drawn at
    drawn: dict[int, int] = field(default_factory=dict)  # group id -> row, of draws not yet recorded
    last_skipped: int = 0  # positions passed over by the latest draw

    def draw(self, count: int, row_at: Callable[[int], int], groups: list[int]) -> list[int]:
        """The next `count` rows of the stream (`row_at(position)` -> row), passing over resting
        ones; `groups`: the group id each drawn row gets (for `record`). After an epoch's worth
        of positions without enough rows (nearly all resting) resting rows are taken after all."""
        out: list[int] = []
        skipped = 0
        while len(out) < count:
            position, self.cursor = self.cursor, self.cursor + 1
            row = row_at(position)
            if self.resting.get(row, 0) > position and skipped < self.rows:
                skipped += 1
                continue
            self.resting.pop(row, None)
            out.append(row)
        self.last_skipped = skipped
        self.drawn.update(zip(groups, out))
        return out

    def record(self, outcomes: dict[int, list[float | None]]) -> int:
        """Each drawn group's rewards (None: a failed sample); a group all solved or all failed
        sets its row aside for `rest_epochs` epochs from now. Returns how many rows were set aside."""
        rested = 0
        for group, rewards in outcomes.items():
            row = self.drawn.pop(group, None)
            valid = [r for r in rewards if r is not None]
            if row is None or not valid:
                continue
            solved = sum(r >= self.pass_reward for r in valid)
            if solved in (0, len(valid)):
                self.resting[row] = self.cursor + self.rest_epochs * self.rows
                rested += 1
        return rested

    def metrics(self, drawn: int) -> dict[str, float]:
        """The latest draw's share of positions passed over, and the rows resting now."""
        return {"curriculum/skipped_frac": self.last_skipped / max(self.last_skipped + drawn, 1),
                "curriculum/resting_rows": float(sum(p > self.cursor for p in self.resting.values()))}

    def reset(self) -> None:
        """Back to the start of the stream with nothing resting (a run started over from step 1)."""
        self.cursor, self.resting, self.drawn, self.last_skipped = 0, {}, {}, 0

    def to_dict(self) -> dict:
        return {"cursor": self.cursor, "resting": {str(k): v for k, v in self.resting.items()},
                "drawn": {str(k): v for k, v in self.drawn.items()}}

    def load(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.resting = {int(k): int(v) for k, v in state["resting"].items()}
        self.drawn = {int(k): int(v) for k, v in state.get("drawn", {}).items()}
