"""Saves are atomic: a process killed mid-save leaves the previous model loadable."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, saving

SAVER = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2LMHeadModel, GPT2Config
    from lowmem_aitextgen import saving
    config = GPT2Config(vocab_size=50257, n_positions=64, n_embd=256, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    print("ready", flush=True)
    while True:
        with torch.no_grad():
            model.transformer.wte.weight.add_(1.0)
        saving.atomic_save(sys.argv[1], model)
""")


def test_sigkill_during_saves_never_corrupts(tmp_path):
    out = str(tmp_path / "model")
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257, n_positions=64, n_embd=256)).save_pretrained(out)
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(saving.__file__)))
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", SAVER, out], stdout=subprocess.PIPE, env=env)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        AutoModelForCausalLM.from_pretrained(out)  # raises if any file is torn
        aitextgen(model_folder=out)
    leftovers = [n for n in os.listdir(out) if n.startswith(".saving-")]
    assert len(leftovers) <= 4  # a killed save may leave its staging folder, never a torn model file


def test_save_and_save_for_upload(tmp_path):
    ai = aitextgen(config=tiny_gpt2_config(vocab_size=50257))
    ai.save(str(tmp_path / "plain"))
    assert sorted(os.listdir(tmp_path / "plain")) == ["config.json", "generation_config.json", "model.safetensors"]
    ai.save_for_upload(str(tmp_path / "upload"))
    assert {"tokenizer.json", "model.safetensors", "config.json"} <= set(os.listdir(tmp_path / "upload"))
    reloaded = aitextgen(model_folder=str(tmp_path / "upload"))
    assert torch.equal(reloaded.model.lm_head.weight, ai.model.lm_head.weight)


def test_safetensors_save_replaces_legacy_bin(tmp_path):
    model = GPT2LMHeadModel(tiny_gpt2_config())
    (tmp_path / "m").mkdir()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    saving.atomic_save(str(tmp_path / "m"), model)
    assert "pytorch_model.bin" not in os.listdir(tmp_path / "m")
    assert "model.safetensors" in os.listdir(tmp_path / "m")
