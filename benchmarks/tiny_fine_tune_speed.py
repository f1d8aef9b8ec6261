"""A small fine-tune's speed, phase by phase: a 2-layer GPT-2 (256 wide) with GPT-2's 50,257-token vocabulary, 30
steps of 4 x 128 tokens on Python's own documentation text, fully and as prefix tuning: the whole train() call, the
time before its first step (validation, the plan and its probes, the data), the first step, the other steps' median,
the time after the last (the final save), and the tokens/s its summary reports.  The vocabulary's projection
(50,257 x 256, forward and backward) is most of a step at this size, so tokens/s here is far below the README main
job's (a 1,000-token vocabulary).  Run it on each CPU kind; held to AVX2 on an AVX-512 machine with:

    LOWMEM_AITEXTGEN_MAX_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        FBGEMM_ENABLE_INSTRUCTIONS=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/tiny_fine_tune_speed.py
"""

import json
import os
import pydoc_data.topics
import statistics
import tempfile
import time

import pytorch_lightning as pl
from transformers import GPT2Config

from lowmem_aitextgen import aitextgen, hardware


class Steps(pl.Callback):
    """When each training step starts and ends."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.starts.append(time.monotonic())

    def on_train_batch_end(self, *args: object) -> None:
        self.ends.append(time.monotonic())


def run(kind: str, root: str) -> dict:
    ai = aitextgen(config=GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=256))
    steps, out = Steps(), os.path.join(root, kind)
    started = time.monotonic()
    ai.train(os.path.join(root, "input.txt"), output_dir=out, num_steps=30, batch_size=4, block_size=128,
             save_every=0, generate_every=0, seed=1, callbacks=[steps], **({"adapter": "prefix"} if kind == "prefix"
                                                                           else {}))
    ended = time.monotonic()
    with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    took = [end - start for start, end in zip(steps.starts, steps.ends)]
    return {"run": kind, "precision": summary["plan"]["precision"], "whole train() s": round(ended - started, 2),
            "before the first step s": round(steps.starts[0] - started, 2), "first step s": round(took[0], 3),
            "other steps' median s": round(statistics.median(took[1:]), 3),
            "after the last step s": round(ended - steps.ends[-1], 2),
            "tokens/s (summary)": round(summary["tokens_per_s"], 1)}


def main() -> None:
    root = tempfile.mkdtemp()
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:60_000]
    with open(os.path.join(root, "input.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(json.dumps({"cpu": str(hardware.cpu())}))
    for kind in ("full", "prefix"):
        print(json.dumps(run(kind, root)), flush=True)


if __name__ == "__main__":
    main()
