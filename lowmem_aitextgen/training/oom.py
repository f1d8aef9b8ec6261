"""Recovering from out-of-memory during training, instead of losing the run.

When a step runs out of memory, OutOfMemoryRecovery (a callback: Lightning calls
it before tearing the run down) frees the step's gradients and writes the
resumable checkpoint of the last finished step.  The training run (run.py) then
asks cheaper_plan() for the plan to continue with, from that checkpoint, exactly
as resume=True would:

  1. half the micro-batch (the next smaller divisor of the effective batch),
     twice the accumulation: the same effective batch, the same data;
  2. at micro-batch 1, the next rung of `rungs`: a memory technique that keeps
     the checkpoint loadable (each block's weights gathered only while it
     computes, checkpointing, mixed precision without an adapter, chunked loss,
     updates inside backward where the optimizer was left open and a step is one
     micro-batch; never 8-bit AdamW or LoRA, whose state would not match the
     checkpoint's: those are the planner's tiers before training, budget.py);
  3. when nothing is left, a MemoryError, with the last good weights saved.

One process only: under several processes a rank's failure is not every rank's,
so there the error stops training as before.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator

import pytorch_lightning as pl
import torch

from .plan import TrainPlan, can_step_in_backward, default_chunk_tokens, mixed_precision

# Messages of allocators that fail with a plain RuntimeError (CPU, MPS) instead of torch.OutOfMemoryError.
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(exception: BaseException) -> bool:
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exception, RuntimeError) and any(m in str(exception).lower() for m in OOM_MESSAGES)


def cheaper_plan(plan: TrainPlan) -> tuple[str, TrainPlan] | None:
    """The plan to retry with after an out-of-memory step, and what changed; None if none is left."""
    smaller = smaller_micro_batch(plan)
    if smaller is not None:
        return f"micro-batch {smaller.micro_batch_size} x {smaller.accumulation} accumulation", smaller
    return next(rungs(plan), None)


def smaller_micro_batch(plan: TrainPlan) -> TrainPlan | None:
    """The next smaller micro-batch that divides the effective batch, with accumulation to match."""
    effective = plan.effective_batch_size
    smaller = max((d for d in range(1, plan.micro_batch_size) if effective % d == 0), default=None)
    if smaller is None:
        return None
    return dataclasses.replace(plan, micro_batch_size=smaller, accumulation=effective // smaller)


def rungs(plan: TrainPlan) -> Iterator[tuple[str, TrainPlan]]:
    """(what changed, plan) for each technique the checkpoint can continue in, cumulative, the cheapest
    last; the choices in plan.fixed (the user's) are never changed, nor the optimizer's state, nor an adapter's
    base dtype (the checkpoint holds them)."""
    explicit = plan.fixed
    if plan.gathered_for != "block":
        plan = dataclasses.replace(plan, gathered_for="block")
        yield "each block's weights gathered only while it computes", plan
    if "gradient_checkpointing" not in explicit and plan.n_layer and not plan.checkpoints_every_block:
        plan = plan.checkpointing_all()
        yield "gradient checkpointing", plan
    mixed = mixed_precision(plan.accelerator)
    if (not explicit & {"fp16", "precision"} and not plan.trains_adapter and plan.half_dtype is None
            and mixed):
        plan = dataclasses.replace(plan, precision=mixed)
        yield "mixed precision", plan
    if "chunked_loss" not in explicit and not plan.loss_chunk_tokens:
        plan = dataclasses.replace(plan, loss_chunk_tokens=default_chunk_tokens(plan.accelerator))
        yield "chunked loss", plan
    if "optimizer" not in explicit and not (plan.trains_adapter or plan.step_in_backward) and can_step_in_backward(
            plan.accumulation, plan.sharded, plan.precision):
        plan = dataclasses.replace(plan, step_in_backward=True)
        yield "updates inside backward (no gradient copy)", plan


def free_memory(trainer: pl.Trainer) -> None:
    """What the failed step held: gradients, then the allocator's cached blocks."""
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OutOfMemoryRecovery(pl.Callback):
    """On an out-of-memory error (one process only): free the step, checkpoint the last finished step
    and note where it happened; run.py decides what comes next."""

    def __init__(self, checkpoint: Callable[[pl.Trainer], None]) -> None:
        self.checkpoint = checkpoint
        self.out_of_memory_at: int | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not is_out_of_memory(exception) or trainer.world_size > 1:
            return
        free_memory(trainer)
        self.out_of_memory_at = trainer.global_step + 1
        self.checkpoint(trainer)
