"""Sampling's top-k on our own kernel (top_k.c, built by native.py): each row's k largest logits and their ids.

Why our own: torch's CPU topk selects over a copy of each whole row; over GPT-2's 50,257 logits it took ~65 us a
row here, ~0.3 ms of an 8-row 355M step at two threads (RESULTS.md, twenty-third session).  Ours reads the row
once and selects among the few logits above the k-th largest seen (~10-17 us a row).  Of several equal values it
keeps and orders them its own way (torch's way is unspecified): sampling uses the values and the set of ids only
where the k-th value is not tied with the next (it checks), and there every exact top-k gives the same.

`draws` is a row's whole top-k draw in the same call (sampling._drawn_among_top_k): its end-of-text barred, the
k + 1 largest divided by its temperature, the tie checked, the softmax and inverse CDF in the order of the ids.
Why: a step samples after the LM head's 51 MB have pushed torch's code and data out of the CPU's caches, where each
of the draw's dozen torch calls cost 20-40 us; the draw took ~0.5 ms of a 355M token at batch 1, one call ~0.15
(RESULTS.md, twenty-sixth session).  Its probabilities are e^(v - max) summed in float64 (torch's softmax: float
sums of its own exponential), so a draw differs from torch's only where its uniform number falls within rounding of
a boundary between two tokens.

| takes                                           | else                                                |
|-------------------------------------------------|-----------------------------------------------------|
| fp32 rows on the CPU, k at most KERNEL_MAX_K,   | torch's topk (`largest` falls back to it itself);   |
| the kernels built (native.py), no NaN; `draws`: | `draws`: sampling's calls on torch's for the rows   |
| k + 1 tokens left after the barred ones         | refused, with their uniform numbers as drawn        |

Past KERNEL_MAX_K the kernel's selection among what is above the k-th largest seen so far grows with k: over
50,257 logits at one thread, k 1,024 0.10 ms (torch's topk 0.55), 2,048 0.50 (0.64), 4,096 1.4 (0.77), 10,000 6.1
(1.1), 40,000 250 (3.2); sampling draws such a k by a threshold instead (sampling._top_k_by_threshold).
"""

from __future__ import annotations

import ctypes

import torch

from . import native

TIED, REFUSED = -2, -1  # draws' answers for a row other than its token (top_k.c's row_draw)
KERNEL_MAX_K = 2048  # the largest k the kernel selects (module docstring: where torch's topk becomes the quicker)


def largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest of each row of `logits` (rows, n) and their ids (int64), largest first: torch's topk's
    values, on our kernel where it takes them (module docstring)."""
    library = native.built()
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
    library = native.built()
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
