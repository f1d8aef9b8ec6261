"""Trains with two CPU processes (DDP over gloo); each rank records the blocks it saw and its final weights.

Run as a script: Lightning starts rank 1 by running this file again.
usage: ddp_train.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR RECORD_DIR LORA(0/1)
"""

import json
import os
import sys

import pytorch_lightning as pl
import torch

from lowmem_aitextgen import aitextgen


class RecordBatches(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.rank = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rank = trainer.global_rank
        self.seen.extend(batch.tolist())


if __name__ == "__main__":
    data, tokenizer, base, output_dir, record, lora = sys.argv[1:7]
    recorder = RecordBatches()
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    ai.train(data, output_dir=output_dir, n_gpu=0, devices=2, strategy="ddp", num_steps=4, batch_size=2,
             gradient_accumulation_steps=2, save_every=2, generate_every=2, seed=1, callbacks=[recorder],
             gradient_checkpointing=True, lora=lora == "1")
    with open(os.path.join(record, f"seen{recorder.rank}.json"), "w") as f:
        json.dump(recorder.seen, f)
    torch.save(ai.model.state_dict(), os.path.join(record, f"final{recorder.rank}.pt"))
