"""Whether torch's CPU attention gives a row the same bits alone and beside other rows: the cause of a seeded
text at 355M differing in a list (RESULTS.md, "The seed rule at 355M").  Random tensors of GPT-2 355M's heads
(16 of 64), one query a row, as a decoding step; one JSON line a case, the share of shapes whose row 0 came out
the same.  The "written out" cases are attention's products computed apart, row 0 padded on the left (zeros)
beside 15 rows: whether a batched attention written as products could give a row its own bits (RESULTS.md,
"Serving and decoding — 2026-11-28, fifth session").  The "2 (mod 4)" and "4 queries" cases: the kernel's
per-thread buffers on 16-byte boundaries (places ≡ 2 modulo 4; a slice of 4 queries' floats), where rows of one
length came out the same together and alone (HISTORY.md, "Decoding — 2026-11-29").  The "row_attention" case:
row_attention.each_row_alone over kv_cache.Slots, as the stepping decoder calls it (rows of one length in one
call, over the zeros after them).

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


def written_out_same(product: str, own: int, places: int) -> bool:
    """One of attention's products for row 0 (its `own` places the last of `places`, zeros before them) beside
    15 rows against alone: "q @ k.T" and "k @ q" (the scores, two ways), "p @ v" (the weighted values)."""
    query, keys = torch.randn(16, HEADS, 1, SIZE), torch.randn(16, HEADS, places, SIZE)
    keys[0, :, :places - own] = 0
    if product == "p @ v":
        weights = torch.rand(16, HEADS, 1, places)
        weights[0, ..., :places - own] = 0
        return torch.equal((weights @ keys)[:1], weights[:1, ..., -own:] @ keys[:1, :, -own:])
    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2) if product == "q @ k.T" else (k @ q.transpose(-1, -2)).transpose(-1, -2)
    return torch.equal(scores(query, keys)[:1, ..., -own:], scores(query[:1], keys[:1, :, -own:]))


def four_queries_same(places: int) -> bool:
    """Row 0 of 5 rows of `places` places, four query tokens a row (the first one's output compared)."""
    query = torch.randn(5, HEADS, 1, SIZE).expand(5, HEADS, 4, SIZE)
    keys, values = torch.randn(2, 5, HEADS, places, SIZE)
    together = F.scaled_dot_product_attention(query, keys, values)[:1, :, :1]
    return torch.equal(together, F.scaled_dot_product_attention(query[:1], keys[:1], values[:1])[:, :, :1])


def row_attention_same(places: int) -> bool:
    """Row 0 of 5 rows of `places` places through row_attention.each_row_alone, together and alone."""
    from lowmem_aitextgen.generation import kv_cache
    from lowmem_aitextgen.generation.row_attention import RowOwn, each_row_alone

    query, (keys, values) = torch.randn(5, HEADS, 1, SIZE), torch.randn(2, 5, HEADS, places, SIZE)
    slots, own = kv_cache.Slots(keys, values), RowOwn(1, places, None, None, None)
    together = each_row_alone(query, *slots.views(), [own] * 5, None, SIZE ** -0.5, slots.views)
    alone = each_row_alone(query[:1], *(t[:1] for t in slots.views()), [own], None, SIZE ** -0.5,
                           lambda after: tuple(t[:1] for t in slots.views(after)))
    return torch.equal(together[:1], alone)


def main() -> None:
    torch.manual_seed(0)
    shapes = random.Random(0)
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        cases = {"sdpa, no padding": lambda n: same(5, n, n), "sdpa, row 0 padded": lambda n: same(5, n // 2 + 1, n),
                 "q @ k.T, no padding": lambda n: products_same(5, n),
                 **{f"written out, {p}, row 0 padded": lambda n, p=p: written_out_same(p, n // 2 + 1, n)
                    for p in ("q @ k.T", "k @ q", "p @ v")},
                 "sdpa, places 2 (mod 4)": lambda n: same(5, max(2, n - (n - 2) % 4), max(2, n - (n - 2) % 4)),
                 "sdpa, 4 queries a row": four_queries_same, "row_attention, rows of one length": row_attention_same}
        for name, case in cases.items():
            lengths = [shapes.randint(2, 400) for _ in range(SHAPES)]
            print(json.dumps({"threads": threads, "case": name, "shapes": SHAPES,
                              "row 0 the same alone": sum(case(n) for n in lengths)}), flush=True)


if __name__ == "__main__":
    main()
