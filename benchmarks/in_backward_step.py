"""What one tensor's step inside backward (in_backward.py) makes beside its gradient, and how long it takes:
GPT-2 1558M's embedding (50257 x 1600, bf16, the largest tensor a full fine-tune steps), its gradient made
as storage16.py makes it (the weight upcast, the matmul in fp32), under the heap settings these plans train
with (heap.HELD).  Each row runs in its own process; the resident size is sampled every 0.5 ms.

    python benchmarks/in_backward_step.py                       # Adafactor whole, in slices; 8-bit AdamW
    python benchmarks/in_backward_step.py --rows adafactor_rows --device cuda

Prints, per row: the peak above the resident size before backward (MB), the same less the bf16 gradient,
and the median seconds of backward with the step over 3 steps after a first.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import threading
import time

ROWS = ("adafactor_whole", "adafactor_rows", "adamw8bit")
SHAPE = (50257, 1600)
TOKENS = 64


def resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096


def measure(row: str, device: str) -> dict:
    import torch

    from lowmem_aitextgen import heap
    from lowmem_aitextgen.training import in_backward
    from lowmem_aitextgen.training.in_backward import StepInBackward
    from lowmem_aitextgen.training.optimizers import optimizer_over

    if row == "adafactor_whole":
        in_backward.SLICE_VALUES = SHAPE[0] * SHAPE[1]  # no matrix is stepped in slices
    heap.use(heap.HELD)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(SHAPE, device=device).bfloat16())
    optimizer = "adamw8bit" if row == "adamw8bit" else "adafactor"
    make = functools.partial(optimizer_over, learning_rate=1e-4, adam_epsilon=1e-8, optimizer=optimizer)
    stepper = StepInBackward([{"params": [weight], "weight_decay": 0.0}], make, 1e-4, max_grad_norm=0.5,
                             through_fp32=optimizer != "adamw8bit")
    hidden = torch.randn(TOKENS, SHAPE[1], device=device)
    peaks, seconds = [], []
    for _ in range(4):
        loss = (hidden @ weight.float().t()).square().mean()
        heap.release_freed_heap()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device == "cuda" else resident_bytes()
        peak, stop = [before], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], resident_bytes())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample) if device == "cpu" else None
        if sampler:
            sampler.start()
        start = time.perf_counter()
        stepper.step(loss.backward)
        if device == "cuda":
            torch.cuda.synchronize()
            peak[0] = torch.cuda.max_memory_allocated()
        seconds.append(time.perf_counter() - start)
        stop.set()
        if sampler:
            sampler.join()
        peaks.append(peak[0] - before)
    gradient = weight.numel() * 2
    above = max(peaks[1:])
    return {"row": row, "device": device, "peak_above_mb": round(above / 1e6), "beside_gradient_mb":
            round((above - gradient) / 1e6), "bytes_per_value_beside_gradient": round((above - gradient) / weight.numel(), 2),
            "step_s": sorted(seconds[1:])[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", action="append", choices=ROWS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.device)), flush=True)
        return
    for row in args.rows or ROWS:
        done = subprocess.run([sys.executable, __file__, "--one", row, "--device", args.device], capture_output=True,
                              text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        print(lines[-1][len("RESULT "):] if lines else json.dumps({"row": row, "failed": done.stderr[-1500:]}), flush=True)


if __name__ == "__main__":
    main()
