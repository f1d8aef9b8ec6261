"""lora: only adapters train; the adapter and the merged model are saved; an adapter folder keeps training."""

import os

import pytest
import pytorch_lightning as pl
import torch
from transformers import GPT2LMHeadModel

from conftest import realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import counting

pytestmark = pytest.mark.edges  # peft's LoRA, its merge and its loaders


def test_lora_trains_only_adapters_and_saves_adapter_and_merged(tokenizer_file, corpus_file, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    realistic(ai.model)
    base_state = {k: v.clone() for k, v in ai.model.state_dict().items()}
    counts = {}

    class Count(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            counts["trainable"], _ = counting.trainable_parameters(pl_module.model)
            counts["adapter"] = sum(p.numel() for n, p in pl_module.model.named_parameters() if "lora_" in n)
            counts["base_dtype"] = pl_module.model.get_base_model().transformer.h[0].mlp.c_fc.base_layer.weight.dtype

    out = str(tmp_path / "out")
    ai.train(corpus_file, lora=True, lora_r=4, output_dir=out, num_steps=30, batch_size=4, learning_rate=5e-3,
             save_every=0, generate_every=0, precision="bf16-mixed", callbacks=[Count()], seed=3)
    assert counts["trainable"] == counts["adapter"] > 0
    # per layer: c_attn 64->192, attn.c_proj 64->64, c_fc 64->256, mlp.c_proj 256->64; A (r x in) + B (out x r)
    assert counts["adapter"] == 2 * 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    assert counts["base_dtype"] == torch.bfloat16  # frozen base held in 16 bits, no fp32 copy

    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "lora_adapter", "loss.png",
                                       "memory.png", "model.safetensors", "run_files.json", "tokenizer.json",
                                       "tokenizer_config.json", "training_summary.json"]
    merged = aitextgen(model_folder=out)
    assert merged.model.lm_head.weight.dtype == torch.float32
    # The base as trained: held in bf16, so rounded once; only adapted weights differ from it.
    rounded = {k: v.to(torch.bfloat16).float() for k, v in base_state.items()}
    changed = [k for k, v in merged.model.state_dict().items() if not torch.equal(v, rounded[k])]
    assert changed and all(k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) for k in changed)

    # Base + adapter == the merged model.
    base = GPT2LMHeadModel(tiny_gpt2_config(n_positions=64))
    base.load_state_dict(rounded)
    with_adapter = PeftModel.from_pretrained(base, os.path.join(out, "lora_adapter")).eval()
    batch = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(batch).logits, merged.model.eval()(batch).logits,
                                   rtol=1e-4, atol=1e-4)

    # The object holds the model the file holds, in its dtype (fp32, as constructed; issue 37): the same
    # weights and the same texts as the saved model.
    texts = ai.generate(n=2, prompt="The", max_length=30, seed=9, return_as_list=True)
    assert ai.model.dtype == torch.float32
    assert all(torch.equal(v, merged.model.state_dict()[k]) for k, v in ai.model.state_dict().items())
    assert merged.generate(n=2, prompt="The", max_length=30, seed=9, return_as_list=True) == texts


def test_lora_adapter_folder_loads_and_keeps_training(tokenizer_file, corpus_file, tmp_path):
    realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=64))).save_pretrained(tmp_path / "base")
    ai = aitextgen(model_folder=str(tmp_path / "base"), tokenizer_file=tokenizer_file)
    ai.train(corpus_file, lora=True, num_steps=3, save_every=0, generate_every=0, output_dir=str(tmp_path / "a"))
    again = aitextgen(model_folder=str(tmp_path / "a" / "lora_adapter"))
    assert again.generate_one(max_length=20, seed=1)
    adapter_before = {n: p.detach().clone() for n, p in again.model.named_parameters() if "lora_" in n}
    again.train(corpus_file, num_steps=3, save_every=0, generate_every=0, output_dir=str(tmp_path / "b"),
                learning_rate=1e-2)
    assert os.path.isdir(tmp_path / "b" / "lora_adapter")
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "base"),
                                         str(tmp_path / "b" / "lora_adapter"))
    after = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert any(not torch.equal(after[n], adapter_before[n]) for n in adapter_before)
