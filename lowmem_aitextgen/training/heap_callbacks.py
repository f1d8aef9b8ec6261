"""glibc's heap while training, on every device (the host's heap): the settings the plan names, in force for
the whole of training, and with the heap held its release at every block.  The settings themselves, and why,
are heap.py's; these callbacks put them in force and undo them when training ends or fails.

| callback         | saves                                            | costs                                      |
|------------------|--------------------------------------------------|--------------------------------------------|
| GlibcHeap        | the plan's glibc settings, whatever ran before   | nothing between the steps changes them     |
| ReleaseFreedHeap | heap fragmentation, page faults: freed memory    | freed memory resident till the block ends, |
|                  | reused within a block                            | refaulted                                  |

Measurements: benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Callable

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn

from ..heap import glibc_heap_available, release_freed_heap, training_settings
from ..heap import use as use_heap_settings
from .callbacks import WhileTraining
from .checkpointing import transformer_blocks
from .plan import TrainPlan


class GlibcHeap(WhileTraining):
    """glibc's settings for the length of training: those the plan names (heap.training_settings), put in
    force when training starts, whatever ran before it (the planner's probes, an earlier run), and set back
    when it ends.  Nothing between the steps changes them (heap.py's rules)."""

    def __init__(self, hold: bool) -> None:
        super().__init__(self._use)
        self.settings = training_settings(hold)

    def _use(self, model: nn.Module) -> Callable[[], None]:
        return use_heap_settings(self.settings) or (lambda: None)


class ReleaseFreedHeap(WhileTraining):
    """With the heap held (heap.HELD, GlibcHeap): smaller freed memory is kept for reuse within a transformer
    block and given back at each block's start in forward and end in backward, before each optimizer step
    and when training ends.

    Why at every block: each block leaves a few long-lived tensors (a checkpointed block's input, the
    autograd graph's) above the memory its temporaries freed, so the next block's temporaries do not fit
    the holes and glibc grows the heap: left alone, a checkpointed 355M LoRA step at block 512 kept about
    1.2 GB of freed heap resident (benchmarks/RESULTS.md)."""

    def __init__(self, release: Callable[[], object] = release_freed_heap) -> None:
        super().__init__(self._hold)
        self.release = release

    def _hold(self, model: nn.Module) -> Callable[[], None]:
        hooks = [block.register_forward_pre_hook(self._at_block) for block in transformer_blocks(model)]
        self.release()

        def stop_holding() -> None:
            for hook in hooks:
                hook.remove()
            self.release()

        return stop_holding

    def _at_block(self, block: nn.Module, args: tuple) -> None:
        """Release now, and once more when backward has passed this block (its input's gradient is made)."""
        self.release()
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if hidden is not None and hidden.requires_grad and torch.is_grad_enabled():
            hidden.register_hook(self._after_block_backward)

    def _after_block_backward(self, grad: torch.Tensor) -> None:
        self.release()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.release()


def heap_callbacks(plan: TrainPlan) -> list[Callback]:
    """glibc's callbacks for a plan (plan.hold_freed_heap), where glibc's heap can be set."""
    if not glibc_heap_available():
        return []
    return [GlibcHeap(plan.hold_freed_heap), *([ReleaseFreedHeap()] if plan.hold_freed_heap else [])]
