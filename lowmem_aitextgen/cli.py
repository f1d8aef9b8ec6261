"""The `lowmem_aitextgen` console script: aitextgen's verbs and flags (via fire)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import fire

from .aitextgen import aitextgen
from .estimate import estimate_memory
from .tokenizers import train_tokenizer
from .TokenDataset import TokenDataset


def _accepted(func: Any, kwargs: dict[str, Any], accepted: bool = True) -> dict[str, Any]:
    """The flags `func` names itself, or (accepted=False) all the others.

    aitextgen's CLI sent every flag to every call; that breaks as soon as a callee
    names its keyword arguments."""
    names = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if (k in names) == accepted}


def encode_cli(file_path: str, **kwargs: Any) -> None:
    """Encode and compress a dataset (written to cache_destination)."""
    TokenDataset(file_path, save_cache=True, **kwargs)


def train_cli(file_path: str, **kwargs: Any) -> None:
    """Train on a text file or an encoded .tar.gz cache."""
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    from_cache = file_path.endswith(".tar.gz")
    dataset_kwargs = _accepted(TokenDataset.__init__, kwargs)
    dataset_kwargs.setdefault("block_size", ai.model.config.n_positions)
    dataset = TokenDataset(file_path, from_cache=from_cache, tokenizer=ai.tokenizer, **dataset_kwargs)
    ai.train(dataset, **_accepted(ai.train, kwargs))


def generate_cli(to_file: bool = True, **kwargs: Any) -> None:
    """Generate from a trained model (model_folder=...) to a file or the console."""
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    generate_kwargs = _accepted(aitextgen.__init__, kwargs, accepted=False)
    if to_file:
        ai.generate_to_file(**generate_kwargs)
    else:
        ai.generate(**generate_kwargs)


def estimate_cli(model: str = "355M", **kwargs: Any) -> None:
    """Print the memory one training step needs: a GPT-2 size name, a config.json or a model folder."""
    if os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if os.path.isfile(model):
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(model)
    print(estimate_memory(model, **kwargs))


def train_tokenizer_cli(files: str, **kwargs: Any) -> None:
    """Train a byte-level BPE tokenizer on the given file(s)."""
    train_tokenizer(files, **kwargs)


COMMANDS = {
    "encode": encode_cli,
    "train": train_cli,
    "generate": generate_cli,
    "train_tokenizer": train_tokenizer_cli,
    "estimate": estimate_cli,
}


def main() -> None:
    fire.Fire(COMMANDS)


if __name__ == "__main__":
    main()
