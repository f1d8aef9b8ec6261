"""tokenizers: aitextgen's train_tokenizer, both of its outputs (their bad input: test_faults_files.py)."""

import json
import os

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.tokenizers import train_tokenizer


def test_a_serialized_tokenizer_is_one_json_file_that_aitextgen_loads(corpus_file, tmp_path):
    train_tokenizer(corpus_file, vocab_size=500, prefix=str(tmp_path / "mine"))
    assert os.listdir(tmp_path) == ["mine.tokenizer.json"]
    assert json.load(open(tmp_path / "mine.tokenizer.json"))["model"]["type"] == "BPE"
    from conftest import tiny_gpt2_config

    ai = aitextgen(tokenizer_file=str(tmp_path / "mine.tokenizer.json"), config=tiny_gpt2_config(vocab_size=500))
    assert len(ai.tokenizer) == 500


def test_vocab_and_merges_files_in_save_path_build_the_same_tokenizer(corpus_file, tmp_path):
    train_tokenizer(corpus_file, vocab_size=500, prefix="mine", serialize=False, save_path=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["mine-merges.txt", "mine-vocab.json"]
    from conftest import tiny_gpt2_config

    ai = aitextgen(vocab_file=str(tmp_path / "mine-vocab.json"), merges_file=str(tmp_path / "mine-merges.txt"),
                   config=tiny_gpt2_config(vocab_size=500))
    text = "The quick brown fox"
    assert ai.tokenizer.decode(ai.tokenizer(text)["input_ids"]) == text
