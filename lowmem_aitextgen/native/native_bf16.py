"""Our own bf16 Linear for decoding on x86 CPUs with AVX512-BF16 (bf16_linear.c, built by native.py), called through
ctypes; packed16.NativeBf16Linear holds a projection's packed weights and calls `linear`.

Why our own: oneDNN's bf16 product at one row reads a 355M view's weights at ~18-25 GB/s on the AMD EPYC kind, where
llama.cpp's F16 reads ~33 (HISTORY.md, twenty-fourth and twenty-fifth sessions); this one reads a panel of weights
once for up to 8 rows of the call with vdpbf16ps, and gives each row its own bits at any number of rows.

| what          | how                                                                                           |
|---------------|-----------------------------------------------------------------------------------------------|
| build         | native.py: one library with the other kernels, built at first use, threads torch's          |
| takes         | a CPU with AVX512-BF16 (native.cpu_flags), an even number of inputs                           |
| else          | packed16.PackedLinear (oneDNN's), or the view's modules as they were                          |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation import huge_pages
from . import native
from .native import INT, LONG, POINTER

# bf16_linear.c's export, as lowmem_kernels.h declares it (native.bound declares it on the library)
SIGNATURES = {"lowmem_bf16_linear": (None, [POINTER, INT, INT, LONG, POINTER, INT, POINTER, INT, POINTER, POINTER, INT])}

PANEL = 32  # bf16_linear.c's: the columns a pass computes


@dataclass(frozen=True)
class Packed:
    """A projection's bf16 weight (n outputs x k inputs) in bf16_linear.c's layout."""

    weights: torch.Tensor  # bf16, (panels, k / 2, PANEL, 2)
    n: int
    k: int


def available() -> bool:
    """Whether the kernel runs here: built, on a CPU with AVX512-BF16."""
    return native.built() is not None and native.cpu_runs("bf16")


def pack(weight: torch.Tensor) -> Packed:
    """`weight` (n x k, k even) in bf16, packed for bf16_linear.c."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"native_bf16.pack: a weight of {k} inputs: an even number is needed")
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    panels = huge_pages.copy_of(padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3))  # (read whole every token)
    return Packed(panels, n, k)


def linear(packed: Packed, x: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., k; bf16) times `packed`'s weight, plus `bias` (bf16), in bf16 (bf16_linear.c's sums); then GPT-2's
    tanh GELU where `gelu`, then plus `residual` (x's shape but n outputs; bf16), each rounded to bf16 as torch's
    bf16 operations round."""
    for name, given, count in (("bias", bias, packed.n), ("residual", residual, x.numel() // packed.k * packed.n)):
        if given is not None and (given.dtype != torch.bfloat16 or not given.is_contiguous()
                                  or given.numel() != count):
            raise ValueError(f"native_bf16.linear: {name}={given.dtype} {tuple(given.shape)}: a contiguous bf16 "
                             f"tensor of {count} is needed")
    rows = x.reshape(-1, packed.k)
    if rows.dtype != torch.bfloat16 or rows.stride(-1) != 1:
        rows = rows.to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], packed.n, dtype=torch.bfloat16)
    if rows.shape[0]:
        native.bound(SIGNATURES).lowmem_bf16_linear(rows.data_ptr(), rows.shape[0], packed.k, rows.stride(0),
                                          packed.weights.data_ptr(), packed.n,
                                          None if bias is None else bias.data_ptr(), int(gelu),
                                          None if residual is None else residual.data_ptr(), out.data_ptr(),
                                          torch.get_num_threads())
    return out.view(*x.shape[:-1], packed.n)
