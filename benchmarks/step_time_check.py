"""step_time.py against the clock: real optimizer steps of forced plans, measured and predicted.

For a model size, each plan (checkpointed blocks, micro-batch, precision, optimizer, LoRA) trains a few
steps through ai.train() with that plan forced; the median step after the first is compared with
step_time.step_seconds.  What matters is the order: the planner picks the fastest plan that fits.

    python benchmarks/step_time_check.py --size 355M --block 512 --steps 3
    python benchmarks/step_time_check.py --size tiny --block 128 --steps 6   # width 64: bf16 vs fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytorch_lightning as pl  # noqa: E402
from memory_speed import dataset  # noqa: E402
from transformers import GPT2Config  # noqa: E402

from lowmem_aitextgen import aitextgen  # noqa: E402
from lowmem_aitextgen.hardware import bf16_native  # noqa: E402
from lowmem_aitextgen.training.adapter_settings import AdapterSettings  # noqa: E402
from lowmem_aitextgen.training.step_time import step_seconds  # noqa: E402

SIZES = {"355M": dict(n_layer=24, n_embd=1024, n_head=16), "124M": dict(n_layer=12, n_embd=768, n_head=12),
         "w256": dict(n_layer=4, n_embd=256, n_head=4), "tiny": dict(n_layer=2, n_embd=64, n_head=4)}
ALL, HALF = -1, -2  # checkpointed_blocks: every block, half of them (the model's n_layer is put in)
# (name, plan fields): the choices the planner weighs, one at a time from "k=0 m=1 bf16" (glibc left alone)
PLANS = [
    ("k=0 m=1 bf16", dict()),
    ("k=all m=1 bf16", dict(checkpointed_blocks=ALL)),
    ("k=half m=1 bf16", dict(checkpointed_blocks=HALF)),
    ("k=0 m=2 bf16", dict(micro_batch_size=2, accumulation=1)),
    ("k=0 m=1x2 bf16", dict(micro_batch_size=1, accumulation=2)),
    ("k=0 m=1 fp32", dict(precision="32-true")),
    ("k=0 m=1 bf16 8-bit", dict(optimizer="adamw8bit")),
    ("k=0 m=1 bf16 LoRA", dict(adapter=AdapterSettings.lora())),
    ("k=all m=1 bf16 LoRA", dict(adapter=AdapterSettings.lora(), checkpointed_blocks=ALL)),
    ("k=0 m=1 bf16 held heap", dict(hold_freed_heap=True)),  # CPU only: heap_callbacks.ReleaseFreedHeap
    ("k=all m=1 bf16 held heap", dict(hold_freed_heap=True, checkpointed_blocks=ALL)),
]


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.seen:
            self.seen = trainer.global_step
            now = time.perf_counter()
            if self.last:
                self.times.append(now - self.last)
            self.last = now


def forced(fields: dict):
    class Forced(aitextgen):
        def _training_plan(self, args):
            plan, *rest = super()._training_plan(args)
            return dataclasses.replace(plan, **with_blocks(fields, plan.n_layer), chosen_because="forced"), *rest
    return Forced


def measure(size: str, block: int, steps: int, name: str, fields: dict, device: str = "cpu") -> dict:
    config = GPT2Config(**SIZES[size])
    ai = forced(fields)(config=config)
    probe = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        ai.train(dataset(block), output_dir=out, num_steps=steps, save_every=0, generate_every=0,
                 n_gpu=1 if device == "gpu" else 0,
                 learning_rate=1e-4, callbacks=[probe], fp16=True, pin_micro_batch=True, max_memory="1TB",
                 gradient_checkpointing=False, progress_bar_refresh_rate=1000)
        plan = probe_plan(ai, out)
    measured = statistics.median(probe.times)
    trainable = sum(p.numel() for p in ai.model.parameters()) if "adapter" not in fields else plan["trainable_parameters"]
    predicted = step_seconds(rebuild(fields, config, device), config, block, trainable, bf16_native(device))
    return {"size": size, "block": block, "device": device, "plan": name, "measured_s": measured,
            "predicted_s": predicted}


def probe_plan(ai, out: str) -> dict:
    with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
        return json.load(f)["plan"]


def rebuild(fields: dict, config: GPT2Config, device: str):
    from lowmem_aitextgen.training.estimate import memory_plan

    plan = memory_plan("bf16-mixed", False, None, 1, "adamw", True, device=device)
    return dataclasses.replace(plan, n_layer=config.n_layer, **with_blocks(fields, config.n_layer))


def with_blocks(fields: dict, n_layer: int) -> dict:
    """The plan fields with ALL or HALF as the model's number of blocks."""
    blocks = fields.get("checkpointed_blocks", 0)
    return {**fields, "checkpointed_blocks": {ALL: n_layer, HALF: n_layer // 2}.get(blocks, blocks)}


def measure_in_child(args: argparse.Namespace, name: str) -> dict:
    import subprocess

    command = [sys.executable, __file__, "--child", name, "--size", args.size, "--block", str(args.block),
               "--steps", str(args.steps), "--device", args.device]
    result = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="355M")
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", action="append", help="plan names to run (default: all)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fields = dict(PLANS)[args.child]
        print("RESULT " + json.dumps(measure(args.size, args.block, args.steps, args.child, fields, args.device)))
        return
    rows = []
    for name, fields in PLANS:  # each in its own process: no heap or cache of an earlier plan's run
        if not args.only or name in args.only:
            rows.append(measure_in_child(args, name))
    base = rows[0]
    print("| plan | measured s | predicted s | measured vs first | predicted vs first |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['plan']} | {row['measured_s']:.3f} | {row['predicted_s']:.3f} | "
              f"{row['measured_s'] / base['measured_s']:.2f} | {row['predicted_s'] / base['predicted_s']:.2f} |")
    print("ROWS " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
