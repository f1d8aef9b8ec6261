"""Recovering from out-of-memory during training, instead of losing the run.

When a step runs out of memory, OutOfMemoryRecovery (a callback: Lightning calls
it before tearing the run down) frees the step's gradients and writes the
resumable checkpoint of the last finished step.  The training run (run.py) then
asks cheaper_plan() for the plan to continue with, from that checkpoint, exactly
as resume=True would:

  1. half the micro-batch (the next smaller divisor of the effective batch),
     twice the accumulation: the same effective batch, the same data;
  2. at micro-batch 1, the next memory technique of the max_memory ladder that
     keeps the checkpoint loadable (checkpointing, mixed precision without LoRA,
     chunked loss, updates inside backward where the optimizer was left open and
     a step is one micro-batch; not LoRA or another optimizer, whose state would
     not match);
  3. when nothing is left, a MemoryError, with the last good weights saved.

One process only: under several processes a rank's failure is not every rank's,
so there the error stops training as before.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import pytorch_lightning as pl
import torch

from .budget import ladder, smaller_micro_batch
from .plan import TrainPlan

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
    # micro-batch 1 now: the next rung whose checkpoint still loads (the same optimizer state and,
    # with LoRA, the same dtype of the frozen base), as if the user had fixed the others
    fixed = plan.fixed | {"optimizer"} | ({"precision"} if plan.trains_adapter else set())
    rungs = ladder(dataclasses.replace(plan, fixed=fixed), allow_lora=False, in_backward="optimizer" not in plan.fixed)
    next(rungs)  # the plan as given
    rung = next(rungs, None)
    return None if rung is None else (rung[0], dataclasses.replace(rung[1], fixed=plan.fixed))


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
