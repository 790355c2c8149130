"""Expressions worked out with a calculator tool, as a verifiers `v1` taskset whose task serves its
tool over MCP (`Task.toolsets`: the `Calculator` toolset, launched per rollout as verifiers
launches tool servers, `python -m verifiers_calculator`). The harness lists the tool, runs the
model's calls on it and sends the results back until the model answers; the reward is the final
answer's. Nothing here knows about this trainer."""

import ast
import random

import verifiers.v1 as vf

INSTRUCTION = "Use the calculator, then answer with just the number."
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> int:
    """An integer expression of digits and + - * (no other syntax)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError("bad expression")
    return value(ast.parse(expression, mode="eval").body)


class CalculatorConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig]):
    TOOL_PREFIX = None  # the tool is advertised as `calculator`

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an integer expression of digits and + - *."""
        try:
            return str(evaluate(expression))
        except (SyntaxError, ValueError):
            return "error: bad expression"


class ToolSumsData(vf.TaskData):
    answer: str


class ToolSumsTask(vf.Task[ToolSumsData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(CalculatorConfig())]

    @vf.reward(weight=1.0)
    async def exact_answer(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ToolSumsConfig(vf.TasksetConfig):
    n: int = 1000
    seed: int = 0


class ToolSumsTaskset(vf.Taskset[ToolSumsTask, ToolSumsConfig]):
    def load(self):
        for i in range(self.config.n):
            rng = random.Random(self.config.seed * 1_000_000 + i)
            expression = f"{rng.randint(2, 9)}*{rng.randint(2, 9)}+{rng.randint(1, 9)}"
            data = ToolSumsData(prompt=expression, system_prompt=INSTRUCTION, answer=str(evaluate(expression)))
            yield ToolSumsTask(data, self.config.task)


__all__ = ["ToolSumsTaskset"]

if __name__ == "__main__":  # verifiers starts the task's tool server so
    Calculator.run()
