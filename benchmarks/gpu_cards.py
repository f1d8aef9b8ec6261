"""The hardware matrix for real on the GPU at hand: a shared card, made by another process (the ballast)
holding all but N GiB, and train() planning for what is left with no max_memory given.

    python benchmarks/gpu_cards.py --free 8 --free 4 --free 6 --out results.jsonl
    python benchmarks/gpu_cards.py --free 8 --rows "1558M full" --row-timeout 420   # issue 30: offloading

For each N, a ballast process takes the card's free memory less N GiB and holds it; then each row runs in
a fresh process (its own CUDA context comes out of the N GiB, as on a shared card): 355M full fine-tune,
355M LoRA and 1558M LoRA, block 1024, batch_size=1 x 8 accumulation, 3 optimizer steps, from random
weights.  A row prints as it completes:
  plan            — what train() chose (precision, checkpointed blocks, micro-batch, optimizer, LoRA)
  budget, margin  — the budget train() computed from the free memory, and what it left unused
  estimate        — the chosen plan's estimate (what the budget bounds)
  peak_allocated  — torch.cuda.max_memory_allocated over train() (what the estimate counts)
  peak_reserved   — torch.cuda.max_memory_reserved (the caching allocator's, fragmentation included)
  lowest_free     — the lowest free memory on the card seen at any step end (0 would be out of memory)
  tokens_per_s    — over steps 2-3
  host_peak, host_estimate — this process's peak resident size, and the plan's host-memory estimate (an
                    offloading plan's weights, gradients and AdamW states)
--free 0 leaves the card as it is (no ballast).  A row whose plan is refused reports the MemoryError's first line.  Each row has ROW_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

# name: (GPT-2 size, lora, strategy, gradient_accumulation_steps); the first three are the default rows.  The
# "1x1" row leaves the accumulation out, so that the planner may update inside backward (in_backward.py).
ROWS = {"355M full": ("355M", False, "auto", 8), "355M LoRA": ("355M", True, "auto", 8),
        "1558M LoRA": ("1558M", True, "auto", 8), "1558M full": ("1558M", False, "auto", 8),
        "774M full": ("774M", False, "auto", 8), "355M fsdp_cpu_offload": ("355M", False, "fsdp_cpu_offload", 8),
        "1558M full 1x1": ("1558M", False, "auto", 1)}
DEFAULT_ROWS = ("355M full", "355M LoRA", "1558M LoRA")
ROW_TIMEOUT_S = 150
GIB = 2**30

HOLD = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
ballast = torch.empty(max(0, free - int(float(sys.argv[1]) * 2**30)), dtype=torch.uint8, device="cuda")
print("READY", flush=True)
time.sleep(3600)
"""


def row(name: str) -> dict:
    """One row, in this process (a child of main)."""
    import resource

    import pytorch_lightning as pl
    import torch
    from memory_speed import dataset
    from transformers import GPT2Config

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.training.estimate import GPT2_SIZES, estimate_plan

    size, lora, strategy, accumulation = ROWS[name]
    marks: dict = {"lowest_free": None, "times": []}

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            marks["plan"] = pl_module.plan

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info()[0]
            marks["lowest_free"] = free if marks["lowest_free"] is None else min(free, marks["lowest_free"])
            marks["times"].append((trainer.global_step, time.perf_counter()))

    free_before = torch.cuda.mem_get_info()[0]  # this process's context is paid from here on
    config = GPT2Config(**GPT2_SIZES[size])
    ai = aitextgen(config=config)
    data = dataset(1024)
    torch.cuda.reset_peak_memory_stats()
    result = {"row": name, "free_gib_before": free_before / GIB}
    try:
        with tempfile.TemporaryDirectory() as out:
            ai.train(data, output_dir=out, num_steps=3, batch_size=1, gradient_accumulation_steps=accumulation, lora=lora,
                     save_every=0, generate_every=0, n_gpu=1, learning_rate=1e-4, callbacks=[Watch()],
                     progress_bar_refresh_rate=1000, strategy=strategy)
    except MemoryError as error:
        return {**result, "refused": str(error).splitlines()[0]}
    plan = marks["plan"]
    steps = [t for step, t in marks["times"] if step >= 1]
    first, last = (steps[0], steps[-1]) if len(steps) > 1 else (0, 0)
    tokens = 1024 * plan.effective_batch_size * 2
    estimate = estimate_plan(config, plan, 1024)
    return {**result, "plan": plan.describe(0, 0, 0).split("; ")[0], "budget_gib": plan.budget.bytes / GIB,
            "margin_gib": plan.budget.margin / GIB, "estimate_gib": estimate.total / GIB,
            "host_estimate_gib": estimate.host / GIB,
            "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "lowest_free_gib": (marks["lowest_free"] or 0) / GIB,
            "tokens_per_s": tokens / (last - first) if last > first else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--free", type=float, action="append", help="GiB left free on the card (repeatable)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="append results as JSON lines here")
    parser.add_argument("--rows", action="append", choices=sorted(ROWS), help="rows to run (default: the first three)")
    parser.add_argument("--row-timeout", type=int, default=ROW_TIMEOUT_S, help="seconds a row may take")
    args = parser.parse_args()
    if args.row:
        print("RESULT " + json.dumps(row(args.row)), flush=True)
        return
    for free in args.free or [8, 4, 6]:
        ballast = subprocess.Popen([sys.executable, "-c", HOLD, str(free)], stdout=subprocess.PIPE, text=True) \
            if free else None
        try:
            assert ballast is None or ballast.stdout.readline().strip() == "READY"
            for name in args.rows or DEFAULT_ROWS:
                result = run_row(name, args.row_timeout)
                result["free_gib"] = free
                print(json.dumps(result), flush=True)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(result) + "\n")
        finally:
            if ballast is not None:
                ballast.kill()
                ballast.wait()


def run_row(name: str, timeout: int = ROW_TIMEOUT_S) -> dict:
    try:
        proc = subprocess.run([sys.executable, __file__, "--row", name], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"row": name, "failed": f"over {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"row": name, "failed": proc.stderr[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


if __name__ == "__main__":
    main()
