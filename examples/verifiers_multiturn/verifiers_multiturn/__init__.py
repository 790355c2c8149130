"""Sums a user asks for one at a time, as a verifiers `v1` taskset for its `user-sim` env (`--env.id
user-sim`): the task's prompt is the user's scenario (which sums it wants), the assistant learns
them only through the conversation, and the reward reads the assistant's replies against the
answers, a scoring-side field, as user-sim tasksets do. Written as for any verifiers trainer;
nothing here knows about this one."""

import random

import verifiers.v1 as vf

INSTRUCTION = "Answer each sum with just the number."


class SumsData(vf.TaskData):
    answers: list[str]


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def answered(self, trace: vf.Trace) -> float:
        """The share of the sums answered right, in the order they were asked."""
        replies = [(m.content or "").strip() for m in trace.assistant_messages if not m.tool_calls]
        return sum(r == a for r, a in zip(replies, self.data.answers)) / len(self.data.answers)

    @vf.metric
    async def assistant_replies(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class SumsConfig(vf.TasksetConfig):
    n: int = 1000  # how many tasks
    sums: int = 2  # sums per conversation
    seed: int = 0


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        for i in range(self.config.n):
            rng = random.Random(self.config.seed * 1_000_000 + i)
            pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(self.config.sums)]
            scenario = ("You need these sums worked out, one at a time: " + ", then ".join(f"{a}+{b}" for a, b in pairs)
                        + ". Ask for each in turn; once all are answered, you are done.")
            data = SumsData(prompt=scenario, system_prompt=INSTRUCTION, answers=[str(a + b) for a, b in pairs])
            yield SumsTask(data, self.config.task)


__all__ = ["SumsTaskset"]
