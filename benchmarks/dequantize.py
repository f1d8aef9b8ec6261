"""What a 4-bit (NF4) base costs per use of a weight: step_time.DEQUANTIZE_S_PER_PARAMETER, beside the bf16
upcast a 16-bit base computed in fp32 costs (UPCAST_S_PER_PARAMETER), on GPT-2's matrix shapes.

    python benchmarks/dequantize.py

Each layer's weight is made dense once per matmul that needs it (storage16.dense): in forward, in a
checkpointed block's recompute and in backward.  Run alone: it is a timing.
"""

from __future__ import annotations

import time

import torch

from lowmem_aitextgen.training import four_bit, storage16

SHAPES = {"355M": [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)],
          "1558M": [(1600, 4800), (1600, 1600), (1600, 6400), (6400, 1600)]}


def seconds_per_weight(make, weight: torch.Tensor, repeats: int = 5) -> float:
    make()  # warm
    started = time.perf_counter()
    for _ in range(repeats):
        make()
    return (time.perf_counter() - started) / repeats / weight.numel()


def main() -> None:
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}")
    for size, shapes in SHAPES.items():
        for shape in shapes:
            weight = torch.randn(shape, dtype=torch.bfloat16) * 0.02
            nf4 = four_bit.quantize(weight, four_bit.Rounding())
            rows = {"nf4 -> fp32": seconds_per_weight(lambda: storage16.dense(nf4, torch.float32), weight),
                    "nf4 -> bf16": seconds_per_weight(lambda: storage16.dense(nf4, torch.bfloat16), weight),
                    "bf16 -> fp32": seconds_per_weight(lambda: weight.to(torch.float32), weight)}
            print(f"{size} {str(shape):<14} " + "  ".join(f"{k} {v * 1e9:5.2f} ns" for k, v in rows.items()))


if __name__ == "__main__":
    main()
