"""Trains with two CPU processes (strategy "ddp" or "fsdp", over gloo); rank 0 records each step's loss.

Run as a script: Lightning starts rank 1 by running this file again.
usage: sharded_train.py DATA TOKENIZER BASE_FOLDER OUTPUT_DIR RECORD_DIR STRATEGY LORA(0/1) NUM_STEPS STOP_AT RESUME(0/1)
       PRECISION VAL_DATA
(VAL_DATA: a fraction of DATA held out, evaluated every 2 steps; 0: none)
(STOP_AT: the step after which every rank stops, leaving a checkpoint; 0: none)
(PRECISION "device": not given, the device's choice; with PRESENT_CPUS="A,B" in the environment, rank 0 is
shown hardware.CPUS[A] and rank 1 hardware.CPUS[B] for its plan; MAX_MEMORY in the environment: max_memory=)
Each step is 2 micro-batches of 2 blocks (pinned) in each process.
"""

import contextlib
import json
import os
import sys

import pytorch_lightning as pl

from lowmem_aitextgen import aitextgen, hardware


class Record(pl.Callback):
    """Each optimizer step's loss (rank 0), and a stop after `stop_at` steps on every rank."""

    def __init__(self, stop_at: int) -> None:
        self.stop_at = stop_at
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.stop_at:  # as a signal would: the run saves a checkpoint and stops
            trainer.should_stop = True


if __name__ == "__main__":
    data, tokenizer, base, output_dir, record, strategy, lora, num_steps, stop_at, resume, precision, val = sys.argv[1:13]
    validation = dict(val_data=float(val), eval_every=2) if float(val) else {}
    recorder = Record(int(stop_at))
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    presented = contextlib.nullcontext()
    if os.environ.get("PRESENT_CPUS"):
        presented = hardware.presenting(hardware.Hardware(hardware.CPUS[os.environ["PRESENT_CPUS"].split(",")[rank]]))
    with presented:
        ai.train(data, output_dir=output_dir, n_gpu=0, devices=2, strategy=strategy, num_steps=int(num_steps),
                 batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2, save_every=0, generate_every=0,
                 seed=1, callbacks=[recorder], gradient_checkpointing=True, lora=lora == "1",
                 resume=resume == "1", pin_micro_batch=True, max_memory=int(os.environ.get("MAX_MEMORY", 0)) or None,
                 **({} if precision == "device" else {"precision": precision}), **validation)
    if rank == 0:
        with open(os.path.join(record, "losses.json"), "w") as f:
            json.dump(recorder.losses, f)
