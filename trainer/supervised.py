"""The training loop shared by every supervised trainer, and the run directory they write.

`train_loop` draws batches, splits them into micro-batches, calls a loss function and steps an
optimizer; what it steps is a `Stepper`:

- `TorchStepper`: a plain model with torch AdamW (the tiny models' warm-up, `trainer.sft.sft_train`);
- `DeepSpeedStepper`: a DeepSpeed engine (ZeRO 0-3; `launch.train_sft`, `launch.train_rm`).

So the SFT warm-up of the built-in tiny model and `python -m launch.train_sft` run the same loop
with the same loss (`trainer.sft.completion_batch_loss`); only the optimizer wrapper differs.
`fit` is that loop on a one-process DeepSpeed engine writing a run directory (`rl.log.run_log.RunLog`)
and the final model: what `trainer.sft.train_sft` and `trainer.reward_model.train_rm` call.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable, Iterator, Protocol

import torch

from rl.plan.geometry import BatchGeometry

LossFn = Callable[[Any, list[int]], tuple[torch.Tensor, dict[str, float]]]


class Stepper(Protocol):
    model: Any  # called like the transformers model (a model or a DeepSpeed engine)

    def train(self) -> None: ...
    def backward(self, loss: torch.Tensor, micro_batches: int) -> None: ...
    def update(self) -> float | None: ...  # returns the gradient norm when known
    def lr(self) -> float: ...


class TorchStepper:
    """torch AdamW + LambdaLR + gradient clipping on a plain model (no process group needed)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        lr_lambda: Callable[[int], float] = lambda _: 1.0,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    def train(self) -> None:
        self.model.train()

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        (loss if micro_batches == 1 else loss / micro_batches).backward()

    def update(self) -> float | None:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


class DeepSpeedStepper:
    """A DeepSpeed engine: it averages micro-batch gradients (its gradient_accumulation_steps
    must equal the micro-batches per step), clips, and steps optimizer and schedule itself."""

    def __init__(self, engine: Any) -> None:
        self.model = engine

    def train(self) -> None:
        self.model.train()

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        if micro_batches != self.model.gradient_accumulation_steps():
            raise ValueError(
                f"{micro_batches} micro-batches per step but the engine accumulates "
                f"{self.model.gradient_accumulation_steps()}"
            )
        self.model.backward(loss)
        self.model.step()  # applies the update only at the accumulation boundary

    def update(self) -> float | None:
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def lr(self) -> float:
        return float(self.model.get_lr()[0])


