"""`rollout.enforce_eager=auto`: compile the rollout engine only where the run is long enough.

vLLM's compiled decoding (torch.compile, and CUDA graphs on a GPU) is faster per token but costs
start-up time at every engine start. Measured on the CPU (docs/benchmarks.md, `bench.rollout`'s
notes: SmolLM2-135M bf16, 32 requests x 128 tokens, a 2-core host): compiled 960 tok/s against
eager 760 (1.26x), after 57 s of start-up against 3.8 s. Compiling pays once the run's eager
generation time T satisfies T x (1 - 1/1.26) > 53 s, i.e. T > ~257 s: about 48 rollouts of that
size. On a GPU the figures are not measured here (vLLM does not run on the lent GPU machine):
vLLM's own start-up logs put Dynamo compilation plus CUDA-graph capture at tens of seconds for
small models and graphs speed small-batch decoding up by well over 1.5x, so the same rule with
30 s and 1.5x is used; `rollout.enforce_eager=false|true` overrides it.
"""

from __future__ import annotations

COMPILE_START_S = {"cpu": 53.0, "gpu": 30.0}  # start-up of a compiled engine beyond an eager one
COMPILED_DECODE_SPEEDUP = {"cpu": 1.26, "gpu": 1.5}


def break_even_s(on_gpu: bool) -> float:
    """Eager generation seconds over a run beyond which compiling pays."""
    kind = "gpu" if on_gpu else "cpu"
    return COMPILE_START_S[kind] / (1.0 - 1.0 / COMPILED_DECODE_SPEEDUP[kind])


def choose_eager(rollout_s_per_step: float | None, steps: int, on_gpu: bool) -> tuple[bool, str]:
    """(enforce_eager, why) for `rollout.enforce_eager=auto` from the planner's predicted
    rollout seconds per step (None: no prediction, eager on CPU and compiled on GPUs, each
    kind's usual choice for runs of unknown length)."""
    kind = "GPU" if on_gpu else "CPU"
    if rollout_s_per_step is None:
        return (not on_gpu), f"no step prediction: {'compiled' if on_gpu else 'eager'}, the usual choice on {kind}"
    total, even = rollout_s_per_step * steps, break_even_s(on_gpu)
    eager = total <= even
    return eager, (f"~{total:,.0f} s of generation predicted over {steps} steps "
                   f"{'<=' if eager else '>'} {even:,.0f} s, where compiling starts to pay on {kind}: "
                   f"{'eager' if eager else 'compiled'}")
