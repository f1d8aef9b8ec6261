"""row_attention.py against what it stands for: each row's one-token attention the bits that row gets alone, in
one call with rows of its own places, at GPT-2's head size (64) and 16 heads, over the engine's cache as
kv_cache.Slots holds it; and the attention itself, as torch computes it over the row's own places."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lowmem_aitextgen.generation import kv_cache, row_attention
from lowmem_aitextgen.generation.row_attention import RowOwn, each_row_alone

HEADS, SIZE = 16, 64


def one_token(places: int) -> RowOwn:
    return RowOwn(1, places, None, None, None)


def row_of(slots: kv_cache.Slots, row: int):
    """What each_row_alone takes as `after` for one row of `slots` decoded alone."""
    return lambda after: tuple(t[row:row + 1] for t in slots.views(after))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_length_attend_in_one_call_with_each_rows_bits_alone(dtype):
    """Three rows of the same places (every residue of 16, and past 64) each get the bits of their own call
    alone; with two threads torch's kernel gave other bits to 3 in 4 of those lengths unpadded (RESULTS.md).  In
    fp32 and in bf16 (an int8 view's cache where the CPU computes bf16 natively: one call where the probe finds
    it exact, else a call a row)."""
    generator = torch.Generator().manual_seed(0)
    together_here = row_attention.together_exact(HEADS, SIZE, dtype)  # the probe: else each row alone
    assert together_here or dtype != torch.float32  # (fp32's is exact on every CPU CI runs)
    for places in [*range(1, 34), 70, 131, 300, 510]:
        keys, values = (torch.randn(3, HEADS, places, SIZE, generator=generator).to(dtype) for _ in range(2))
        query = torch.randn(3, HEADS, 1, SIZE, generator=generator).to(dtype)
        slots = kv_cache.Slots(keys, values)
        held = slots.views()
        together = each_row_alone(query, *held, [one_token(places)] * 3, None, 0.125, slots.views)
        for row in range(3):
            alone = each_row_alone(query[row:row + 1], *(t[row:row + 1] for t in held), [one_token(places)], None,
                                   0.125, row_of(slots, row))
            assert torch.equal(together[row:row + 1], alone), (places, row)
            plain = F.scaled_dot_product_attention(query[row:row + 1], keys[row:row + 1], values[row:row + 1],
                                                   scale=0.125)
            bound = (1.6e-2, 4e-3) if dtype == torch.bfloat16 else (1e-5, 1e-6)  # bf16: a unit in its last place
            torch.testing.assert_close(alone, plain, rtol=bound[0], atol=bound[1])


def test_rows_of_other_lengths_and_a_window_keep_their_own_places():
    """Rows padded on the left (shorter than the cache's longest) and a local layer's window: each row's output
    is torch's attention over its own last places, and the same alone."""
    generator = torch.Generator().manual_seed(1)
    lengths = [40, 40, 37, 12, 40]
    rows = [tuple(torch.randn(1, HEADS, n, SIZE, generator=generator) for _ in range(2)) for n in lengths]
    width = max(lengths)
    keys, values = (torch.cat([F.pad(row[i], (0, 0, width - row[i].shape[2], 0)) for row in rows]) for i in (0, 1))
    query = torch.randn(len(lengths), HEADS, 1, SIZE, generator=generator)
    slots = kv_cache.Slots(keys, values)
    held = slots.views()
    for window in (None, 16):
        owns = [one_token(n) for n in lengths]
        together = each_row_alone(query, *held, owns, window, 0.125, slots.views)
        for row, (own_keys, own_values) in enumerate(rows):
            seen = slice(None) if window is None else slice(-window, None)
            plain = F.scaled_dot_product_attention(query[row:row + 1], own_keys[:, :, seen], own_values[:, :, seen],
                                                   scale=0.125)
            torch.testing.assert_close(together[row:row + 1], plain, rtol=1e-5, atol=1e-6)
            alone = each_row_alone(query[row:row + 1], *(t[row:row + 1] for t in held), [owns[row]], window, 0.125,
                                   row_of(slots, row))
            assert torch.equal(together[row:row + 1], alone), (window, row)


def test_a_prefix_row_beside_longer_rows_gets_its_bits_alone():
    """A prefix-tuned row shorter than its neighbours: its padding lies between its virtual places and its tokens
    (RowOwn.index), so its places are gathered; alone the same places lie at the cache's end, read with the zeros
    after them.  Each length's bits alike (every residue of 4, 16 heads of 64, as at 355M)."""
    generator = torch.Generator().manual_seed(2)
    virtual, width = 5, 80
    for tokens in range(1, 40):
        keys, values = (torch.randn(2, HEADS, width, SIZE, generator=generator) for _ in range(2))
        index = torch.cat((torch.arange(virtual), torch.arange(width - tokens, width)))
        for t in (keys, values):
            t[1, :, virtual:width - tokens] = 0  # its padding, as the cache holds it
        query = torch.randn(2, HEADS, 1, SIZE, generator=generator)
        slots = kv_cache.Slots(keys, values)
        owns = [one_token(width), RowOwn(1, virtual + tokens, None, None, index)]
        together = each_row_alone(query, *slots.views(), owns, None, 0.125, slots.views)
        own = kv_cache.Slots(keys[1:, :, index], values[1:, :, index])
        alone = each_row_alone(query[1:], *own.views(), [one_token(virtual + tokens)], None, 0.125, own.views)
        assert torch.equal(together[1:], alone), tokens