def train_loop(
    stepper: Stepper,
    n_examples: int,
    loss_fn: LossFn,
    *,
    steps: int,
    batch_size: int,
    micro_batch_size: int | None = None,
    rows_per_example: int = 1,
    seed: int = 0,
    log_every: int = 0,
    log_fn: Callable[[str], None] = print,
    log_prefix: str = "step",
    stop_fn: Callable[[int], bool] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[float]:
    """Run `steps` optimizer updates of `batch_size` examples each; returns every step's loss.

    Example indices come epoch after epoch from permutations of a generator seeded with `seed`
    (never from global RNG state). A batch is cut as `rl.plan.geometry.BatchGeometry` cuts it:
    into the fewest micro-batches of at most `micro_batch_size` sequences (default: the whole
    batch in one; an example is `rows_per_example` sequences, a preference pair 2), of near-equal
    size. `loss_fn(model, indices)` returns one micro-batch's mean loss and extra metrics; each
    counts by its share of the batch's examples (equal micro-batches: the mean over them), and so
    does the step's loss. After each step,
    `on_step(done_steps, metrics)` gets the averaged metrics plus `loss`, `lr` and `grad_norm`,
    then `stop_fn(done_steps)` may end training early (it may switch the model to eval mode;
    training mode is restored).
    """
    if n_examples < 1:
        raise ValueError("no training examples")
    sizes = BatchGeometry(batch_size, micro_batch_size=micro_batch_size or 0,
                          rows_per_example=rows_per_example).micro_batch_sizes()
    n_micro = len(sizes)
    generator = torch.Generator().manual_seed(seed)
    stepper.train()
    order: list[int] = []
    losses: list[float] = []
    for step in range(steps):
        while len(order) < batch_size:
            order += torch.randperm(n_examples, generator=generator).tolist()
        picked, order = order[:batch_size], order[batch_size:]
        sums: dict[str, float] = {}
        start = 0
        for size in sizes:
            loss, extra = loss_fn(stepper.model, picked[start : start + size])
            start += size
            weight = size * n_micro / batch_size  # exactly 1.0 when the micro-batches are equal
            stepper.backward(loss if weight == 1.0 else loss * weight, n_micro)
            for key, value in {"loss": float(loss.detach()), **extra}.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        grad_norm = stepper.update()
        metrics = {k: v / n_micro for k, v in sums.items()}
        metrics["lr"] = stepper.lr()
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        losses.append(metrics["loss"])
        if log_every and (step + 1) % log_every == 0:
            log_fn(f"{log_prefix} step {step + 1}/{steps} loss {losses[-1]:.4f} lr {metrics['lr']:.2e}")
        if on_step is not None:
            on_step(step + 1, metrics)
        if stop_fn is not None:
            stop = stop_fn(step + 1)
            stepper.train()  # stop_fn may have switched to eval mode to probe the model
            if stop:
                break
    return losses


def schedule(epochs: float, n_examples: int, batch_size: int) -> tuple[int, int]:
    """(total optimizer steps, steps per epoch) for `epochs` passes over `n_examples`."""
    per_epoch = max(1, math.ceil(n_examples / batch_size))
    return max(1, math.ceil(epochs * n_examples / batch_size)), per_epoch


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with torch's CPU threads set to `threads` (None or 0: leave them), then
    restore the caller's setting: tiny models run fastest on one thread on shared cores."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10%: stable for tiny models at high learning rates."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def fit(
    cfg: Any,
    *,
    title: str,
    tokenizer: Any,
    load_model: Callable[[], torch.nn.Module],
    n_train: int,
    loss_fn: LossFn,
    evaluate: Callable[[Any], dict[str, float]] | None = None,
    summary: dict[str, Any] | None = None,
    rows_per_example: int = 1,
) -> dict[str, Any]:
    """Train with a one-process DeepSpeed engine and write the run directory; returns the summary.

    `cfg` has the `model`, `algorithm`, `trainer` and `run` sections of `rl/config/supervised.py`
    (validated: deprecated `optim.*` keys already translated); an example is `rows_per_example`
    sequences of a forward pass (a preference pair: 2), for `trainer.micro_batch_size`.
    `load_model()` builds the model (called under the ZeRO-3 context; seed it yourself);
    `loss_fn(engine, indices)` is one micro-batch's loss (see `train_loop`); `evaluate(engine)`
    returns held-out metrics (keys like "eval/loss"), run before training, after every epoch,
    every `run.eval_every` steps and at the end. Metrics: `train/<name>` for every value
    `loss_fn` reports, plus lr and gradient norm, one row per step in metrics.jsonl/TensorBoard.
    """
    from trainer.engine import restored_dist_env

    with restored_dist_env():
        return _fit(cfg, title, tokenizer, load_model, n_train, loss_fn, evaluate, summary, rows_per_example)


def supervised_geometry(cfg: Any, rows_per_example: int = 1) -> BatchGeometry:
    """A supervised run's cuts: `algorithm.batch_size` examples per update on one process, at
    most `trainer.micro_batch_size` sequences per forward-backward pass."""
    return BatchGeometry(cfg.algorithm.batch_size, micro_batch_size=cfg.trainer.micro_batch_size,
                         rows_per_example=rows_per_example)


