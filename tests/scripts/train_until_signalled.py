"""Trains a tiny model slowly, printing "step N" after each optimizer step; the test sends signals.

usage: train_until_signalled.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR NUM_STEPS RESUME(0/1) [VAL_FRACTION]
"""

import sys
import time

import pytorch_lightning as pl

from lowmem_aitextgen import aitextgen


class Announce(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step}", flush=True)
        time.sleep(0.2)  # time for the test's signal to arrive mid-run


if __name__ == "__main__":
    data, tokenizer, base, output_dir, num_steps, resume = sys.argv[1:7]
    validation = {"val_data": float(sys.argv[7])} if len(sys.argv) > 7 else {}
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    ai.train(data, output_dir=output_dir, num_steps=int(num_steps), save_every=0, generate_every=0, seed=7,
             learning_rate=1e-2, resume=resume == "1", callbacks=[Announce()], progress_bar_refresh_rate=1000,
             **validation)
    print("returned", flush=True)
