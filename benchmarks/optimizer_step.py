"""One 8-bit AdamW step of a GPT-2, torchao's AdamW8bit beside ours (its update compiled once), in turn.

    python benchmarks/optimizer_step.py                      # CPU, 24 blocks at width 256 and at 1024 (355M)
    python benchmarks/optimizer_step.py --device cuda --width 1024

Both optimizers run on the same model with the same gradients, alternating, after two warm-up steps
(the compiles); the median of --steps step times is printed for each, with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchao.optim import AdamW8bit
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen.training.optimizers import build_optimizer, parameter_groups


def timed_step(optimizer: torch.optim.Optimizer, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, action="append", help="n_embd; default 256 and 1024")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    for width in args.width or [256, 1024]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=width, n_head=16)).to(args.device)
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        optimizers = {
            "torchao AdamW8bit": AdamW8bit(parameter_groups(model, 0.05), lr=1e-4, eps=1e-8, block_size=256),
            "ours (compiled once)": build_optimizer(model, 0.05, 1e-4, 1e-8, "adamw8bit"),
        }
        times: dict[str, list[float]] = {name: [] for name in optimizers}
        for step in range(args.steps + 2):
            for name, optimizer in optimizers.items():
                elapsed = timed_step(optimizer, args.device)
                if step >= 2:
                    times[name].append(elapsed)
        medians = {name: statistics.median(values) for name, values in times.items()}
        tensors = sum(1 for _ in model.parameters())
        print(f"24 blocks, width {width}, {tensors} tensors, {args.device}: "
              + ", ".join(f"{name} {ms * 1e3:.0f} ms" for name, ms in medians.items())
              + f"; ours / torchao's = {medians['ours (compiled once)'] / medians['torchao AdamW8bit']:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
