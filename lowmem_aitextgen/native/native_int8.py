"""Our own int8 Linear for decoding on x86 CPUs (int8_linear.c, built by native.py), called through ctypes;
int8_kernels.NativeProduct holds a projection's packed weights and calls `linear`.

Why our own: torch's int8 kernels leave a batch's speed on the table.  fbgemm's (torch.ao's, which torch 2.13 says
it will remove) takes 1.5-2x at 8 rows its time at one, being bound by its arithmetic, not by reading the weights;
oneDNN's is slower at one row; inductor's AMX template paid only inside a compiled graph of the whole step.  This
one reads a panel of weights once for every row of the call (on AMX, 8 rows in about one row's time), and quantizes
each row alone and dequantizes its sums in the same call (six elementwise calls a projection otherwise), with
fbgemm's bits (int8_linear.c says how): a projection's output is the same on either kernel (HISTORY.md,
twenty-first session); where asked, the tanh GELU of it or a residual added in the same call.

| what          | how                                                                                           |
|---------------|-----------------------------------------------------------------------------------------------|
| build         | native.py: one library with the one-token attention, built at first use, threads torch's     |
| path          | AMX from AMX_FROM rows where Linux grants the tile state, else AVX512-VNNI, else AVX2: read     |
|               | from the CPU itself (native.cpu_flags; every path gives the same bits, so no plan depends on  |
|               | it)                                                                                           |
| not built     | torch's kernels (int8_kernels.product_kernel)                                                  |
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..generation import huge_pages
from . import native
from .native import FLOAT, INT, POINTER

# int8_linear.c's exports, as lowmem_kernels.h declares them (native.bound declares them on the library)
SIGNATURES = {
    "lowmem_int8_linear": (INT, [INT, POINTER, INT, INT, INT, POINTER, POINTER, INT, FLOAT, POINTER, INT, FLOAT, FLOAT,
                                 POINTER, INT, POINTER]),
    "lowmem_amx_request": (INT, []),
}

PANEL, KSTEP = 32, 64  # int8_linear.c's: the columns a pass computes, K padded to a multiple of KSTEP
PATHS = ("avx2", "vnni", "amx")  # int8_linear.c's path numbers, in order
# the rows from which AMX's tiles are quicker than AVX512-VNNI's vectors (HISTORY.md, twenty-first session)
AMX_FROM = 2


@dataclass(frozen=True)
class Packed:
    """A projection's int8 weight (n outputs x k inputs) in int8_linear.c's layout, with what its call needs."""

    weights: torch.Tensor  # int8, (panels, kp / 4, PANEL, 4)
    zero_sums: torch.Tensor  # int32 (n): the activations' zero point times each column's weights
    scale: float  # the float32 product of the activations' and the weight's scales
    n: int
    k: int
    kp: int  # k padded to a multiple of KSTEP

    def int8(self) -> torch.Tensor:
        """The int8 weight (n x k) as it was given to `pack`."""
        rows = self.weights.permute(0, 2, 1, 3).reshape(-1, self.kp)
        return rows[:self.n, :self.k]


def pack(weight: torch.Tensor, scale: float, zero: int) -> Packed:
    """`weight` (int8, n x k) packed for int8_linear.c; `scale`: the float32 factor its sums are dequantized by;
    `zero`: the activations' zero point."""
    n, k = weight.shape
    kp, padded_n = -(-k // KSTEP) * KSTEP, -(-n // PANEL) * PANEL
    padded = torch.zeros(padded_n, kp, dtype=torch.int8)
    padded[:n, :k] = weight
    # (in huge pages: read whole every token)
    panels = huge_pages.copy_of(padded.view(padded_n // PANEL, PANEL, kp // 4, 4).permute(0, 2, 1, 3))
    zero_sums = (weight.sum(1, dtype=torch.int32) * zero).to(torch.int32)
    return Packed(panels, zero_sums, scale, n, k, kp)


def linear(packed: Packed, x: torch.Tensor, bias: torch.Tensor | None, inverse: float, zero: int,
           path: str | None = None, gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 Linear of `x` (..., k; fp32) by `packed` (int8_linear.c's order of operations): each row quantized
    alone by `inverse` and `zero`; `path` (PATHS) the CPU's quickest for the rows where not given; `gelu`: GPT-2's
    tanh GELU of the output in the same call (to ~1e-7 of its size torch's F.gelu(approximate="tanh")); `residual`
    (fp32, the output's shape): added to the output in the same call, the bits of `residual + output`."""
    library = native.bound(SIGNATURES)
    if library is None:
        raise RuntimeError("lowmem_aitextgen's int8 kernel is not built here (native.built)")
    if path is not None and path not in cpu_paths():  # an instruction the CPU lacks would kill the process
        raise ValueError(f"path={path!r}: this CPU runs {', '.join(cpu_paths())} of native_int8.PATHS")
    # (a step calls this ~100 times a token: each conversion only where needed, ~4 us a call less)
    rows = x.reshape(-1, packed.k)
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.float().contiguous()
    m = rows.shape[0]
    out = torch.empty(m, packed.n)
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                 or residual.numel() != out.numel()):
        raise ValueError(f"native_int8.linear: residual={residual.dtype} {tuple(residual.shape)}: a contiguous fp32 "
                         f"tensor of the output's {m * packed.n} elements is needed")
    if m:
        done = library.lowmem_int8_linear(
            PATHS.index(path or path_for(m)), rows.data_ptr(), m, packed.k, packed.kp, packed.weights.data_ptr(),
            packed.zero_sums.data_ptr(), packed.n, packed.scale, None if bias is None else bias.data_ptr(),
            int(gelu), inverse, float(zero), out.data_ptr(), torch.get_num_threads(),
            None if residual is None else residual.data_ptr())
        if done != 0:
            raise MemoryError(f"lowmem_aitextgen's int8 kernel could not allocate {m * packed.kp} bytes")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], packed.n)


def path_for(rows: int) -> str:
    """The path a call of `rows` rows takes on this CPU (module docstring)."""
    here = cpu_paths()
    return "amx" if "amx" in here and rows >= AMX_FROM else "vnni" if "vnni" in here else "avx2"


@functools.cache
def cpu_paths() -> tuple[str, ...]:
    """The paths this CPU runs (PATHS' order): its flags, and for AMX Linux's grant of the tile state."""
    here = [path for path in PATHS if native.cpu_runs(f"int8 {path}")]
    library = native.bound(SIGNATURES)
    if "amx" in here and (library is None or library.lowmem_amx_request() != 0):
        here.remove("amx")
    return tuple(here)

