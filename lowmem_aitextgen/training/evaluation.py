"""Held-out evaluation: the validation set, its loss, the best model kept and early stopping.

Everything here runs only when train() is given `val_data`; without it the run is the same as before,
step for step and file for file.

| piece | what it does | what it costs |
|---|---|---|
| `validation_datasets` | val_data as blocks: a file in consecutive, non-overlapping blocks of the training block size, a TokenDataset in such blocks of its own block_size (the last partial block left out), or a fraction of train_data held out | the held-out text is not trained on |
| `ValidatedModule` | Lightning's validation loop: eval mode, the plan's precision, chunked loss and micro-batch; the mean token cross-entropy, summed over every rank's share | a forward pass over the validation blocks every eval_every steps, no gradients or optimizer memory |
| `EvaluateLastStep` | the final step is evaluated too, so the model training ends with is weighed against the best | one more evaluation when num_steps is not a multiple of eval_every |
| `BestModel` | output_dir holds the best model by validation loss (saved atomically when the loss improves), early stopping, the history in the checkpoint | a model save at each improvement, in place of the periodic ones |

A held-out fraction (val_data=0.1): the text's tokens are cut into non-overlapping blocks of block_size
tokens and round(fraction x blocks) of them (at least one) are chosen by a fixed seed, HOLDOUT_SEED, the
same whatever seed= is: runs with other seeds or settings are compared on the same blocks, and a resumed
run holds out what the interrupted one held out.  Training then uses every window of block_size tokens
that touches no held-out token, so no token is in both sets.

eval_every counts optimizer steps; by default it is save_every, or num_steps // 10 when save_every=0
(plan.validation_interval decides it).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ..arguments import Arguments
from .callbacks import OptimizerStepCallback
from .chunked_loss import causal_lm_loss
from .data import seeded_generator
from .lightning_module import CausalLMModule
from .plan import Schedule
from .sharding import full_model, reshard

logger = logging.getLogger("lowmem_aitextgen")

HOLDOUT_SEED = 0  # the held-out blocks of val_data=<fraction>; fixed, see the module docstring
EARLY_STOPPING = "early_stopping"  # training_summary.json's stopped_because
METRIC = "val_loss"


# --- the arguments ---------------------------------------------------------------------


def check_arguments(args: Arguments) -> None:
    """What depends on more than one argument (each value alone is checked by arguments.TRAIN_RULES)."""
    from ..TokenDataset import check_text_file

    val_data = args.get("val_data")
    if val_data is None:
        for name in ("eval_every", "early_stopping_patience"):
            if args.get(name) is not None:
                raise ValueError(f"{name}={args[name]!r} needs a validation set; pass val_data= (a text file, a "
                                 "TokenDataset, or a fraction of train_data such as val_data=0.1), or leave it out.")
        return
    if isinstance(val_data, (str, os.PathLike)):
        check_text_file(val_data, "val_data", text=not args.get("from_cache", False))


# --- the data --------------------------------------------------------------------------


class TokenBlocks(Dataset):
    """Blocks of block_size tokens of one token array, starting at the given positions."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, block_size: int, line_by_line: bool = False) -> None:
        self.tokens = tokens
        self.starts = np.asarray(starts, dtype=np.int64)
        self.block_size = block_size
        self.line_by_line = line_by_line

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, item: int) -> torch.Tensor:
        start = int(self.starts[item])
        return torch.as_tensor(self.tokens[start:start + self.block_size].astype(np.int64, copy=False))


def consecutive_blocks(dataset: Dataset) -> Dataset:
    """A TokenDataset (every window of block_size tokens) as consecutive, non-overlapping blocks; any
    other dataset as it is, each item one block."""
    tokens, block_size = getattr(dataset, "tokens", None), getattr(dataset, "block_size", None)
    if tokens is None or block_size is None:
        return dataset
    starts = np.arange(0, tokens.shape[0] - block_size + 1, block_size)
    return TokenBlocks(tokens, starts, block_size, getattr(dataset, "line_by_line", False))


