"""TokenDataset under its old import path, on numpy 2 and transformers 5."""

import csv

import numpy as np
import pytest

from lowmem_aitextgen.TokenDataset import TokenDataset, merge_datasets

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("aitextgen's TokenDataset over the tokenizers package, which the oldest pass does not pin")


def test_bulk_file_equals_encoding_the_whole_text(corpus_file, tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=64)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    text = open(corpus_file, encoding="utf-8").read()
    expected = [i for line in text.splitlines(keepends=True) for i in tokenizer(line)["input_ids"]]
    assert data.tokens.tolist() == expected
    assert data.tokens.dtype == np.uint16
    assert len(data) == len(expected) - 64 + 1
    assert data[len(data) - 1].tolist() == expected[-64:]


def test_line_by_line_appends_eos_per_line(tmp_path, tokenizer_file):
    path = tmp_path / "lines.txt"
    path.write_text("first line\nsecond line\n", encoding="utf-8")
    data = TokenDataset(str(path), tokenizer_file=tokenizer_file, line_by_line=True, block_size=2)
    assert data.line_by_line
    eos = 0  # <|endoftext|> is the tokenizer's first special token
    assert data.tokens.tolist().count(eos) == 2


def test_csv_line_by_line_reads_first_column_skipping_header(tmp_path, tokenizer_file):
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], ["a, quoted text", "x"], ["another", "y"]])
    data = TokenDataset(str(path), tokenizer_file=tokenizer_file, line_by_line=True, block_size=2)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    assert tokenizer.decode(data.tokens.tolist()) == "a, quoted text<|endoftext|>another<|endoftext|>"


def test_texts_and_cache_round_trip(tmp_path, tokenizer_file):
    texts = ["Some text about lists.", "Another one about dicts."] * 20
    data = TokenDataset(texts=texts, tokenizer_file=tokenizer_file, block_size=8, save_cache=True,
                        cache_destination=str(tmp_path / "cache.tar.gz"))
    loaded = TokenDataset(str(tmp_path / "cache.tar.gz"), from_cache=True, block_size=8)
    assert np.array_equal(loaded.tokens, data.tokens)
    assert len(loaded) == len(data)
    data.save(str(tmp_path / "plain.npy"), compress=False)
    assert np.array_equal(TokenDataset(str(tmp_path / "plain.npy"), from_cache=True, block_size=8).tokens,
                          data.tokens)


def test_merge_datasets(tokenizer_file):
    a = TokenDataset(texts=["alpha beta gamma"] * 10, tokenizer_file=tokenizer_file, block_size=4)
    b = TokenDataset(texts=["delta"] * 30, tokenizer_file=tokenizer_file, block_size=4)
    merged = merge_datasets([a, b], equalize=False)
    assert merged.tokens.tolist() == a.tokens.tolist() + b.tokens.tolist()
    equal = merge_datasets([a, b])
    n = min(a.tokens.shape[0], b.tokens.shape[0])
    assert equal.tokens.tolist() == a.tokens[:n].tolist() + b.tokens[:n].tolist()
    with pytest.raises(ValueError, match="block sizes"):
        merge_datasets([a, TokenDataset(texts=["x y"] * 9, tokenizer_file=tokenizer_file, block_size=2)])


@pytest.mark.parametrize("content, error, match", [
    (None, FileNotFoundError, "does not exist"),
    ("DIR", IsADirectoryError, "is a folder"),
    (b"", ValueError, "empty"),
    (b"\x00\x01\x02binary", ValueError, "binary"),
    (b"caf\xe9 latin-1 text", ValueError, "not UTF-8"),
    # a 1 MiB file (the check's chunk) whose last byte starts a two-byte character: cut at the end of the file
    (b"a" * (2**20 - 1) + "\u00e9".encode()[:1], ValueError, r"data.txt' is not UTF-8 text: byte 1,048,575 \(line 1\)"),
    # a character the chunk boundary cuts, then a bad byte: found at its own offset
    (b"a\n" * (2**19 - 1) + b"a" + "\u00e9".encode() + b"\n\xff", ValueError, r"byte 1,048,578 \(line 524,289\) is b'\\xff'"),
])
def test_bad_files_get_clear_errors(tmp_path, tokenizer_file, content, error, match):
    path = tmp_path / "data.txt"
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match):
        TokenDataset(str(path), tokenizer_file=tokenizer_file, block_size=4)


def test_text_shorter_than_block_is_refused_with_fix(tokenizer_file):
    with pytest.raises(ValueError, match="smaller block_size"):
        TokenDataset(texts=["short"], tokenizer_file=tokenizer_file, block_size=64)


def test_a_cache_records_its_tokenizer_and_refuses_another(tmp_path, tokenizer_file):
    cache = str(tmp_path / "cache.tar.gz")
    data = TokenDataset(texts=["Some text about lists."] * 20, tokenizer_file=tokenizer_file, block_size=8)
    data.save(cache)
    same = TokenDataset(cache, from_cache=True, tokenizer_file=tokenizer_file, block_size=8)
    assert same.tokenizer_record == data.tokenizer_record and same.tokenizer_record["tokens"] == 1000
    assert TokenDataset(cache, from_cache=True, block_size=8).tokenizer_record == data.tokenizer_record
    with pytest.raises(ValueError, match="cache file_path=.* was encoded by another tokenizer .*1,000 tokens.* than "
                                         "the one given .*50,257 tokens"):
        TokenDataset(cache, from_cache=True, tokenizer=gpt2_tokenizer(), block_size=8)


def test_a_cache_replaced_without_its_record_loads_unchecked(tmp_path, tokenizer_file):
    """The record names the cache's hash: a cache written since (by aitextgen, say) is not judged by it."""
    import gzip

    cache = str(tmp_path / "cache.tar.gz")
    data = TokenDataset(texts=["Some text about lists."] * 20, tokenizer_file=tokenizer_file, block_size=8)
    data.save(cache)
    with gzip.open(cache, "wb") as f:
        np.save(f, data.tokens[:-1])
    loaded = TokenDataset(cache, from_cache=True, tokenizer=gpt2_tokenizer(), block_size=8)
    assert loaded.tokenizer_record is None and len(loaded.tokens) == len(data.tokens) - 1


def test_merging_datasets_of_two_tokenizers_is_refused(tokenizer_file):
    ours = TokenDataset(texts=["alpha beta gamma"] * 10, tokenizer_file=tokenizer_file, block_size=4)
    gpt2 = TokenDataset(texts=["alpha beta gamma"] * 10, block_size=4)
    with pytest.raises(ValueError, match="different tokenizers"):
        merge_datasets([ours, gpt2])
    assert merge_datasets([ours, ours]).tokenizer_record == ours.tokenizer_record


def test_paths_may_be_pathlib_paths(tmp_path, tokenizer_file):
    import pathlib

    text = tmp_path / "t.txt"
    text.write_text("Some text about lists. " * 20, encoding="utf-8")
    data = TokenDataset(text, tokenizer_file=pathlib.Path(tokenizer_file), block_size=8, save_cache=True,
                        cache_destination=tmp_path / "c.tar.gz")
    assert np.array_equal(TokenDataset(tmp_path / "c.tar.gz", from_cache=True, block_size=8).tokens, data.tokens)


def gpt2_tokenizer():
    from lowmem_aitextgen._compat import default_gpt2_vocab_files, gpt2_tokenizer_from_files

    return gpt2_tokenizer_from_files(*default_gpt2_vocab_files())
