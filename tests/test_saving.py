"""saving: atomic saves (a process killed mid-save leaves the previous model loadable), streamed weights."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, saving
from lowmem_aitextgen.training import outputs

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("our writers; transformers' and peft's loaders of what they write are test_adapters' marked tests")

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


def lora_model_as_trained():
    """A LoRA model as training leaves it: adapters that changed, the frozen base held in bf16."""
    from lowmem_aitextgen.training.adapter_settings import AdapterSettings
    from lowmem_aitextgen.training.adapters import add_adapter
    from lowmem_aitextgen.training.storage16 import cast_frozen_weights

    torch.manual_seed(0)
    model = add_adapter(GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257)), AdapterSettings.lora(r=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    cast_frozen_weights(model, torch.bfloat16)
    return model


def test_the_streamed_merged_save_holds_an_fp32_merge_and_loads_everywhere(tmp_path):
    """model.safetensors written a tensor at a time holds exactly what merging the adapters into an fp32
    copy of the (bf16-held) base gives, under save_pretrained's names; transformers, peft and aitextgen
    load the folder; the merge in place (what the object keeps) is that merge rounded once to bf16."""
    import copy

    from safetensors.torch import load_file

    model = lora_model_as_trained()
    reference = copy.deepcopy(model).float().merge_and_unload()
    in_place = copy.deepcopy(model).merge_and_unload()
    outputs.save_model(str(tmp_path / "m"), model, merged_dtype=torch.float32)
    written = load_file(tmp_path / "m" / "model.safetensors")
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    assert written.keys() == expected.keys()
    for key, value in expected.items():
        assert written[key].dtype == torch.float32 and torch.equal(written[key], value), key
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(aitextgen(model_folder=str(tmp_path / "m")).model.transformer.h[0].attn.c_attn.weight,
                       reference.transformer.h[0].attn.c_attn.weight)
    assert os.path.isfile(tmp_path / "m" / "lora_adapter" / "adapter_model.safetensors")
    for key, value in in_place.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, reference.state_dict()[key].to(value.dtype)), key


SAVE_PEAK = textwrap.dedent("""
    import sys
    import pytorch_lightning as pl
    from transformers import GPT2Config
    from lowmem_aitextgen import aitextgen

    def high_water_mark():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    class AtTrainingEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            marks["training"] = high_water_mark()

    marks = {}
    data, tokenizer, output_dir = sys.argv[1:4]
    ai = aitextgen(tokenizer_file=tokenizer, config=GPT2Config(vocab_size=1000, n_positions=32, n_layer=6, n_embd=768,
                                                               n_head=12, bos_token_id=0, eos_token_id=0))
    ai.train(data, lora=True, num_steps=2, output_dir=output_dir, generate_every=0, save_every=0, fp16=True,
             callbacks=[AtTrainingEnd()])
    print(marks["training"], high_water_mark())
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_merging_and_saving_a_lora_model_adds_nothing_to_the_training_peak(corpus_file, tokenizer_file, tmp_path):
    """A 43M-parameter model (170 MB in fp32): a merged copy for the save would raise the process's
    high-water mark by ~170 MB; merged and written a tensor at a time, the save stays under the peak
    training reached (+ one 9 MB tensor at most)."""
    result = subprocess.run([sys.executable, "-c", SAVE_PEAK, corpus_file, tokenizer_file, str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    training, whole_run = (int(n) for n in result.stdout.split()[-2:])
    assert whole_run - training <= 10 * 2**20, (training, whole_run)


def test_a_saved_subfolder_is_the_saves_whole_and_output_dir_keeps_what_it_did_not_write(tmp_path):
    """lora_adapter/ holds one save's adapter (an earlier adapter's other files go); output_dir itself keeps
    files the save does not write (the user's, the summary)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(tiny_gpt2_config())

    def write(names):
        def into(folder):
            saving.write_model(folder, model)
            os.mkdir(os.path.join(folder, "lora_adapter"))
            for name in names:
                with open(os.path.join(folder, "lora_adapter", name), "w") as f:
                    f.write(name)
        return into

    out = str(tmp_path / "out")
    saving.atomic_save(out, model, write=write(["adapter_config.json", "vocab.json"]))
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")
    saving.atomic_save(out, model, write=write(["adapter_config.json", "tokenizer.json"]))
    assert sorted(os.listdir(os.path.join(out, "lora_adapter"))) == ["adapter_config.json", "tokenizer.json"]
    assert os.path.isfile(os.path.join(out, "notes.txt"))
