"""The stepping decoder's attention of one new token a row, on our own kernel (one_token_attention.c, built by
native.py): each row over its own places alone, in one call for every row of a step.

Why our own: torch's scaled_dot_product_attention gives a row other bits beside other rows (row_attention.py's
alignment rule keeps them its own, with zeros read after its places and a mask), and around it a step converts the
query to the cache's dtype, transposes and converts the output back; at 8 rows of a 355M int8 view those were ~1 ms
of a ~21 ms step (HISTORY.md, twenty-third session).  Here each (row, head) is computed by one thread from its own
places, so a row's bits are its own by construction, at any number of threads, and its output comes back fp32 in
the layout the output projection reads.

| takes                         | else                                                                        |
|-------------------------------|-----------------------------------------------------------------------------|
| a CPU with AVX512F, the       | stepping.Step's attention on torch's kernel, as before (row_attention.py   |
| kernels built (native.py), a  | for the rows alone)                                                        |
| cache in fp32 or bf16, a      |                                                                             |
| query in fp32 or bf16, head   |                                                                             |
| sizes a multiple of 16 up to  |                                                                             |
| MOST_HEAD                     |                                                                             |
| a row whose places are not    | the same kernel over its places gathered (a copy of that row's keys and     |
| the cache's last ones (a      | values): the arithmetic of the row alone                                    |
| prefix row beside longer ones)|                                                                             |
"""

from __future__ import annotations

import torch

from . import native
from .native import FLOAT, INT, LONG, POINTER

# one_token_attention.c's export, as lowmem_kernels.h declares it (native.bound declares it on the library)
SIGNATURES = {
    "lowmem_one_token_attention": (INT, [POINTER, INT, LONG, LONG, POINTER, POINTER, INT, LONG, LONG, LONG, INT, INT,
                                         INT, POINTER, INT, INT, FLOAT, POINTER, INT, POINTER, POINTER]),
}

DTYPES = (torch.float32, torch.bfloat16)
MOST_HEAD = 256  # one_token_attention.c's


def available() -> bool:
    """Whether our kernel runs here: built, on a CPU with AVX512F."""
    return native.built() is not None and native.cpu_runs("attention")


def takes(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `attend` computes this query (rows, heads, 1, head size) over these keys (module docstring)."""
    size = query.shape[-1]
    return (available() and query.is_cpu and keys.is_cpu and query.dtype in DTYPES and keys.dtype in DTYPES
            and size % 16 == 0 and size <= MOST_HEAD and query.stride(-1) == 1 and keys.stride(-1) == 1)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, places: torch.Tensor,
           window: int | None, scale: float, new: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each row's attention (rows, heads x head size; fp32) of its one query (rows, heads, 1, head size) over its
    last min(`places`[row], window) places of `keys` and `values` (rows, heads, width, head size; the same strides):
    its scores times `scale`; a row of 0 places is zeros (the caller's to compute).  `new`: each row's new key and
    value (the query's shape, dtype and strides), written first at every row's last place of `keys` and `values`,
    converted as torch's copy converts them (a step's cache append in the same call)."""
    rows, heads, tokens, size = query.shape
    width = keys.shape[2]
    if tokens != 1 or keys.shape != values.shape or keys.shape[:2] + keys.shape[3:] != (rows, heads, size) \
            or keys.stride() != values.stride() or keys.dtype != values.dtype or places.dtype != torch.int32 \
            or not places.is_contiguous() or places.numel() != rows \
            or (new is not None and any(t.shape != query.shape or t.stride() != query.stride()
                                        or t.dtype != query.dtype for t in new)):
        raise ValueError("native_attention.attend: one query a row, keys and values of its rows, heads and size in "
                         f"one layout, and int32 places (one a row) are needed; got a query of {tuple(query.shape)}, "
                         f"keys of {tuple(keys.shape)} {keys.stride()}, values of {tuple(values.shape)} "
                         f"{values.stride()}, places {places}" + _told(new))
    out = torch.empty(rows, heads * size)
    done = native.bound(SIGNATURES).lowmem_one_token_attention(
        query.data_ptr(), int(query.dtype == torch.bfloat16), query.stride(0), query.stride(1), keys.data_ptr(),
        values.data_ptr(), int(keys.dtype == torch.bfloat16), keys.stride(0), keys.stride(1), keys.stride(2), rows,
        heads, size, places.data_ptr(), width, window or 0, scale, out.data_ptr(), torch.get_num_threads(),
        *((None, None) if new is None else (new[0].data_ptr(), new[1].data_ptr())))
    if done == -2:  # (checked by the kernel before any work: a reduction here cost ~3 us a layer)
        raise ValueError(f"native_attention.attend: places={places.tolist()}: each row's must be within the cache's "
                         f"{width}")
    if done != 0:
        raise MemoryError(f"lowmem_aitextgen's attention kernel could not allocate {4 * width} bytes a thread")
    return out


def _told(new: tuple[torch.Tensor, torch.Tensor] | None) -> str:
    """attend's `new` as its error names it."""
    if new is None:
        return ""
    return ", new keys and values of " + " and ".join(f"{tuple(t.shape)} {t.stride()} {t.dtype}" for t in new)
