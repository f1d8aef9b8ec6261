"""Trains with two CPU processes started by strategy="ddp_spawn" (this process waits for them), with val_data.

usage: ddp_spawn_train.py TRAIN TOKENIZER OUTPUT_DIR
"""

import sys

from transformers import GPT2Config

from lowmem_aitextgen import aitextgen

if __name__ == "__main__":
    train, tokenizer, output_dir = sys.argv[1:4]
    config = GPT2Config(vocab_size=1000, n_positions=32, n_layer=2, n_embd=64, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    ai = aitextgen(config=config, tokenizer_file=tokenizer)
    ai.train(train, output_dir=output_dir, val_data=0.2, eval_every=2, n_gpu=0, devices=2, strategy="ddp_spawn",
             num_steps=4, batch_size=2, save_every=2, generate_every=0, seed=1, learning_rate=1e-3)
