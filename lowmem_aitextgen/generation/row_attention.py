"""The attention of rows whose text must repeat (a seeded or greedy text, in the form that computes each token
alone): each row's output the bits it gets decoded alone, whatever rows it runs beside, on torch's kernel.  Where
our own kernel runs (native_attention.py: a CPU with AVX512F), a row's one new token attends on it instead, alone
by construction; this module then serves the prompts of several tokens, and every row elsewhere.

torch's CPU attention kernel (scaled_dot_product_attention's flash kernel) gives a row other bits beside padding
(it sums the row's places in another order) and, with several threads, at one row than among several.  Each
thread works in its own slice of one buffer, (places + 2 + head size) floats for a one-token query, and a row's
bits came out the same alone and among others exactly where every slice starts on a 16-byte boundary: with
places ≡ 2 (mod 4) (head sizes a multiple of 4; places within the kernel's block of 512), at 1-4 threads, 4-25
heads, AVX-512 and AVX2 kernels (HISTORY.md, "Decoding — 2026-11-29"; the matrix library evidently takes
another path for an unaligned slice).  So:

| rows                               | how each attends                                                        |
|------------------------------------|-------------------------------------------------------------------------|
| one new token (a step, a prompt of | over its places and the 0-3 zeros after them (kv_cache.PAD) that make   |
| one), up to 510 places, CPU, fp32  | them 2 modulo 4, those masked; neighbouring rows of the same places in  |
| or bf16 (an int8 view's cache)     | one call where a probe at first use finds each row's bits its own there |
|                                    | (`together_exact`, each dtype): in fp32 at 355M, 8 rows of one length   |
|                                    | ~7% more tokens a second, 16 served clients ~7%; one row ~0.3 ms a      |
|                                    | token more (the mask and two slices a layer: 1-4% of a 355M token;      |
|                                    | HISTORY.md, 2026-11-29, ninth)                                          |
| a prefix row beside longer ones    | as above, its places gathered (its padding lies between its virtual     |
|                                    | places and its tokens) and the zeros added: a call of its own           |
| a prompt, past 510 places, another | a call of its own over its own places, the call it makes alone          |
| device or dtype                    |                                                                         |
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn import functional as F

from .kv_cache import PAD

BLOCK = 512  # the flash kernel's block of places: past it a slice's size is fixed by the block, not the places
PADDED = (torch.float32, torch.bfloat16)  # the dtypes whose rows read the zeros after them (module docstring)


class RowOwn(NamedTuple):
    """One row of a part as its attention takes it alone: its `tokens` (the last of the part's new ones), its
    `places` (the last of the cache's) and seen_places's masks over them (None, None for one token)."""

    tokens: int
    places: int
    seen: torch.Tensor | None
    local: torch.Tensor | None
    index: torch.Tensor | None  # its places where they are not the cache's last ones (a prefix row padded)


def each_row_alone(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, owns: list[RowOwn],
                   window: int | None, scale: float, after: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
                   ) -> torch.Tensor:
    """Attention (rows, heads, new, head size) of the rows `owns` describes (in order), each as alone (module
    docstring); `after(n)`: the rows' keys and values with n (at most PAD) of the cache's zeros after them (None:
    no zeros to read); a padding token's output is zeros (nothing reads it)."""
    if after is None or not query.is_cpu or query.dtype not in PADDED or query.shape[-1] % 4:
        runs = [(row, row + 1, None) for row in range(len(owns))]
    elif len(owns) == 1:  # (one row: its call as it is; a slice of every tensor costs as much as the call)
        runs = [(0, 1, _padded_places(owns[0], window))]
    else:
        runs = _runs(owns, window, together_exact(query.shape[1], query.shape[-1], query.dtype))
    return _in_runs(query, keys, values, owns, window, scale, after, runs)


def _in_runs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, owns: list[RowOwn], window: int | None,
             scale: float, after: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
             runs: list[tuple[int, int, int | None]]) -> torch.Tensor:
    """each_row_alone's calls, one a run (_runs)."""
    outs, padded = [], None
    for start, end, places in runs:
        whole = end - start == len(owns)  # (a slice of every tensor costs as much as the call at one row)
        rows = query if whole else query[start:end]
        if places is None:
            outs.append(_row_alone(rows, *((keys, values) if whole else (keys[start:end], values[start:end])),
                                   owns[start], window, scale))
            continue
        pad, width = (2 - places) % 4, keys.shape[2]
        if owns[start].index is not None:  # a prefix row beside longer ones: its places gathered, zeros after
            gathered = owns[start].index[-places:]
            held = [F.pad(t[start:end, :, gathered], (0, 0, 0, pad)) for t in (keys, values)]
        elif whole and places == width:  # the views as the cache gives them (with no zeros: as the step has them)
            held = after(pad) if pad else (keys, values)
        else:
            padded = padded or after(PAD)
            held = [t[start:end, :, width - places:width + pad] for t in padded]
        tokens = rows.shape[2]  # (a part's new tokens: the row's own is the last, its padding's output zeros)
        out = F.scaled_dot_product_attention(rows if tokens == 1 else rows[:, :, -1:], *held,
                                             attn_mask=_masked_after(places, pad, rows.dtype), scale=scale)
        outs.append(out if tokens == 1 else F.pad(out, (0, 0, tokens - 1, 0)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _runs(owns: list[RowOwn], window: int | None, together: bool) -> list[tuple[int, int, int | None]]:
    """(start, end, places) of the calls each_row_alone makes: neighbouring rows of the same places together
    where `together`; places None: the row's own call over its own places (_row_alone)."""
    runs: list[tuple[int, int, int | None]] = []
    for row, own in enumerate(owns):
        places = _padded_places(own, window)
        if together and places is not None and runs and runs[-1][2] == places and own.index is None \
                and owns[row - 1].index is None:  # (a prefix row padded gathers its places: a call of its own)
            runs[-1] = (runs[-1][0], row + 1, places)
        else:
            runs.append((row, row + 1, places))
    return runs


def _padded_places(own: RowOwn, window: int | None) -> int | None:
    """The places a one-token row attends to, where it reads the zeros after them (module docstring), else None."""
    if own.tokens != 1:
        return None
    places = own.places if window is None else min(own.places, window)
    return places if places <= BLOCK - 2 else None


@functools.lru_cache(maxsize=2 * BLOCK)
def _masked_after(places: int, pad: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """scaled_dot_product_attention's mask in `dtype` (the query's) over `places` and `pad` places after them,
    those hidden."""
    if not pad:
        return None
    with torch.inference_mode(False):  # (made once, read in and out of inference mode)
        mask = torch.zeros(1, 1, 1, places + pad, dtype=dtype)
        mask[..., places:] = float("-inf")
    return mask


def together_exact(heads: int, head_size: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether one call over several rows in `dtype` gives each its bits alone here (module docstring), at this
    number of threads: found by trying it once."""
    return _together_exact(heads, head_size, torch.get_num_threads(), dtype)


@functools.lru_cache(maxsize=None)
def _together_exact(heads: int, head_size: int, threads: int, dtype: torch.dtype) -> bool:
    """together_exact's probe: two rows in one call and each alone, random keys (a generator of its own: the
    global one is the user's), over places of each residue modulo 4 and the longest."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(False):
        for places in [*range(1, 17), BLOCK - 2]:
            query, keys, values = ((torch.rand(2, heads, length, head_size, generator=generator) - 0.5).to(dtype)
                                   for length in (1, places + PAD, places + PAD))
            keys[:, :, places:] = values[:, :, places:] = 0

            def after(pad: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
                return keys[rows, :, :places + pad], values[rows, :, :places + pad]

            own, held = RowOwn(1, places, None, None, None), (keys[:, :, :places], values[:, :, :places])
            both = _in_runs(query, *held, [own, own], None, 1.0, after, [(0, 2, places)])
            for i in (0, 1):
                alone = _in_runs(query[i:i + 1], *(t[i:i + 1] for t in held), [own], None, 1.0,
                                 functools.partial(after, rows=slice(i, i + 1)), [(0, 1, places)])
                if not torch.equal(both[i:i + 1], alone):
                    return False
    return True


def _row_alone(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own: RowOwn, window: int | None,
               scale: float) -> torch.Tensor:
    """each_row_alone's call for one row over its own places (query, keys and values of one row)."""
    places, seen = own.places, own.seen
    if window is not None and own.tokens == 1:  # one token: its window is its last places
        places = min(places, window)
    elif window is not None:
        seen = own.local
    if own.index is not None:  # copied together, as they lie alone
        keys, values = keys[:, :, own.index[-places:]], values[:, :, own.index[-places:]]
    elif places < keys.shape[2]:  # (a slice of everything costs as much as the call's arithmetic at batch 1)
        keys, values = keys[:, :, -places:], values[:, :, -places:]
    width = query.shape[2]
    out = F.scaled_dot_product_attention(query if own.tokens == width else query[:, :, -own.tokens:], keys, values,
                                         attn_mask=seen, scale=scale)
    return out if own.tokens == width else F.pad(out, (0, 0, width - own.tokens, 0))
