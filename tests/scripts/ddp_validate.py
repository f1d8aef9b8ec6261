"""Trains with two CPU processes (DDP over gloo) and val_data: two steps, evaluated at the end.

Run as a script: Lightning starts rank 1 by running this file again.
usage: ddp_validate.py TRAIN VAL TOKENIZER OUTPUT_DIR
"""

import sys

from transformers import GPT2Config

from lowmem_aitextgen import aitextgen

if __name__ == "__main__":
    train, val, tokenizer, output_dir = sys.argv[1:5]
    config = GPT2Config(vocab_size=1000, n_positions=32, n_layer=2, n_embd=64, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    ai = aitextgen(config=config, tokenizer_file=tokenizer)
    ai.train(train, output_dir=output_dir, val_data=val, n_gpu=0, devices=2, strategy="ddp", num_steps=2,
             batch_size=2, save_every=0, generate_every=0, seed=1, learning_rate=1e-3)
