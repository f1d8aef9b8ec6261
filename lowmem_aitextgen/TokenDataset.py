"""aitextgen's TokenDataset, encoding correctly on transformers 5 and numpy 2.

Same constructor, attributes and cache format as aitextgen 0.6.0; the
encoding (which overflowed under numpy 2) is encode_texts below, and the tokenizer construction
(empty under transformers 5) goes through _compat.

A cache's token ids mean something only with the tokenizer that made them.  save() writes, beside
the cache (aitextgen's format, unchanged), CACHE.json: the tokenizer's fingerprint (a hash of its
vocabulary), the block size and a hash of the cache it describes; loading the cache with another
tokenizer, here or in train(), is refused.  A cache without that record (aitextgen's, or copied
without it) loads as before.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import gzip
import hashlib
import itertools
import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import numpy as np
from aitextgen.TokenDataset import TokenDataset as _AitextgenTokenDataset
from aitextgen.TokenDataset import get_dtype, get_lines_in_file, get_lines_in_file_csv  # noqa: F401  (work as they are)

from . import _compat
from .saving import read_json

logger = logging.getLogger("lowmem_aitextgen")

CSV_FIELD_LIMIT = 2**31 - 1  # a text per row can be long; csv's default stops at 128 KiB
RECORD_SUFFIX = ".json"  # beside a cache: what made it


def tokenizer_record(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer's ids: a hash of its vocabulary (token -> id), and its size and name."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]), ensure_ascii=False)
    return {"vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest(), "tokens": len(tokenizer),
            "name": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__}


def check_same_tokenizer(record: dict[str, Any] | None, tokenizer: Any, what: str) -> None:
    """Refuse token ids encoded by another tokenizer than `tokenizer` (`record`: tokenizer_record's)."""
    if record is None or tokenizer is None:
        return
    ours = tokenizer_record(tokenizer)
    if ours["vocab_sha256"] != record.get("vocab_sha256"):
        raise ValueError(f"{what} was encoded by another tokenizer ({record.get('name')!r}, {record.get('tokens'):,} "
                         f"tokens) than the one given ({ours['name']!r}, {ours['tokens']:,} tokens): its token ids "
                         "would mean other words. Encode the text again with this tokenizer, or use the tokenizer "
                         "it was made with.")


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_cache_record(cache: str) -> dict[str, Any] | None:
    """The record save() wrote beside `cache`, if it describes this very file (else None)."""
    try:
        record = read_json(os.fspath(cache) + RECORD_SUFFIX)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("cache_sha256") != _file_sha256(cache):
        return None  # a record of an earlier cache by that name
    return record


NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_text_file(file_path: Any, argument: str = "file_path", text: bool = True) -> None:
    """Clear errors for the ways a training file can be wrong, before any work: every text file an
    argument names (train_data, val_data, file_path, train_tokenizer's files) is checked here."""
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path to a text file, not {type(file_path).__name__}.")
    if not os.path.exists(file_path):
        raise FileNotFoundError(f"{argument}={str(file_path)!r} does not exist; check the path.")
    if os.path.isdir(file_path):
        raise IsADirectoryError(f"{argument}={str(file_path)!r} is a folder; pass one text file inside it.")
    mode = os.stat(file_path).st_mode
    kind = next((name for test, name in NOT_REGULAR if test(mode)), None)
    if kind is not None:
        raise ValueError(f"{argument}={str(file_path)!r} is {kind}, not a regular file: it is read more than once "
                         f"(checked, then encoded), which {kind} cannot be. Save its text to a file first (e.g. "
                         f"cat {file_path} > data.txt) and pass that file.")
    if os.path.getsize(file_path) == 0:
        raise ValueError(f"{argument}={str(file_path)!r} is empty; there is nothing to train on.")
    if not text:
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines, has_text = 0, 0, False
    with open(file_path, "rb") as f:
        # up to and including the empty read at the end: final=True there finds a character cut off at the end
        # of the file, also where the file ends on a chunk boundary
        while True:
            chunk = f.read(1 << 20)
            if b"\x00" in chunk:
                raise ValueError(f"{argument}={str(file_path)!r} looks binary (it has NUL bytes); "
                                 "pass a UTF-8 text file.")
            pending = decoder.getstate()[0]  # the start of a character the previous chunk cut
            try:
                has_text = bool(decoder.decode(chunk, final=not chunk).strip()) or has_text
            except UnicodeDecodeError as error:  # its positions count from the pending bytes
                raise _not_utf8(argument, file_path, pending + chunk, error, offset - len(pending),
                                lines - pending.count(b"\n")) from error
            if not chunk:
                break
            offset += len(chunk)
            lines += chunk.count(b"\n")
    if not has_text:
        raise ValueError(f"{argument}={str(file_path)!r} holds only whitespace; there is nothing to train on.")


def _not_utf8(argument: str, file_path: Any, chunk: bytes, error: UnicodeDecodeError, offset: int,
              lines: int) -> ValueError:
    """Where the text stops being UTF-8 (byte offset, line, the bytes), and the two fixes; `chunk` starts at
    byte `offset`, after `lines` lines."""
    start = error.start
    line = lines + chunk[:start].count(b"\n") + 1
    path = os.fspath(file_path)
    return ValueError(
        f"{argument}={str(file_path)!r} is not UTF-8 text: byte {offset + error.start:,} (line {line:,}) is "
        f"{chunk[start:max(error.end, start + 1)]!r} ({error.reason}). Convert it from the encoding it was written in, e.g. "
        f"iconv -f latin1 -t utf-8 {path} > converted.txt, or drop what is not UTF-8: "
        f"iconv -c -f utf-8 -t utf-8 {path} > cleaned.txt.")


def _read_texts(file_path: str, line_by_line: bool, header: bool, eos_token: str,
                read: dict[str, Any] | None = None) -> Iterator[str]:
    """The texts aitextgen 0.6.0 encoded from a file (checked to be UTF-8 by check_text_file):
    lines, or a CSV's first column (its header row skipped in line-by-line mode)."""
    is_csv = file_path.endswith(".csv")
    read = {} if read is None else read  # what was read, for the message when nothing is left to encode
    read.update(csv=is_csv, header=None, texts=0)
    # Bulk text keeps its newlines (newline="\n"); line-by-line uses universal newlines.
    with open(file_path, encoding="utf-8", newline=None if line_by_line else "\n") as f:
        skipped = 0
        if is_csv and line_by_line and header:
            read["header"] = f.readline().rstrip("\r\n")  # aitextgen also dropped the first line of plain .txt files
            skipped = 1
        rows = (row[0] for row in _csv_rows(f, file_path, skipped) if row) if is_csv else f
        for text in rows:
            read["texts"] += 1
            yield text + eos_token


def _nothing_read(file_path: str, line_by_line: bool, read: dict[str, Any]) -> ValueError:
    """A file that gave no text to encode, and what was read of it."""
    if read.get("csv") and read.get("header") is not None:
        what = (f"it was read as CSV (line_by_line=True, header=True): its first line, {read['header'][:80]!r}, "
                "was taken as the header row and no rows follow it. Add rows below the header, or pass "
                "header=False if that line is text")
    elif read.get("csv"):
        what = (f"it was read as CSV ({'line_by_line=True' if line_by_line else 'bulk text'}) and no row has a "
                "first column to train on. Put the text in the first column")
    else:
        what = f"{read.get('texts', 0)} lines were read and none encodes to a token. Add text"
    return ValueError(f"{file_path!r} gives no text to train on: {what}.")


def _csv_rows(f: TextIO, file_path: str, skipped_lines: int) -> Iterator[list[str]]:
    """csv rows, parsed strictly: an unterminated quote is an error naming the line it opened on,
    not the rest of the file merged into one text."""
    with _csv_field_limit(CSV_FIELD_LIMIT):
        reader = csv.reader(f, strict=True)
        while True:
            line = skipped_lines + reader.line_num + 1
            try:
                yield next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                raise ValueError(f"{file_path!r} is not valid CSV from line {line} on ({error}); close the quote "
                                 "there (a quote inside a field is written twice: \"\"), or pass a .txt file.") from error


@contextlib.contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    previous = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(previous)


class TokenDataset(_AitextgenTokenDataset):
    """Token ids of a text, served as overlapping blocks of block_size tokens.

    :param file_path: text/CSV file, or a cache written by save() with from_cache=True.
    :param texts: a list of texts instead of a file.
    :param line_by_line: each line (or CSV row) is one text ending in eos_token.
    :param block_size: tokens per training example (the model's context by default in train()).
    """

    def __init__(
        self,
        file_path: str | None = None,
        vocab_file: str | None = None,
        merges_file: str | None = None,
        tokenizer: Any = None,
        tokenizer_file: str | None = None,
        texts: list[str] | None = None,
        line_by_line: bool = False,
        from_cache: bool = False,
        header: bool = True,
        save_cache: bool = False,
        cache_destination: str = "dataset_cache.tar.gz",
        compress: bool = True,
        block_size: int = 1024,
        tokenized_texts: Any = None,
        text_delim: str = "\n",
        bos_token: str = _compat.SPECIAL_TOKEN,
        eos_token: str = _compat.SPECIAL_TOKEN,
        unk_token: str = _compat.SPECIAL_TOKEN,
        pad_token: str = _compat.SPECIAL_TOKEN,
        progress_bar_refresh_rate: int = 20,
        **kwargs: Any,
    ) -> None:
        from .arguments import as_path, parameter_names, reject_unknown

        reject_unknown("TokenDataset()", kwargs, parameter_names(TokenDataset.__init__))
        file_path, vocab_file, merges_file, tokenizer_file, cache_destination = map(
            as_path, (file_path, vocab_file, merges_file, tokenizer_file, cache_destination))
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive integer, e.g. 1024 for GPT-2.")
        self.block_size = block_size
        self.line_by_line = False
        self.file_path = file_path
        self.tokenizer_record: dict[str, Any] | None = None  # the tokenizer that made the ids, where known

        if tokenized_texts is not None:  # merge_datasets() hands over finished tokens
            self.file_path = "merged TokenDataset"
            self.str_suffix = "by merging TokenDatasets."
            self._set_tokens(np.asarray(tokenized_texts))
            return
        if texts is None and file_path is None:
            raise ValueError("TokenDataset needs texts=[...] or file_path='data.txt'.")

        if from_cache:
            given = tokenizer
            if given is None and (tokenizer_file is not None or vocab_file is not None):
                given = _tokenizer(tokenizer_file, vocab_file, merges_file, bos_token, eos_token, unk_token, pad_token)
            self._load_cache(file_path, given, line_by_line)
            return

        if tokenizer is None:
            tokenizer = _tokenizer(tokenizer_file, vocab_file, merges_file, bos_token, eos_token, unk_token,
                                   pad_token)
        self.tokenizer_record = tokenizer_record(tokenizer)

        if save_cache and file_path is not None and _same_file(cache_destination, file_path):
            raise ValueError(f"cache_destination={cache_destination!r} is the text being encoded; saving the cache "
                             "there would replace the text. Name another file, e.g. 'dataset_cache.tar.gz'.")
        if texts is not None:
            self.str_suffix = "via application."
            tokens = encode_texts((text + eos_token for text in texts), tokenizer)
        else:
            check_text_file(file_path)
            self.line_by_line = line_by_line
            if str(file_path).endswith(".csv") and not line_by_line:
                logger.warning("You are tokenizing a CSV file, but you did not set line_by_line=True.")
            self.str_suffix = f"from {'line-by-line ' if line_by_line else ''}file at {file_path}."
            # Bulk text is one stream: no eos between lines, as in aitextgen.
            read: dict[str, Any] = {}
            texts_iter = _read_texts(str(file_path), line_by_line, header, eos_token if line_by_line else "", read)
            tokens = encode_texts(texts_iter, tokenizer)
            if tokens.shape[0] == 0:
                raise _nothing_read(str(file_path), line_by_line, read)
        self._set_tokens(tokens)
        if save_cache:
            self.save(cache_destination, compress=compress)

    def _load_cache(self, file_path: str, tokenizer: Any, line_by_line: bool) -> None:
        """The tokens of a cache save() wrote; refused if its record names another tokenizer than `tokenizer`
        (None: not checked here; train() checks against the model's)."""
        check_text_file(file_path, text=False)
        open_func = gzip.open if str(file_path).endswith(".gz") else open
        with open_func(file_path, "rb") as f:
            tokens = np.load(f)
        record = read_cache_record(file_path)
        self.tokenizer_record = record.get("tokenizer") if record else None
        check_same_tokenizer(self.tokenizer_record, tokenizer, f"The cache file_path={str(file_path)!r}")
        self.line_by_line = line_by_line
        self.str_suffix = "via cache."
        self._set_tokens(tokens)
        logger.info(repr(self))

    def save(self, cache_destination: str = "dataset_cache.tar.gz", compress: bool = True) -> None:
        """aitextgen's cache (the token ids, gzip-compressed unless compress=False), written under a
        temporary name and renamed, so an interrupted save leaves the earlier cache whole."""
        from .saving import atomic_file, atomic_write_bytes

        if self.tokens.shape[0] == 0:
            raise ValueError("The TokenDataset has no tokens to save.")
        if not compress and cache_destination == "dataset_cache.tar.gz":
            cache_destination = "dataset_cache.npy"  # aitextgen's name for an uncompressed cache
        logger.info(f"Caching {'and compressing ' if compress else ''}dataset to {cache_destination}")
        with atomic_file(cache_destination) as f:
            if compress:
                with gzip.GzipFile(fileobj=f, mode="wb") as zipped:
                    np.save(zipped, self.tokens)
            else:
                np.save(f, self.tokens)
        if self.tokenizer_record is not None:  # after the cache: it names the cache's hash, so never a stale one
            record = {"tokenizer": self.tokenizer_record, "block_size": self.block_size,
                      "line_by_line": self.line_by_line, "cache_sha256": _file_sha256(cache_destination)}
            atomic_write_bytes(os.fspath(cache_destination) + RECORD_SUFFIX, json.dumps(record, indent=1).encode())

    def _set_tokens(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.set_block_size(self.block_size)

    def set_block_size(self, block_size: int) -> None:
        """Serve blocks of `block_size` tokens from the encoded text."""
        n_tokens = self.tokens.shape[0]
        if n_tokens < block_size:
            raise ValueError(
                f"The text encodes to {n_tokens:,} tokens, fewer than block_size={block_size:,}; "
                f"add text or pass a smaller block_size (at most {n_tokens:,})."
            )
        self.block_size = block_size
        # Every start position whose block fits (aitextgen dropped the last one).
        self.num_subsets = n_tokens - block_size + 1


def _tokenizer(tokenizer_file: str | None, vocab_file: str | None, merges_file: str | None, bos_token: str,
               eos_token: str, unk_token: str, pad_token: str) -> Any:
    """The tokenizer aitextgen's TokenDataset builds from its arguments (GPT-2's by default)."""
    special = dict(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token)
    if tokenizer_file is not None:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=os.fspath(tokenizer_file), **special)
    default_vocab, default_merges = _compat.default_gpt2_vocab_files()
    return _compat.gpt2_tokenizer_from_files(vocab_file or default_vocab, merges_file or default_merges, **special)


def encode_tokens_from_file(file_path: str, eos_token: str, tokenizer: Any, newline: str | None = None,
                            header: bool = True, progress_bar_refresh_rate: int = 20,
                            batch_size: int = 1024) -> np.ndarray:
    """aitextgen's: each line (or CSV row) followed by eos_token, as one array of token ids (numpy 2 safe)."""
    check_text_file(file_path)
    return encode_texts(_read_texts(str(file_path), True, header, eos_token), tokenizer, batch_size)


def encode_tokens_from_list(texts: list[str], eos_token: str, tokenizer: Any, progress_bar_refresh_rate: int = 20,
                            batch_size: int = 1024) -> np.ndarray:
    """aitextgen's: each text followed by eos_token, as one array of token ids (numpy 2 safe)."""
    return encode_texts((text + eos_token for text in texts), tokenizer, batch_size)


def _same_file(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def merge_datasets(datasets: list[TokenDataset], equalize: bool = True) -> TokenDataset:
    """Concatenate TokenDatasets (same tokenizer and block_size); equalize takes as
    many tokens from each as the smallest has.  aitextgen's version handed a Python
    list to TokenDataset, which then failed on ``.shape``."""
    if not isinstance(datasets, list) or len(datasets) < 2:
        raise ValueError("merge_datasets needs a list of at least two TokenDatasets.")
    block_size = datasets[0].block_size
    if any(d.block_size != block_size for d in datasets):
        raise ValueError("The datasets have different block sizes; build them with the same block_size.")
    records = {json.dumps(d.tokenizer_record, sort_keys=True) for d in datasets if getattr(d, "tokenizer_record", None)}
    if len(records) > 1:
        raise ValueError("The datasets were encoded by different tokenizers, so the same id means different words "
                         "in them; encode every text with one tokenizer.")
    smallest = min(d.tokens.shape[0] for d in datasets)
    parts = [d.tokens[:smallest] if equalize else d.tokens for d in datasets]
    merged = TokenDataset(tokenized_texts=np.concatenate(parts), block_size=block_size)
    merged.tokenizer_record = json.loads(records.pop()) if records else None
    return merged


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """Smallest unsigned dtype that holds every token id.

    aitextgen picked the same dtypes but filled arrays with -1 as a sentinel:
    ``np.full(..., -1, dtype=np.uint16)`` raises OverflowError under numpy 2
    (NEP 50), so TokenDataset could not encode anything.  We never need a
    sentinel: ids are streamed straight into a flat array.
    """
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    return np.uint64


def encode_texts(texts: Iterable[str], tokenizer, batch_size: int = 1024) -> np.ndarray:
    """Encode texts in batches into one flat token array (numpy-2 safe)."""
    dtype = token_dtype(len(tokenizer))
    chunks: list[np.ndarray] = []
    texts = iter(texts)
    while batch := list(itertools.islice(texts, batch_size)):
        ids = tokenizer(
            batch,
            add_special_tokens=False,
            return_token_type_ids=False,
            return_attention_mask=False,
        )["input_ids"]
        chunks.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
