"""A CPU's bf16 decoding view with its projections' weights in oneDNN's packed layout (`PackedLinear`).

A bf16 view decoded its projections through F.linear / transformers' Conv1D (addmm), which on this CPU read a
355M model's weights at 12-17 GB/s at batch 1; the same weights reordered once into the blocked layout
oneDNN's bf16 kernels read (what inductor's freezing does for a bf16 Linear on a CPU) read at 20-22 GB/s.  The
view is a copy made for decoding only (decoding.decoding_model), so its weights can take a layout that nothing
but these kernels reads.

| choice                              | 355M, bf16 view, tokens/s (batch 1 / 8) | cost                           |
|-------------------------------------|------------------------------------------|--------------------------------|
| F.linear / Conv1D (before)          | 14.4 / 69.3                              | none                           |
| packed projections (here)           | 23.5 / 106.0 (RESULTS.md; llama.cpp's F16| each weight reordered once a   |
|                                     | 39.8 / 105.0)                            | view; the ops are torch's      |
|                                     |                                          | private mkldnn ones (below)    |
| the LM head packed too              | within noise of the above                | a packed copy of the tied      |
|                                     |                                          | embedding (103 MB at 355M)     |

The ops are `torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`: private, so where a torch lacks
them, the CPU has no native bf16 (hardware.py's fact: oneDNN's bf16 is emulated there, and a bf16 view is not
planned) or the ops fail on a probe of the first projection, the view keeps its modules as they were (slower,
same function); tests/test_decoding.py fails on a torch that dropped them (hardware.missing_packed_kernels).
Only projections are packed: the LM head stays the embedding's tied weight (no second copy).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import hardware

logger = logging.getLogger("lowmem_aitextgen")


class PackedLinear(nn.Module):
    """A 16-bit projection (nn.Linear, or transformers' Conv1D: x @ W + b) computing the same function from its
    weight packed for oneDNN."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        weight = module.weight.detach()
        weight = weight if isinstance(module, nn.Linear) else weight.t()  # Conv1D holds (in, out)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)  # 1: batch 1's layout
        self.register_buffer("bias", None if module.bias is None else module.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._packed, self.bias, "none",
                                                 [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_projections(projections: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, PackedLinear]]:
    """Each (parent, name) projection of a bf16 view on a CPU replaced by its PackedLinear, where this torch and
    CPU run the ops (a CPU with native bf16, the first tried on a probe): each (projection, its replacement);
    none where not."""
    missing = hardware.missing_packed_kernels()
    if not projections:
        return []
    if missing or not hardware.cpu().bf16_native:
        logger.debug("bf16 projections not packed: %s", f"this torch lacks {', '.join(missing)}" if missing else
                     "bf16 is not native here")
        return []
    first = getattr(*projections[0])
    try:
        with torch.inference_mode():
            packed = PackedLinear(first)
            packed(torch.ones(1, packed.in_features, dtype=first.weight.dtype))
    except RuntimeError as error:  # this CPU's oneDNN has no bf16 kernel for them
        logger.debug("bf16 projections not packed: %s", error)
        return []
    replaced = [(first, packed)]  # the probe's packing kept: each weight reordered once
    replaced += [(getattr(parent, name), PackedLinear(getattr(parent, name))) for parent, name in projections[1:]]
    for (parent, name), (_, new) in zip(projections, replaced):
        setattr(parent, name, new)
    return replaced
