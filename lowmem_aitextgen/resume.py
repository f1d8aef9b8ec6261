"""Resumable training: writing the checkpoint in output_dir, Ctrl-C, and random-number state.

A checkpoint is Lightning's own (weights that train, optimizer, scheduler, loop
counters, callback states) plus the random-number states, written between
optimizer steps to a temporary name and renamed, so a crash leaves the previous
one whole.  What order the data comes in, and where to pick it up, is data.py's.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from .callbacks import OptimizerStepCallback
from .io import STAGING_PREFIX


def save_checkpoint(trainer: pl.Trainer, path: str) -> None:
    """trainer.save_checkpoint (on every rank, as Lightning requires), made atomic."""
    staging = os.path.join(os.path.dirname(path), f"{STAGING_PREFIX}{os.path.basename(path)}")
    trainer.save_checkpoint(staging)
    if trainer.is_global_zero:
        if os.path.isdir(staging):  # sharded strategies write a folder
            shutil.rmtree(path, ignore_errors=True)
        else:
            with open(staging, "rb") as f:
                os.fsync(f.fileno())
        os.replace(staging, path)
    trainer.strategy.barrier("lowmem_aitextgen.save_checkpoint")


def discard_checkpoint(path: str) -> None:
    """A finished run's checkpoint: of no further use (the model is saved), it would cost the disk
    a second copy of weights and optimizer, and resume=True from it would repeat finished steps."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def random_states() -> dict[str, Any]:
    """Every random-number state training draws from (dropout, shuffling), as plain tensors and lists
    so that the checkpoint loads with torch.load(weights_only=True)."""
    numpy_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in states["python"]))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class StopOnInterrupt(OptimizerStepCallback):
    """Ctrl-C stops training after the current optimizer step instead of killing it.

    Lightning's own handling of KeyboardInterrupt ends the process with exit
    code 1, so we catch SIGINT ourselves: the first press asks to stop (the
    checkpoint and model are then saved as at the end of training and train()
    returns); a second press interrupts at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.requested = False
        self.reason: str | None = None
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)
        print("\nCtrl-C: stopping after this step and saving; press Ctrl-C again to stop at once.", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        # every rank must stop at the same step, whichever received the signal
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            self.reason = (f"interrupted (Ctrl-C) at step {trainer.global_step:,}; "
                           "train again with resume=True to continue")
            trainer.should_stop = True