def holdout_split(dataset: Dataset, fraction: float, seed: int = HOLDOUT_SEED) -> tuple[Dataset, Dataset]:
    """(training, validation) from one dataset: a fraction of its non-overlapping blocks held out, and the
    windows that touch none of their tokens kept for training (a dataset without tokens: its items split)."""
    tokens, block_size = getattr(dataset, "tokens", None), getattr(dataset, "block_size", None)
    generator = np.random.default_rng(seed)
    if tokens is None or block_size is None:
        order = generator.permutation(len(dataset))
        held = _held_out_count(len(dataset), fraction, "items")
        return Subset(dataset, sorted(order[held:].tolist())), Subset(dataset, sorted(order[:held].tolist()))
    n_blocks = tokens.shape[0] // block_size
    held = np.sort(generator.permutation(n_blocks)[:_held_out_count(n_blocks, fraction, f"blocks of {block_size}")])
    in_validation = np.zeros(tokens.shape[0] + 1, dtype=np.int64)
    np.add.at(in_validation, held * block_size, 1)
    np.add.at(in_validation, (held + 1) * block_size, -1)
    held_before = np.concatenate([[0], np.cumsum(np.cumsum(in_validation)[:-1])])  # held-out tokens before i
    starts = np.arange(tokens.shape[0] - block_size + 1)
    clean = starts[held_before[starts + block_size] == held_before[starts]]
    if clean.size == 0:
        raise ValueError(f"val_data={fraction!r} leaves no window of {block_size} tokens for training; "
                         "pass a smaller fraction, a smaller block_size, or val_data as a file.")
    line_by_line = getattr(dataset, "line_by_line", False)
    return (TokenBlocks(tokens, clean, block_size, line_by_line),
            TokenBlocks(tokens, held * block_size, block_size, line_by_line))


def _held_out_count(n: int, fraction: float, unit: str) -> int:
    if n < 2:
        raise ValueError(f"val_data={fraction!r} needs train_data of at least 2 {unit}, and it has {n}; "
                         "add text, pass a smaller block_size, or pass val_data as a file.")
    return min(max(1, round(fraction * n)), n - 1)


def validation_datasets(train: Dataset, args: Arguments, encode: Callable[..., Dataset]
                        ) -> tuple[Dataset, Dataset | None]:
    """(training, validation) datasets for train()'s val_data; `encode(data, argument=, block_size=)` reads
    a file or checks a TokenDataset as train_data is (data.training_dataset)."""
    val_data = args.get("val_data")
    if val_data is None:
        return train, None
    if isinstance(val_data, float):
        train, validation = holdout_split(train, val_data)
        logger.info(f"val_data={val_data}: {len(validation):,} blocks held out of train_data for validation.")
        return train, validation
    block_size = getattr(train, "block_size", None)
    return train, consecutive_blocks(encode(val_data, argument="val_data", block_size=block_size))


class RankShare(Sampler[int]):
    """Each process's share of the validation blocks, in order (no padding: every block counted once).
    The rank is read when iterating, in the process group Lightning has set up by then."""

    def __init__(self, n_items: int) -> None:
        self.n_items = n_items

    def __iter__(self) -> Iterator[int]:
        rank, world_size = _rank_and_world_size()
        if self.n_items < world_size:  # a process with nothing to evaluate would leave the others waiting
            raise ValueError(f"val_data has {self.n_items} blocks, fewer than the {world_size} training processes; "
                             "give it more text, or hold out a larger fraction.")
        return iter(range(rank, self.n_items, world_size))

    def __len__(self) -> int:
        rank, world_size = _rank_and_world_size()
        return len(range(rank, self.n_items, world_size))


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def validation_loader(dataset: Dataset, plan: Any) -> DataLoader:
    """The plan's micro-batch, in order, with its own generator (data.seeded_generator)."""
    return DataLoader(dataset, batch_size=plan.micro_batch_size, sampler=RankShare(len(dataset)),
                      num_workers=plan.num_workers, pin_memory=plan.accelerator == "gpu",
                      generator=seeded_generator(0))


# --- the loss --------------------------------------------------------------------------


class ValidatedModule(CausalLMModule):
    """CausalLMModule with Lightning's validation loop: the mean next-token cross-entropy over every
    validation token, the same loss training minimises (chunked as the plan says)."""

    def on_validation_epoch_start(self) -> None:
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        tokens = batch[:, 1:].numel()  # every position but the first is predicted
        loss = causal_lm_loss(self.model, batch, self.plan.loss_chunk_tokens)
        self._loss_sum += loss.detach().double() * tokens
        self._tokens += tokens

    def on_validation_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(torch.stack([self._loss_sum, self._tokens]), reduce_op="sum")
        # every rank now holds the same value: sync_dist averages equal numbers (and keeps Lightning from
        # warning that an epoch-level metric is not synchronised)
        self.log(METRIC, (totals[0] / totals[1]).float(), prog_bar=True, batch_size=1, sync_dist=True)
        reshard(self.model)  # before the callbacks save the best model or the checkpoint (sharding.py)


