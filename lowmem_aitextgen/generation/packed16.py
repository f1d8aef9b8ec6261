"""A CPU's bf16 decoding view with its projections' weights packed: for our own kernel where it runs
(`NativeBf16Linear`, native_bf16.py: a CPU with AVX512-BF16), else in oneDNN's layout (`PackedLinear`).

A bf16 view decoded its projections through F.linear / transformers' Conv1D (addmm), which on this CPU read a
355M model's weights at 12-17 GB/s at batch 1; the same weights reordered once into the blocked layout
oneDNN's bf16 kernels read (what inductor's freezing does for a bf16 Linear on a CPU) read at 20-22 GB/s.  The
view is a copy made for decoding only (decoding.decoding_model), so its weights can take a layout that nothing
but these kernels reads.

| choice                              | 355M, bf16 view, tokens/s (batch 1 / 8) | cost                           |
|-------------------------------------|------------------------------------------|--------------------------------|
| F.linear / Conv1D (before)          | 14.4 / 69.3                              | none                           |
| packed for oneDNN                   | 23.5 / 106.0 (RESULTS.md; llama.cpp's F16| each weight reordered once a   |
|                                     | 39.8 / 105.0)                            | view; the ops are torch's      |
|                                     |                                          | private mkldnn ones (below)    |
| packed for our kernel (AVX512-BF16) | 1.49x / 1.25x oneDNN's, alternating      | each weight reordered once; a  |
|                                     | (AMD EPYC, HISTORY.md twenty-fifth       | kernel of ours to keep (gcc)   |
|                                     | session)                                 |                                |
| the LM head packed too, for oneDNN  | within noise of the above                | a packed copy of the tied      |
|                                     |                                          | embedding (103 MB at 355M)     |
| the LM head packed too, for ours    | its product 3.4 ms a token at 355M       | the same copy (head_copied)    |
|                                     | against F.linear's 5.5 (RESULTS.md)      |                                |

The ops are `torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`: private, so where a torch lacks
them, the CPU has no native bf16 (hardware.py's fact: oneDNN's bf16 is emulated there, and a bf16 view is not
planned) or the ops fail on a probe of the first projection, the view keeps its modules as they were (slower,
same function); tests/test_decoding.py fails on a torch that dropped them (hardware.missing_packed_kernels).  Our
kernel needs neither: where it runs, a CPU presented with native bf16 packs every projection for it.
For oneDNN only projections are packed: the LM head stays the embedding's tied weight (no second copy).  For our
kernel the head is packed too, a copy of the tied embedding (`head_copied`: counted in decoding.DecodingMemory).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import hardware
from ..native import native_bf16

logger = logging.getLogger("lowmem_aitextgen")


class PackedLinear(nn.Module):
    """A 16-bit projection (nn.Linear, or transformers' Conv1D: x @ W + b) computing the same function from its
    weight packed for oneDNN."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        weight = module.weight.detach()
        weight = weight if isinstance(module, nn.Linear) else weight.t()  # Conv1D holds (in, out)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = self._pack(weight.contiguous())
        self.register_buffer("bias", None if module.bias is None else module.bias.detach().clone())

    @staticmethod
    def _pack(weight: torch.Tensor) -> Any:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # 1: batch 1's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none",
                                                 [], "")
        return out.view(*x.shape[:-1], self.out_features)


class NativeBf16Linear(PackedLinear):
    """A bf16 projection computing the same function on our own kernel (native_bf16.py), its weight packed for it:
    each row's bits its own at any number of rows."""

    @staticmethod
    def _pack(weight: torch.Tensor) -> Any:
        return native_bf16.pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return native_bf16.linear(self.packed, x, self.bias)

    def then_tanh_gelu(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """This projection and GPT-2's tanh GELU after it as one call (bf16_linear.c computes both: the stepping
        decoder's c_fc, the same bits in a block's one call, native_block.py)."""
        return functools.partial(native_bf16.linear, self.packed, bias=self.bias, gelu=True)


def pack_projections(projections: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, PackedLinear]]:
    """Each (parent, name) projection of a bf16 view on a CPU replaced by its PackedLinear, where this torch and
    CPU run the ops (a CPU with native bf16, the first tried on a probe): each (projection, its replacement);
    none where not."""
    if not projections:
        return []
    modules = [getattr(parent, name) for parent, name in projections]
    ours = native_bf16.available() and all(m.weight.dtype == torch.bfloat16 and not _inputs(m) % 2 for m in modules)
    kind, missing = (NativeBf16Linear, []) if ours else (PackedLinear, hardware.missing_packed_kernels())
    if missing or not hardware.cpu().bf16_native:
        logger.debug("bf16 projections not packed: %s", f"this torch lacks {', '.join(missing)}" if missing else
                     "bf16 is not native here")
        return []
    try:
        with torch.inference_mode():
            packed = kind(modules[0])
            packed(torch.ones(1, packed.in_features, dtype=modules[0].weight.dtype))
    except RuntimeError as error:  # this CPU's oneDNN has no bf16 kernel for them
        logger.debug("bf16 projections not packed: %s", error)
        return []
    replaced = [(modules[0], packed)]  # the probe's packing kept: each weight reordered once
    replaced += [(module, kind(module)) for module in modules[1:]]
    for (parent, name), (_, new) in zip(projections, replaced):
        setattr(parent, name, new)
    return replaced


def head_copied() -> bool:
    """Whether a CPU's bf16 view here holds a packed copy of its LM head: where our kernel packs it."""
    return native_bf16.available() and hardware.cpu().bf16_native


def _inputs(module: nn.Module) -> int:
    """A projection's inputs (transformers' Conv1D holds its weight (in, out))."""
    return module.weight.shape[1 if isinstance(module, nn.Linear) else 0]
