"""One "node" of a two-node run on this machine, started by torchrun: trains with num_nodes=2, devices=1 on CPU
(DDP over gloo); records the blocks its rank saw, its losses, and its final weights.

usage: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=R --master_addr=127.0.0.1 --master_port=P \
           two_nodes_train.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR RECORD_DIR
"""

import json
import os
import sys

import pytorch_lightning as pl
import torch

from lowmem_aitextgen import aitextgen


class Record(pl.Callback):
    """The blocks each micro-batch of this rank held, and the loss Lightning logged at each step."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.extend(batch.tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        averaged = trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")
        self.losses.append([float(loss), float(averaged)])


if __name__ == "__main__":
    data, tokenizer, base, output_dir, record = sys.argv[1:6]
    recorder = Record()
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    ai.train(data, output_dir=output_dir, n_gpu=0, num_nodes=2, devices=1, strategy="ddp", num_steps=4,
             batch_size=2, save_every=2, generate_every=0, seed=1, callbacks=[recorder])
    rank = int(os.environ["RANK"])
    with open(os.path.join(record, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": recorder.seen, "losses": recorder.losses, "node_rank": int(os.environ["GROUP_RANK"]),
                   "world_size": int(os.environ["WORLD_SIZE"])}, f)
    torch.save(ai.model.state_dict(), os.path.join(record, f"final{rank}.pt"))
