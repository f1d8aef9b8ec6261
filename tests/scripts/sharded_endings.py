"""A run sharded over two CPU processes (strategy="fsdp", gloo) that ends as ENDING says, then the next steps a
user takes on the same object: rank 0 records what the object holds (weights, a seed's text), ai.save()s it, and
both ranks train it again into NEXT_DIR.  With ENDING "none" the object is a new one on BASE_FOLDER, and only the
next run is made (the reference the test compares with).

Run as a script: Lightning starts rank 1 by running this file again.
usage: sharded_endings.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR NEXT_DIR RECORD_DIR ENDING
ENDING: none, finished, Ctrl-C (SIGINT to every rank after step 2, as a terminal's Ctrl-C reaches the whole
process group), weights went bad after a save (a NaN in rank 0's shard after step 3), weights went bad before any
save (after step 1)
"""

import json
import os
import signal
import sys

import pytorch_lightning as pl
import torch
from safetensors.torch import save_file

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training.callbacks import TrainingDiverged

COMMON = dict(n_gpu=0, devices=2, strategy="fsdp", batch_size=2, learning_rate=1e-2, generate_every=0, seed=1)


class Ending(pl.Callback):
    """Ends the run as ENDING says."""

    def __init__(self, ending: str) -> None:
        self.ending = ending

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.ending == "Ctrl-C" and trainer.global_step == 2:
            self.ending = "done"
            os.kill(os.getpid(), signal.SIGINT)
        elif self.ending.startswith("weights went bad") and trainer.is_global_zero and trainer.global_step == (
                3 if self.ending.endswith("after a save") else 1):
            self.ending = "done"
            with torch.no_grad():
                next(p for p in pl_module.model.parameters() if p.is_floating_point()).to_local().view(-1)[0] = \
                    float("nan")


def record(ai: aitextgen, folder: str, name: str) -> None:
    """The object's weights (dtype kept) and a seed's text, from rank 0."""
    save_file({key: value.clone() for key, value in ai.model.state_dict().items()},  # tied: one copy each
              os.path.join(folder, f"{name}.safetensors"))
    with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump({"text": ai.generate_one(max_length=8, seed=3)}, f)


if __name__ == "__main__":
    data, tokenizer, base, output_dir, next_dir, record_dir, ending = sys.argv[1:8]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    if ending != "none":
        try:
            ai.train(data, output_dir=output_dir, num_steps=4, save_every=2, callbacks=[Ending(ending)], **COMMON)
        except TrainingDiverged:
            assert ending.startswith("weights went bad")
        if rank == 0:
            record(ai, record_dir, "object")
            ai.save(os.path.join(record_dir, "saved"))
    ai.train(data, output_dir=next_dir, num_steps=2, save_every=0, **COMMON)
    if rank == 0:
        record(ai, record_dir, "next")