def _fit(cfg: Any, title: str, tokenizer: Any, load_model: Callable[[], torch.nn.Module], n_train: int,
         loss_fn: LossFn, evaluate: Callable[[Any], dict[str, float]] | None, summary: dict[str, Any] | None,
         rows_per_example: int):
    from omegaconf import OmegaConf

    from rl.log.run_log import RunLog, row_line
    from trainer.engine import build_engine, ds_config, full_state_dict, init_single_process, save_pretrained_atomic

    o = cfg.algorithm
    geometry = supervised_geometry(cfg, rows_per_example)
    steps, per_epoch = schedule(o.epochs, n_train, o.batch_size)
    writer = RunLog(cfg.run.dir, steps, title=title, progress=cfg.run.progress,
                    config_yaml=OmegaConf.to_yaml(cfg, resolve=True), line=row_line(title),
                    loggers=list(cfg.run.loggers), config=OmegaConf.to_container(cfg, resolve=True),
                    sink_options={"project": cfg.run.project, "mlflow_tracking_uri": cfg.run.mlflow_tracking_uri})
    try:
        config = ds_config(
            micro_batch_size=geometry.micro_batch_examples,
            gradient_accumulation_steps=geometry.accumulation_steps,
            zero_stage=cfg.trainer.zero_stage,
            dtype=cfg.model.dtype,
            max_grad_norm=o.max_grad_norm,
            offload_optimizer=cfg.trainer.offload_optimizer,
            zero3_persistence_threshold=cfg.trainer.zero3_persistence_threshold,
        )
        init_single_process()
        engine = build_engine(load_model, config, lr=o.lr, weight_decay=o.weight_decay,
                              lr_lambda=lambda s: lr_factor(s, steps, o.lr_warmup_steps),
                              gradient_checkpointing=cfg.model.gradient_checkpointing)
        print(f"{title}: {n_train} training rows, {steps} steps of {o.batch_size} "
              f"({geometry.accumulation_steps} micro-batches), ZeRO-{cfg.trainer.zero_stage}", flush=True)
        history: list[dict[str, float]] = []

        def run_eval(done: int) -> None:
            if evaluate is not None:
                t0 = time.perf_counter()
                row = {"epoch": done / per_epoch, **evaluate(engine), "time/eval_s": time.perf_counter() - t0}
                history.append(row)
                writer.metrics(done, row, advance=False, echo=cfg.run.progress)

        last_echo = [time.perf_counter()]

        def on_step(done: int, m: dict[str, float]) -> None:
            echo = bool(cfg.run.log_every) and done % cfg.run.log_every == 0
            row = {"epoch": done / per_epoch, **{f"train/{k}": v for k, v in m.items()}}
            if echo:
                now = time.perf_counter()
                row["time/step_s"] = (now - last_echo[0]) / cfg.run.log_every
                last_echo[0] = now
            writer.metrics(done, row, echo=echo and cfg.run.progress)
            if done % per_epoch == 0 or done == steps or (cfg.run.eval_every and done % cfg.run.eval_every == 0):
                run_eval(done)

        run_eval(0)
        t_train = time.perf_counter()
        losses = train_loop(DeepSpeedStepper(engine), n_train, loss_fn, steps=steps, batch_size=o.batch_size,
                            micro_batch_size=cfg.trainer.micro_batch_size, rows_per_example=rows_per_example,
                            seed=cfg.run.seed, on_step=on_step)
        out: dict[str, Any] = {
            **(summary or {}),
            "steps": len(losses),
            "train/first_loss": losses[0],
            "train/last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "time/train_s": round(time.perf_counter() - t_train, 2),
        }
        if history:
            out.update({k: v for k, v in history[-1].items() if k.startswith("eval/")})
            out.update({f"{k}_before_training": v for k, v in history[0].items() if k in ("eval/loss", "eval/pairwise_accuracy")})
        if cfg.run.save_final_model:
            out["final_model"] = os.path.join(cfg.run.dir, "final_model")
            save_pretrained_atomic(engine.module, tokenizer, out["final_model"],
                                   state_dict=full_state_dict(engine.module, cfg.trainer.zero_stage))
    except BaseException:
        writer.close()
        raise
    return writer.finish(out)