# --- when to evaluate, and what to keep ---------------------------------------------------


class EvaluateLastStep(OptimizerStepCallback):
    """Lightning evaluates at the schedule's interval (val_check_interval) and whenever training is asked
    to stop (its hook for early stopping); asking at the last step is how the final model gets evaluated
    when num_steps is not a multiple of eval_every."""

    def __init__(self, schedule: Schedule) -> None:
        super().__init__()
        self.schedule = schedule

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        if self.schedule.must_ask_evaluation_at(trainer.global_step):
            trainer.should_stop = True


@dataclass
class ValidationHistory:
    """Every evaluation of the run (also those before a resume), the best one, and how many since."""

    evaluations: list[dict[str, float]] = field(default_factory=list)  # {"step": int, "loss": float}
    best_step: int | None = None
    best_loss: float | None = None
    without_improvement: int = 0
    stopped_early: bool = False

    def add(self, step: int, loss: float) -> bool:
        """Record an evaluation; True if it is the best so far (a NaN never is)."""
        self.evaluations.append({"step": step, "loss": loss})
        if math.isfinite(loss) and (self.best_loss is None or loss < self.best_loss):
            self.best_step, self.best_loss, self.without_improvement = step, loss, 0
            return True
        self.without_improvement += 1
        return False

    def summary_fields(self) -> dict[str, Any]:
        return {"validation": list(self.evaluations), "best_step": self.best_step, "best_val_loss": self.best_loss}


class ModelFiles(Protocol):
    """What BestModel saves through (outputs.RunFiles)."""

    def save_model(self, model: torch.nn.Module, skipped_steps: int) -> dict: ...

    def write_summary(self, model: torch.nn.Module, skipped_steps: int) -> dict: ...


class BestModel(Callback):
    """After each evaluation: save the model if its validation loss is the best so far (else only the
    summary), and stop once `patience` evaluations in a row brought no improvement.  The history is in
    the checkpoint (state_dict), so a resumed run remembers the best so far."""

    carried_fields = ("history",)  # what run.py brings back from spawned training processes

    def __init__(self, history: ValidationHistory, files: ModelFiles, patience: int | None,
                 write: Callable[[str], None]) -> None:
        self.history = history
        self.files = files
        self.patience = patience
        self.write = write

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or METRIC not in trainer.callback_metrics:
            return
        step, loss = trainer.global_step, float(trainer.callback_metrics[METRIC])
        improved = self.history.add(step, loss)
        if self.patience and self.history.without_improvement >= self.patience:
            self.history.stopped_early = trainer.should_stop = True
        model = full_model(pl_module.model) if improved else pl_module.model  # every rank: a sharded model gathers
        if not trainer.is_global_zero:
            return
        if improved:
            self.files.save_model(model, skipped_steps=pl_module.skipped_steps)
        else:
            self.files.write_summary(pl_module.model, skipped_steps=pl_module.skipped_steps)
        self.write(f"\033[1mStep {step:,}: validation loss {loss:.4f}" + (
            ", the best so far: model saved.\033[0m" if improved else
            f"; the best is {self.history.best_loss:.4f} at step {self.history.best_step:,}.\033[0m"))
        if self.history.stopped_early:
            self.write(f"Early stopping at step {step:,}: no improvement in {self.patience} evaluations; output_dir "
                       f"keeps the best model (step {self.history.best_step:,}, validation loss "
                       f"{self.history.best_loss:.4f}).")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.history)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in state_dict.items():
            setattr(self.history, name, value)


def keep_best_in_memory(model: torch.nn.Module, history: ValidationHistory, final_step: int, output_dir: str) -> None:
    """After training, the object holds what output_dir holds: where training went on past the best
    evaluation, the best model's weights are read back from output_dir into the (merged) trained model,
    one tensor at a time."""
    from ..loading import read_safetensors_into
    from .adapters import adapter_subfolder, is_adapter_model, read_adapter_into

    path = os.path.join(output_dir, "model.safetensors")
    if history.best_step is None or history.best_step == final_step or not os.path.isfile(path):
        return
    if is_adapter_model(model):  # an adapter beside its base (prefix tuning): the base never changed
        read_adapter_into(model, os.path.join(output_dir, adapter_subfolder(model)))
    else:
        with open(path, "rb") as f:
            read_safetensors_into(model, f)
    logger.info(f"The model of step {history.best_step:,} (validation loss {history.best_loss:.4f}), the best, is "
                f"in {output_dir} and in this object; the last step's was not kept.")
