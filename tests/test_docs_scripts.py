"""aitextgen's README and docs pages, as scripts written in their style, run end to end with only the
import lines changed (offline: a hub cache built here stands in for GPT-2 124M)."""

import os

import pytest
from transformers import GPT2LMHeadModel

from conftest import corpus_text, fake_hub_cache, tiny_gpt2_config

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("aitextgen's documented scripts; the library calls beneath them are test_compat's and "
                    "test_loading's")


@pytest.fixture
def gpt2_cache(tmp_path):
    """'gpt2' as the hub would cache it (aitextgen's default cache_dir), small and offline."""
    config = tiny_gpt2_config(vocab_size=50257, n_positions=128, bos_token_id=50256, eos_token_id=50256)
    fake_hub_cache("aitextgen", "gpt2", GPT2LMHeadModel(config))


def test_the_readme_generation_example(gpt2_cache, capsys):
    from lowmem_aitextgen import aitextgen

    # Without any parameters, aitextgen() will download, cache, and load the 124M GPT-2 "small" model
    ai = aitextgen()

    ai.generate()
    ai.generate(n=3, max_length=100)
    ai.generate(n=3, prompt="I believe in unicorns because", max_length=100)
    ai.generate_to_file(n=10, prompt="I believe in unicorns because", max_length=100, temperature=1.2)

    printed = capsys.readouterr().out
    # n=3 prints three texts between two delimiter lines, or fewer where a text came out empty (this random model
    # now and then ends a text at its first token; aitextgen drops empty texts rather than remake them)
    assert 2 <= printed.count("\n" + "=" * 10 + "\n") <= 4 and "I believe in unicorns because" in printed
    written = [name for name in os.listdir(".") if name.startswith("ATG_") and name.endswith(".txt")]
    assert len(written) == 1
    # a random model may itself write runs of "=" (GPT-2 has such tokens): count the delimiter lines
    texts = open(written[0], encoding="utf-8").read().split("\n" + "=" * 20 + "\n")
    assert len(texts) == 11 and texts[-1] == "" and all(t.startswith("I believe in unicorns because")
                                                         for t in texts[:-1])


def test_the_dataset_docs(gpt2_cache, tmp_path):
    import csv

    for name, rows in (("politics1000.csv", 40), ("politics4000.csv", 160)):
        with open(name, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text"])
            text = corpus_text(60_000)
            writer.writerows([text[i * 300:(i + 1) * 300]] for i in range(rows))

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.TokenDataset import TokenDataset, merge_datasets

    data1 = TokenDataset("politics1000.csv", line_by_line=True, block_size=128)
    data2 = TokenDataset("politics4000.csv", line_by_line=True, block_size=128)
    data_merged = merge_datasets([data1, data2])
    assert data_merged.tokens.shape[0] == 2 * data1.tokens.shape[0]  # equalized to the smaller one

    data_merged.save()
    data = TokenDataset("dataset_cache.tar.gz", from_cache=True, block_size=128)
    assert (data.tokens == data_merged.tokens).all()

    ai = aitextgen()
    ai.train(data, num_steps=2, generate_every=0, save_every=0)
    assert os.path.isfile("trained_model/model.safetensors")


def test_the_loggers_docs(gpt2_cache):
    from pytorch_lightning import loggers

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.TokenDataset import TokenDataset

    with open("input.txt", "w", encoding="utf-8") as f:
        f.write(corpus_text(20_000))
    data = TokenDataset("input.txt", block_size=128)
    tb_logger = loggers.TensorBoardLogger("logs/")

    ai = aitextgen()
    ai.train(train_data=data, loggers=tb_logger, num_steps=2, generate_every=0, save_every=0)
    assert any(name.startswith("events.out.tfevents") for _, _, files in os.walk("logs") for name in files)
