"""Sampling's top-k on our own kernel (top_k.c, built by native.py): each row's k largest logits and their ids.

Why our own: torch's CPU topk selects over a copy of each whole row; over GPT-2's 50,257 logits it took ~65 us a
row here, ~0.3 ms of an 8-row 355M step at two threads (HISTORY.md, twenty-third session).  Ours reads the row
once and selects among the few logits above the k-th largest seen (~10-17 us a row).  Of several equal values it
keeps and orders them its own way (torch's way is unspecified): sampling uses the values and the set of ids only
where the k-th value is not tied with the next (it checks), and there every exact top-k gives the same.

`draws` is a row's whole top-k draw in the same call (sampling._drawn_among_top_k): its end-of-text barred, the
k + 1 largest divided by its temperature, the tie checked, the softmax and inverse CDF in the order of the ids.
Why: a step samples after the LM head's 51 MB have pushed torch's code and data out of the CPU's caches, where each
of the draw's dozen torch calls cost 20-40 us; the draw took ~0.5 ms of a 355M token at batch 1, one call ~0.15
(HISTORY.md, twenty-sixth session).  Its probabilities are e^(v - max) summed in float64 (torch's softmax: float
sums of its own exponential), so a draw differs from torch's only where its uniform number falls within rounding of
a boundary between two tokens.

| takes                                           | else                                                |
|-------------------------------------------------|-----------------------------------------------------|
| fp32 rows on the CPU, k at most KERNEL_MAX_K,   | torch's topk (`largest` falls back to it itself);   |
| the kernels built (native.py), no NaN; `draws`: | `draws`: sampling's calls on torch's for the rows   |
| k + 1 tokens left after the barred ones         | refused, with their uniform numbers as drawn        |

`mass_cuts` finds where a row's cumulative mass, its items in the order of a key, reaches a mass, reading the row
twice and sorting one bucket of it (top_k.c's lowmem_mass_cut, ~0.08 ms over 50,257 logits here): cutoffs.py's
top_p, typical_p and a large top_k, which transformers' warpers find by sorting the whole row.

The kernel's selection among what is above the k-th largest seen so far grows with k, and its draw sorts the k by
id: over 50,257 logits at one thread, selecting k 1,024 0.10 ms (torch's topk 0.55), 2,048 0.50 (0.64), 4,096 1.4
(0.77), 10,000 6.1 (1.1), 40,000 250 (3.2); a row's whole draw at k 512 0.12 ms, 1,024 0.33, 2,048 1.06, where a cut
of the row and a draw over it take ~0.35 at any k (2026-12-08).  Past KERNEL_MAX_K sampling draws by the cut
(sampling._top_k_by_threshold).
"""

from __future__ import annotations

import ctypes

import torch

from . import native
from .native import INT, LONG, POINTER

# top_k.c's exports, as lowmem_kernels.h declares them (native.bound declares them on the library)
SIGNATURES = {
    "lowmem_top_k": (INT, [POINTER, LONG, INT, INT, INT, POINTER, POINTER, INT]),
    "lowmem_top_k_draw": (INT, [POINTER, LONG, INT, INT, INT, POINTER, INT, POINTER, POINTER, POINTER, INT]),
    "lowmem_mass_cut": (INT, [POINTER, INT, POINTER, LONG, INT, INT, POINTER, POINTER, POINTER, INT]),
}

TIED, REFUSED = -2, -1  # draws' answers for a row other than its token (top_k.c's row_draw)
KERNEL_MAX_K = 1024  # the largest k the kernel selects and draws among (module docstring: past it, a cut is quicker)


def largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest of each row of `logits` (rows, n) and their ids (int64), largest first: torch's topk's
    values, on our kernel where it takes them (module docstring)."""
    library = native.bound(SIGNATURES)
    rows, n = logits.shape
    if library is None or not logits.is_cpu or logits.dtype != torch.float32 or logits.stride(-1) != 1 \
            or not 0 < k <= min(n, KERNEL_MAX_K + 1):
        return logits.topk(k)
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    done = library.lowmem_top_k(logits.data_ptr(), logits.stride(0), rows, n, k, values.data_ptr(), ids.data_ptr(),
                                torch.get_num_threads())
    if done == -2:
        raise MemoryError(f"lowmem_aitextgen's top-k kernel could not allocate room for {4 * k + 64} logits")
    return (values, ids) if done == 0 else logits.topk(k)  # (-1: a NaN, which torch's takes as the largest)


def draws(logits: torch.Tensor, k: int, barred: list[list[int]], temperatures: list[float],
          uniforms: list[float]) -> list[int] | None:
    """Each row of `logits` (rows, n; fp32) drawn among its `k` likeliest less its `barred` ids, divided by its
    temperature, by its uniform number (sampling._drawn_among_top_k): its token; TIED where its k-th is tied with
    the next (every tied token is kept: the caller's to draw); REFUSED where it holds NaN or too few tokens are
    left.  None where the kernel is not here or does not take the logits."""
    library = native.bound(SIGNATURES)
    rows, n = logits.shape
    if library is None or not logits.is_cpu or logits.dtype != torch.float32 or logits.stride(-1) != 1 \
            or not 0 < k < n or k > KERNEL_MAX_K:
        return None
    # (ctypes' arrays, not tensors: a step samples after the LM head's weights have pushed torch's code and data
    # out of the CPU's caches, where each tensor made costs tens of microseconds)
    width = max(map(len, barred), default=0)
    barring = (ctypes.c_int64 * max(1, rows * width))(*[i for ids in barred for i in ids + [-1] * (width - len(ids))])
    tokens = (ctypes.c_int64 * rows)()
    done = library.lowmem_top_k_draw(logits.data_ptr(), logits.stride(0), rows, n, k, barring, width,
                                     (ctypes.c_float * rows)(*temperatures), (ctypes.c_double * rows)(*uniforms),
                                     tokens, torch.get_num_threads())
    if done == -2:
        raise MemoryError(f"lowmem_aitextgen's top-k kernel could not allocate room for {4 * (k + 1 + width) + 64} "
                          f"logits")
    return list(tokens)


def mass_cuts(keys: torch.Tensor, weights: torch.Tensor | None, masses: list[float], descending: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Of each row of `keys` (rows, n; fp32) in ascending order (or descending), the key of the first item where
    the cumulative `weights` (the same shape; None: 1 an item), summed in float64, reach the row's mass, and the key
    next in that order (past the last: +inf, descending -inf): (cuts, afters), a value a row; the last key in the
    order where the mass is never reached.  None where the kernel is not here or does not take the rows (NaN)."""
    library = native.bound(SIGNATURES)
    rows, n = keys.shape
    if library is None or not keys.is_cpu or keys.dtype != torch.float32 or keys.stride(-1) != 1 or weights is not \
            None and (weights.dtype != torch.float32 or weights.stride() != keys.stride()):
        return None
    cuts, afters = torch.empty(rows), torch.empty(rows)
    done = library.lowmem_mass_cut(keys.data_ptr(), descending, None if weights is None else weights.data_ptr(),
                                   keys.stride(0), rows, n, (ctypes.c_double * rows)(*masses), cuts.data_ptr(),
                                   afters.data_ptr(), torch.get_num_threads())
    if done == -2:
        raise MemoryError(f"lowmem_aitextgen's cut-by-mass kernel could not allocate room for {n} logits")
    return (cuts, afters) if done == 0 else None
