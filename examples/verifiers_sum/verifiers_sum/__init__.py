"""Sums of two digits as a verifiers `v1` taskset, written as for any verifiers trainer: its tasks
(`Task` with a `@vf.reward`), its config and its `Taskset`, exported through `__all__`. Nothing
here knows about this trainer."""

import random

import verifiers.v1 as vf

INSTRUCTION = "Answer with just the number."


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact_answer(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    n: int = 2000  # how many tasks
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.n):
            rng = random.Random(self.config.seed * 1_000_000 + i)
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            yield SumTask(SumData(prompt=f"{INSTRUCTION}\n{a}+{b}", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]
