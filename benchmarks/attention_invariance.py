"""Whether torch's CPU attention gives a row the same bits alone and beside other rows: the cause of a seeded
text at 355M differing in a list (RESULTS.md, "The seed rule at 355M").  Random tensors of GPT-2 355M's heads
(16 of 64), one query a row, as a decoding step; one JSON line a case, the share of shapes whose row 0 came out
the same.

    python benchmarks/attention_invariance.py
"""

from __future__ import annotations

import json
import random

import torch
from torch.nn import functional as F

HEADS, SIZE, SHAPES = 16, 64, 100


def same(rows: int, own: int, places: int) -> bool:
    """Row 0 (its `own` places the last of `places`, the rest masked) alone against beside rows - 1 others."""
    query, keys, values = torch.randn(rows, HEADS, 1, SIZE), *torch.randn(2, rows, HEADS, places, SIZE)
    mask = torch.ones(rows, 1, 1, places, dtype=torch.bool)
    mask[0, ..., :places - own] = False
    together = F.scaled_dot_product_attention(query, keys, values, attn_mask=None if own == places else mask)
    alone = F.scaled_dot_product_attention(query[:1], keys[:1, :, -own:], values[:1, :, -own:])
    return torch.equal(together[:1], alone)


def products_same(rows: int, places: int) -> bool:
    """q @ k.T for row 0 alone against beside others (the scores of attention written out)."""
    query, keys = torch.randn(rows, HEADS, 1, SIZE), torch.randn(rows, HEADS, places, SIZE)
    return torch.equal((query @ keys.transpose(-1, -2))[:1], query[:1] @ keys[:1].transpose(-1, -2))


def main() -> None:
    torch.manual_seed(0)
    shapes = random.Random(0)
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        cases = {"sdpa, no padding": lambda n: same(5, n, n), "sdpa, row 0 padded": lambda n: same(5, n // 2 + 1, n),
                 "q @ k.T, no padding": lambda n: products_same(5, n)}
        for name, case in cases.items():
            lengths = [shapes.randint(2, 400) for _ in range(SHAPES)]
            print(json.dumps({"threads": threads, "case": name, "shapes": SHAPES,
                              "row 0 the same alone": sum(case(n) for n in lengths)}), flush=True)


if __name__ == "__main__":
    main()
