"""The CPU ZeRO-1/2 step with a kept fp32 gradient buffer (trainer/zero_grads.py): the same update
to the bit as DeepSpeed's own step, one buffer for every step, on one rank and on two."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl.wire.collective import free_port
from tests.conftest import ROOT

# Each rank trains two engines from the same weights on the same batches, 3 steps: one as
# build_engine makes it (the kept buffer), one with DeepSpeed's own step put back. Argv: stage, dtype.
CASE = r'''
import os, sys
import torch
import deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
from trainer.engine import build_engine, ds_config
from trainer.zero_grads import kept_gradient_bytes, keep_fp32_gradients

stage, dtype = int(sys.argv[1]), sys.argv[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, tie_word_embeddings=True)
torch_dtype = getattr(torch, dtype)

def load():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch_dtype)

def engine():
    return build_engine(load, ds_config(micro_batch_size=4, gradient_accumulation_steps=1, zero_stage=stage,
                                        dtype=dtype, max_grad_norm=0.5),
                        lr=1e-2, weight_decay=0.01, lr_lambda=lambda s: 1.0)

kept, stock = engine(), engine()
assert kept.optimizer._rlpost_kept_gradients == {} and stock.optimizer._rlpost_kept_gradients == {}
stock.optimizer.step = type(stock.optimizer).step.__get__(stock.optimizer)  # DeepSpeed's own step
pointers = []
for step in range(3):
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(100 * step + rank))
    for e in (kept, stock):
        logits = e(input_ids=ids).logits.float()
        e.backward(logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean())
        e.step()
    buffers = list(kept.optimizer._rlpost_kept_gradients.values())
    assert len(buffers) == 1 and buffers[0].dtype == torch.float32, buffers
    pointers.append(buffers[0].data_ptr())
    assert all(m.grad is None for m in kept.optimizer.single_partition_of_fp32_groups)
    for (name, a), b in zip(kept.module.named_parameters(), stock.module.parameters()):
        assert torch.equal(a, b), (step, name, float((a.float() - b.float()).abs().max()))
    for a, b in zip(kept.optimizer.single_partition_of_fp32_groups, stock.optimizer.single_partition_of_fp32_groups):
        assert torch.equal(a, b), step
assert len(set(pointers)) == 1, pointers
partition = sum(int(n) for n in kept.optimizer.partition_size)
assert kept_gradient_bytes(kept.optimizer) == partition * 4
assert kept_gradient_bytes(stock.optimizer) == 0
assert not keep_fp32_gradients(object())
moved = float(sum((a.float() - load().state_dict()[n].float()).abs().sum()
                  for n, a in kept.module.state_dict().items()))
assert moved > 0
print("rank", rank, "equal over 3 steps, one buffer of", partition, "fp32 values")
'''


def _run_ranks(stage: int, dtype: str, world: int) -> None:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, "-c", CASE, str(stage), dtype], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-4000:]}"
        assert f"rank {rank} equal over 3 steps" in out


@pytest.mark.parametrize("stage,dtype,world", [(2, "bfloat16", 1), (2, "float32", 1), (1, "bfloat16", 2),
                                               (2, "bfloat16", 2)])
def test_kept_fp32_gradient_buffer_updates_as_deepspeed_does(stage, dtype, world):
    """ZeRO-1/2, bf16 (flatten, then convert) and fp32 (flatten only), 1 rank (the last partition,
    aligned) and 2 (a first partition too), gradient clipping and weight decay on: every weight
    and every fp32 master value equal to DeepSpeed's own step's after each of 3 steps, through
    one fp32 buffer of the rank's partition size whose address never changes."""
    _run_ranks(stage, dtype, world)
