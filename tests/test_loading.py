"""Constructor parity: hub ids (offline, from a cache the test builds), folders, configs, tokenizers."""

import json
import shutil

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import corpus_text, fake_hub_cache, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen._compat import default_gpt2_vocab_files, gpt2_tokenizer_from_files


def test_hub_model_loads_offline_from_cache(tmp_path):
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "gpt2", model)
    ai = aitextgen(cache_dir=str(tmp_path / "cache"))  # aitextgen(): GPT-2 124M from the hub
    assert torch.equal(ai.model.transformer.wte.weight, model.transformer.wte.weight)
    assert len(ai.tokenizer) == 50257


def test_tf_gpt2_names_the_hub_model_when_offline(tmp_path):
    with pytest.raises(OSError, match=r"(?s)'gpt2-medium'.*model_folder="):
        aitextgen(tf_gpt2="355M", cache_dir=str(tmp_path / "empty"))
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "gpt2-medium", model)
    ai = aitextgen(tf_gpt2="355M", cache_dir=str(tmp_path / "cache"))
    assert ai.gradient_checkpointing is True  # aitextgen's intent for 355M and up


def test_non_gpt2_hub_model_brings_its_tokenizer(tmp_path):
    vocab, merges = default_gpt2_vocab_files()
    tokenizer = gpt2_tokenizer_from_files(vocab, merges)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "someone/tiny-lm", model, tokenizer)
    ai = aitextgen(model="someone/tiny-lm", cache_dir=str(tmp_path / "cache"))
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="gpt2"), OSError, r"(?s)'gpt2'.*HF_HUB_OFFLINE"),
    (dict(tf_gpt2="999M"), ValueError, "not a GPT-2 size"),
    (dict(model_folder="missing"), FileNotFoundError, "does not exist"),
    (dict(config="missing.json"), FileNotFoundError, "does not exist"),
    (dict(tokenizer_file="missing.json", config=tiny_gpt2_config()), FileNotFoundError, "tokenizer_file"),
    (dict(vocab_file="v.json", config=tiny_gpt2_config()), ValueError, "together"),
])
def test_constructor_errors(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        aitextgen(cache_dir=str(tmp_path / "empty"), **kwargs)


def test_config_path_and_vocab_merges(tmp_path):
    tiny_gpt2_config(vocab_size=50257).save_pretrained(tmp_path)
    vocab, merges = default_gpt2_vocab_files()
    shutil.copy(vocab, tmp_path / "vocab.json")
    shutil.copy(merges, tmp_path / "merges.txt")
    ai = aitextgen(config=str(tmp_path / "config.json"), vocab_file=str(tmp_path / "vocab.json"),
                   merges_file=str(tmp_path / "merges.txt"))
    assert ai.model.config.n_layer == 2
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_finetune_local_gpt2_with_default_tokenizer(tmp_path):
    """A GPT-2-architecture model in a local folder, fine-tuned with GPT-2's own BPE."""
    config = tiny_gpt2_config(vocab_size=50257, n_positions=64, bos_token_id=50256, eos_token_id=50256)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    (tmp_path / "data.txt").write_text(corpus_text(20_000), encoding="utf-8")
    ai = aitextgen(model_folder=str(tmp_path / "base"))
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]
    ai.train(str(tmp_path / "data.txt"), num_steps=20, batch_size=4, learning_rate=1e-3,
             save_every=0, generate_every=0, output_dir=str(tmp_path / "tuned"))
    tuned = aitextgen(model_folder=str(tmp_path / "tuned"))
    assert not torch.equal(tuned.model.transformer.h[0].attn.c_attn.weight,
                           GPT2LMHeadModel.from_pretrained(tmp_path / "base").transformer.h[0].attn.c_attn.weight)
    assert json.load(open(tmp_path / "tuned" / "config.json"))["n_layer"] == 2
    assert isinstance(tuned.generate_one(max_length=20, seed=3), str)


@pytest.mark.parametrize("chooser", ["config", "model_folder", "tf_gpt2"])
def test_model_names_a_tokenizer_only_when_it_chose_the_model(tmp_path, chooser):
    """aitextgen 0.6.0 read a tokenizer named after model= only in its hub branch: with tf_gpt2=,
    model_folder= or config= the model comes from there and the tokenizer from the usual places (here
    GPT-2's: offline, a hub tokenizer for 'trained_model/pytorch_model.bin' would fail)."""
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    model.save_pretrained(tmp_path / "folder")
    fake_hub_cache(str(tmp_path / "cache"), "gpt2", model)
    chosen = {"config": dict(config=tiny_gpt2_config(vocab_size=50257)),
              "model_folder": dict(model_folder=str(tmp_path / "folder")),
              "tf_gpt2": dict(tf_gpt2="124M")}[chooser]
    ai = aitextgen(model="trained_model/pytorch_model.bin", cache_dir=str(tmp_path / "cache"), **chosen)
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_a_hub_model_that_brings_its_tokenizer_wins_over_tokenizer_file(tmp_path, tokenizer_file, caplog):
    """As in aitextgen: model='owner/name' (not a GPT-2) loads its own tokenizer and nothing else; we say so."""
    vocab, merges = default_gpt2_vocab_files()
    fake_hub_cache(str(tmp_path / "cache"), "someone/tiny-lm", GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257)),
                   gpt2_tokenizer_from_files(vocab, merges))
    ai = aitextgen(model="someone/tiny-lm", tokenizer_file=tokenizer_file, cache_dir=str(tmp_path / "cache"))
    assert len(ai.tokenizer) == 50257
    assert any("tokenizer_file ignored: model='someone/tiny-lm' brings its own tokenizer" in r.message
               for r in caplog.records)
