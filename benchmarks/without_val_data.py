"""A run without val_data, fingerprinted: the SHA-256 of the saved model.safetensors, the files in output_dir
and the summary's keys, for a full fine-tune and LoRA (dropout on, tiny model, seeded).  Run it against two
revisions to check that a change left such runs bit for bit as they were:

    git worktree add /tmp/before <rev>
    PYTHONPATH=/tmp/before python benchmarks/without_val_data.py /tmp/b
    python benchmarks/without_val_data.py /tmp/a        # the two outputs must be the same lines
"""

import hashlib
import json
import os
import pydoc_data.topics
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.tokenizers import train_tokenizer


def main(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    with open("corpus.txt", "w", encoding="utf-8") as f:
        f.write(text[:60_000])
    with open("train.txt", "w", encoding="utf-8") as f:
        f.write(text[:2_000])
    train_tokenizer("corpus.txt", vocab_size=1000)
    config = GPT2Config(vocab_size=1000, n_positions=32, n_layer=2, n_embd=64, n_head=4, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    for lora in (False, True):
        torch.manual_seed(0)
        ai = aitextgen(tokenizer_file="aitextgen.tokenizer.json", config=config)
        ai.model.load_state_dict(GPT2LMHeadModel(config).state_dict())
        out = f"out_lora_{lora}"
        ai.train("train.txt", output_dir=out, num_steps=12, batch_size=2, save_every=4, generate_every=0, seed=1,
                 lora=lora, learning_rate=1e-2, progress_bar_refresh_rate=1000)
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
            keys = sorted(json.load(f))
        print(f"lora={lora} model.safetensors sha256={digest} files={sorted(os.listdir(out))} summary={keys}")


if __name__ == "__main__":
    main(sys.argv[1])
