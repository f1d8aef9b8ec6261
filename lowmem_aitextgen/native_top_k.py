"""Sampling's top-k on our own kernel (top_k.c, built by native.py): each row's k largest logits and their ids.

Why our own: torch's CPU topk selects over a copy of each whole row; over GPT-2's 50,257 logits it took ~65 us a
row here, ~0.3 ms of an 8-row 355M step at two threads (RESULTS.md, twenty-third session).  Ours reads the row
once and selects among the few logits above the k-th largest seen (~10-17 us a row).  Of several equal values it
keeps and orders them its own way (torch's way is unspecified): sampling uses the values and the set of ids only
where the k-th value is not tied with the next (it checks), and there every exact top-k gives the same.

| takes                                           | else                                                |
|-------------------------------------------------|-----------------------------------------------------|
| fp32 rows on the CPU, k at most the row's size, | torch's topk (`largest` falls back to it itself)    |
| the kernels built (native.py), no NaN           |                                                     |
"""

from __future__ import annotations

import torch

from . import native


def largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest of each row of `logits` (rows, n) and their ids (int64), largest first: torch's topk's
    values, on our kernel where it takes them (module docstring)."""
    library = native.built()
    rows, n = logits.shape
    if library is None or not logits.is_cpu or logits.dtype != torch.float32 or logits.stride(-1) != 1 \
            or not 0 < k <= n:
        return logits.topk(k)
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    done = library.lowmem_top_k(logits.data_ptr(), logits.stride(0), rows, n, k, values.data_ptr(), ids.data_ptr(),
                                torch.get_num_threads())
    if done == -2:
        raise MemoryError(f"lowmem_aitextgen's top-k kernel could not allocate room for {4 * k + 64} logits")
    return (values, ids) if done == 0 else logits.topk(k)  # (-1: a NaN, which torch's takes as the largest)
