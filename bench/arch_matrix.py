"""Learner-rollout agreement across architectures, in fp32 and bf16: the figures behind the
architecture matrix (tests/test_arch_matrix.py checks the fp32 bound; this states both dtypes).

For each family of tests/arch_zoo.py (tiny random-weight models, built here with the built-in
arithmetic task's tokenizer), a 2-step GRPO run through the real stack (vLLM CPU rollout engine,
DeepSpeed learner, weight sync) in the dtype, and from its metrics:

- `before`: mean |learner - vLLM| log-prob of the sampled tokens at step 1 (both read the weights
  from disk: the kernels' disagreement alone),
- `after`: the same at step 2, after the first update was synced (the sync's disagreement on top),
- `max_after`: the largest single-token difference at step 2,
- `moved`: how far the update moved the policy from where it started (sqrt(2 KL) to the
  reference, nats), which a sync that did nothing would leave as the disagreement.

The MoE question (issue: MoE log-prob mismatch against a dense model of similar size) is answered
by the `qwen3_moe` row against `qwen3` (same hidden size, layers and attention; 4 experts of the
dense model's inner size, 2 routed per token; `--wide-moe`: 32 experts, 8 routed) in bf16:
`qwen3_moe_vs_dense` (and `qwen3_moe_wide_vs_dense`) in the JSON.

    python -m bench.arch_matrix [--families llama,qwen3,qwen3_moe] [--dtypes float32,bfloat16] [--lora]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from bench.machine import machine_info, write_result


def main(argv: list[str] | None = None) -> dict:
    from tests.arch_zoo import FAMILIES, LORA_TARGETS, build, run_grpo

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--lora", action="store_true", help="also each family with LoRA (rank 4) syncs")
    p.add_argument("--wide-moe", action="store_true",
                   help="also `qwen3_moe_wide`: 32 experts of a quarter the size, 8 routed per token (more "
                        "routing decisions per token to flip in bf16)")
    p.add_argument("--out", default="bench/results/arch_matrix.json")
    args = p.parse_args(argv)

    import ray

    import launch.components
    from examples.arith import addition_corpus, write_data
    from examples.tiny import build_tokenizer
    from rl.config.compose import compose

    work = Path(tempfile.mkdtemp(prefix="arch_matrix_"))
    write_data(str(work / "task"), seed=0)  # the arithmetic task's prompts and tokenizer (no model)
    build_tokenizer(addition_corpus()).save_pretrained(work / "task" / "model")
    if not ray.is_initialized():
        launch.components.start_ray(compose("train", ["cluster.num_cpus=16"]))
    rows: dict[str, dict] = {}
    families = args.families.split(",") + (["qwen3_moe_wide"] if args.wide_moe else [])
    for family in families:
        wide = dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=16) \
            if family == "qwen3_moe_wide" else {}
        model = build(family.removesuffix("_wide"), work / "zoo" / family, work / "task" / "model", **wide)
        for dtype in args.dtypes.split(","):
            for lora in ([False, True] if args.lora else [False]):
                key = f"{family}/{dtype}{'/lora' if lora else ''}"
                started = time.perf_counter()
                metrics = run_grpo(model, str(work / "task" / "data" / "train.jsonl"), work / "runs" / key,
                                   lora=LORA_TARGETS[family.removesuffix("_wide")] if lora else None, dtype=dtype)
                first, second = metrics
                rows[key] = {"before": first["sync/logprob_abs_diff"], "after": second["sync/logprob_abs_diff"],
                             "max_after": second["sync/logprob_max_abs_diff"],
                             "moved": math.sqrt(2 * max(second["actor/kl_nats"], 0.0)),
                             "seconds": round(time.perf_counter() - started, 1)}
                print(f"{key:28s} before {rows[key]['before']:.2e}  after {rows[key]['after']:.2e}  "
                      f"max {rows[key]['max_after']:.2e}  moved {rows[key]['moved']:.2e}  "
                      f"({rows[key]['seconds']} s)", flush=True)
    result = {"machine": machine_info(), "rows": rows}
    dense = rows.get("qwen3/bfloat16")
    for moe_name in ("qwen3_moe", "qwen3_moe_wide"):
        moe = rows.get(f"{moe_name}/bfloat16")
        if moe and dense:
            ratios = {k: moe[k] / dense[k] for k in ("before", "after", "max_after") if dense[k] > 0}
            result[f"{moe_name}_vs_dense"] = ratios
            print(f"bf16 {moe_name} / qwen3 mismatch:", {k: round(v, 2) for k, v in ratios.items()})
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
