"""The whole run's memory on CPU, by phase: construction, training, and the merge and final save.

Each configuration runs in a fresh process: the GPT-2 architecture of the given size, trained a few steps
on Python's documentation text through ai.train().  The model is either saved pretrained weights
(--from-folder: random weights saved once by a separate process under benchmarks/out/models/, then
aitextgen(model_folder=...), as a fine-tune of downloaded GPT-2 loads them) or a random init
(aitextgen(config=...), training from scratch).  The kernel's high-water mark (VmHWM) is read after
construction, reset, read at the end of training (on_train_end), reset, and read once train() returned
(merge, save, the object's final model); the whole run's peak is the highest of the three (a reset
lowers ru_maxrss too).

    python benchmarks/whole_run.py --size 355M --block 512 --steps 3 --lora --checkpointing --from-folder
    python benchmarks/whole_run.py --size 355M --block 512 --steps 3 --checkpointing --from-folder
    python benchmarks/whole_run.py --size 1558M --block 256 --steps 1 --lora --from-folder
    python benchmarks/whole_run.py --size 774M --block 256 --steps 2 --max-memory 6GiB --from-folder
    python benchmarks/whole_run.py --size 1558M --block 256 --steps 2 --lora --max-memory 3GB --from-folder
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytorch_lightning as pl  # noqa: E402
from memory_speed import dataset, reset_peak_rss, vm_hwm_bytes  # noqa: E402
from transformers import GPT2Config  # noqa: E402

GIB = 2**30


class AtTrainingEnd(pl.Callback):
    def __init__(self, marks: dict) -> None:
        self.marks = marks

    def on_train_start(self, trainer, pl_module) -> None:
        self.marks["plan"] = pl_module.plan

    def on_train_end(self, trainer, pl_module) -> None:
        self.marks["training"] = vm_hwm_bytes()
        reset_peak_rss()


SAVE = """
import sys
from transformers import AutoModelForCausalLM, GPT2Config
from lowmem_aitextgen.training.estimate import GPT2_SIZES
AutoModelForCausalLM.from_config(GPT2Config(**GPT2_SIZES[sys.argv[1]])).save_pretrained(sys.argv[2])
"""


GENERATE = """
import sys
from lowmem_aitextgen import aitextgen
text = aitextgen(model_folder=sys.argv[1]).generate(n=1, max_length=20, return_as_list=True)[0]
print("GENERATED", repr(text))
"""


def saved_model(size: str) -> str:
    """A folder with random weights of `size`, written once by another process (its memory is not ours)."""
    folder = os.path.join(os.path.dirname(__file__), "out", "models", size)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        subprocess.run([sys.executable, "-c", SAVE, size, folder], check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="355M", choices=["124M", "355M", "774M", "1558M"])
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing=True")
    parser.add_argument("--max-memory")
    parser.add_argument("--precision", help="train(precision=...): e.g. bf16-mixed on a CPU without native bf16")
    parser.add_argument("--from-folder", action="store_true", help="saved weights, aitextgen(model_folder=...)")
    args = parser.parse_args()

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.training.estimate import GPT2_SIZES, estimate_plan

    data = dataset(args.block)
    folder = saved_model(args.size) if args.from_folder else None
    reset_peak_rss()
    ai = aitextgen(model_folder=folder) if folder else aitextgen(config=GPT2Config(**GPT2_SIZES[args.size]))
    marks = {"construction": vm_hwm_bytes()}
    reset_peak_rss()
    kwargs = dict(lora=args.lora, max_memory=args.max_memory, precision=args.precision)
    if args.checkpointing:
        kwargs["gradient_checkpointing"] = True
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ai.train(data, output_dir=out, num_steps=args.steps, save_every=0, generate_every=0, n_gpu=0,
                 learning_rate=1e-4, callbacks=[AtTrainingEnd(marks)], progress_bar_refresh_rate=1000, **kwargs)
        marks["save"] = vm_hwm_bytes()
        train_seconds = time.perf_counter() - started  # the whole train() call: plan, training, merge, save
        del ai
        # the saved model, read by another process as a user would, writes text
        generated = subprocess.run([sys.executable, "-c", GENERATE, out], capture_output=True, text=True)
    plan = marks.pop("plan")
    estimate = estimate_plan(GPT2Config(**GPT2_SIZES[args.size]), plan, args.block)
    result = {"size": args.size, "block": args.block, "steps": args.steps, "lora": args.lora,
              "checkpointing": args.checkpointing, "max_memory": args.max_memory, "precision": args.precision,
              "from_folder": args.from_folder, "train_call_s": round(train_seconds, 2),
              "plan": {"precision": plan.precision, "checkpointed_blocks": plan.checkpointed_blocks,
                       "optimizer": plan.optimizer, "batch": f"{plan.micro_batch_size}x{plan.accumulation}",
                       "upcast_bf16_weights": plan.bf16_weights_computed_in_fp32},
              "estimate_bytes": estimate.total, **{f"{k}_peak_bytes": v for k, v in marks.items()},
              "whole_run_peak_bytes": max(marks.values()),
              "step_in_backward": plan.step_in_backward, "four_bit_base": plan.four_bit_base,
              "saved_model_generates": generated.returncode == 0 and "GENERATED" in generated.stdout}
    print(" | ".join(f"{k} {v / GIB:.2f} GiB" for k, v in result.items() if k.endswith("_bytes"))
          + f" | train() {train_seconds:.1f} s")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
