"""A 4-bit frozen base for adapters: QLoRA's NF4, as torchao's NF4Tensor.

An adapter (LoRA, IA3, prefix tuning, any peft method) trains on a frozen base.  storage16.py holds that
base in 16 bits; here its largest part, the matrices of the transformer blocks, goes to 4 bits, and each
layer dequantizes its weight for the one matmul that needs it (storage16's forwards do that for both).

| base held in              | bytes a block weight          | cost                                          |
|---------------------------|-------------------------------|-----------------------------------------------|
| bf16 (storage16.py)       | 2                             | each weight upcast per matmul where computed  |
|                           |                               | in fp32                                       |
| NF4 (this file)           | ~0.52: 4 bits, an int8 scale  | each matmul dequantizes its weight (forward,  |
|                           | per 64 weights, a 16-bit one  | recompute, backward); each weight rounded to  |
|                           | per <=256 scales              | one of 16 levels of its block of 64: the      |
|                           |                               | merged model is the adapter on that rounded   |
|                           |                               | base (the distance to the original is in the  |
|                           |                               | run's summary)                                |

Only the blocks' matrices are quantized (GPT-2's Conv1D, a block's nn.Linear): the embeddings and the LM
head tied to them, the norms and the biases stay in 16 bits, as QLoRA keeps them.  torchao quantizes
blocks of 64 values with one scale each and the scales in groups (256 by default); GPT-2 1558M's 1600 x
1600 matrices hold 40,000 blocks, no multiple of 256, so each matrix takes the largest group up to 256
that divides its blocks.  Why torchao and not bitsandbytes: torchao's NF4 computes on CPUs too, and is
already the `8bit` extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..hardware import INSTALL_TORCHAO, eight_bit_available
from ..heap import release_freed_heap
from . import storage16

BLOCK = 64  # values sharing one scale
SCALER_BLOCK = 256  # scales sharing one (double-quantized) scale, at most


def scaler_block(numel: int) -> int | None:
    """The group of scales torchao quantizes `numel` values with, or None where it cannot (no multiple of 64)."""
    if numel % BLOCK:
        return None
    blocks = numel // BLOCK
    return next(size for size in range(min(SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


def nf4_bytes(numel: int) -> int:
    """Bytes torchao's NF4Tensor holds for `numel` values: 4 bits each, an int8 scale per block of 64, a bf16
    factor per group of scales, their bf16 mean and the 16-entry bf16 code book."""
    groups = numel // BLOCK // scaler_block(numel)
    return numel // 2 + numel // BLOCK + 2 * groups + 2 + 2 * 16


def quantizable_layers(model: nn.Module, trainable_too: bool = False) -> list[nn.Module]:
    """The frozen matrices NF4 can hold (GPT-2's Conv1D, nn.Linear), but the LM head and the embeddings
    (`trainable_too`: also those not frozen yet, as a model read for an adapter is)."""
    head = model.get_output_embeddings()
    kept = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} | {id(getattr(head, "weight", None))}
    return [module for module in model.modules()
            if type(module) in (Conv1D, nn.Linear) and id(module.weight) not in kept and module.weight.ndim == 2
            and (trainable_too or not module.weight.requires_grad) and scaler_block(module.weight.numel()) is not None]


@dataclass
class Rounding:
    """How far NF4 moved the base: the root of the summed squared differences over the summed squared weights,
    across every quantized matrix.  An adapter merged into the 4-bit base differs from the same adapter on the
    original base by exactly this difference (the adapter's delta is the same in both)."""

    squared_error: float = 0.0
    squared_norm: float = 0.0
    weights: int = 0

    @property
    def relative(self) -> float:
        return (self.squared_error / self.squared_norm) ** 0.5 if self.squared_norm else 0.0


@dataclass
class QuantizedBase:
    """A base read straight into 4 bits (loading.DeferredModel.load_in_four_bits): the fingerprint of the
    original (adapters.Fingerprint: what the adapter's record names) and what NF4 rounded."""

    fingerprint: Any
    rounding: Rounding


def quantize(weight: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """`weight` as a frozen NF4Tensor (quantized from its bf16 value), the rounding it made counted."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    original = weight.detach()
    nf4 = to_nf4(original.to(torch.bfloat16), BLOCK, scaler_block(original.numel()))
    exact = original.float()
    rounding.squared_error += float((nf4.get_original_weight().float() - exact).square().sum())
    rounding.squared_norm += float(exact.square().sum())
    rounding.weights += original.numel()
    return nn.Parameter(nf4, requires_grad=False)


def hold_in_four_bits(module: nn.Module, rounding: Rounding) -> None:
    """`module`'s weight replaced by its NF4 copy, and the freed 16-bit one given back at once: left to glibc,
    whose mmap threshold rises to the largest block freed, the freed copies stay as heap between the 4-bit
    ones (774M read straight into 4 bits: 3.2 GiB resident for 0.46 GiB of weights)."""
    module.weight = quantize(module.weight, rounding)
    release_freed_heap()


def check_available(argument: str = "base_bits=4") -> None:
    """torchao is installed, or an ImportError naming `argument` and the install line (before any work)."""
    if not eight_bit_available():
        raise ImportError(f"{argument}: a 4-bit base needs torchao, which holds the 4-bit NF4 type: {INSTALL_TORCHAO}.")


def hold_base_in_four_bits(model: nn.Module, rounding: Rounding | None = None) -> Rounding:
    """Every quantizable block matrix of `model`'s frozen base in NF4, one at a time (each 16-bit copy freed
    as its 4-bit one is made), computed by storage16's forwards, what it rounded added to `rounding`;
    undo: dequantize."""
    check_available()
    rounding = rounding if rounding is not None else Rounding()
    with torch.no_grad():
        for module in quantizable_layers(model):
            if not storage16.is_quantized(module.weight):
                hold_in_four_bits(module, rounding)
    storage16.compute_in_fp32(model)
    return rounding


def four_bit_weights(model: nn.Module) -> dict[nn.Module, nn.Parameter]:
    """Each module of `model` holding a 4-bit weight of its own (peft's layers also answer .weight), and it."""
    weights = {module: module._parameters.get("weight") for module in model.modules()}
    return {module: weight for module, weight in weights.items()
            if weight is not None and storage16.is_quantized(weight)}


def dequantize(model: nn.Module, dtype: torch.dtype) -> None:
    """Every 4-bit weight of `model` a plain one of `dtype` again (nn.Module.to would keep the NF4 type and
    only relabel its dtype)."""
    with torch.no_grad():
        for module, weight in four_bit_weights(model).items():
            module.weight = nn.Parameter(storage16.dense(weight, dtype), requires_grad=False)


@contextlib.contextmanager
def dense_while(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """`model`'s 4-bit weights plain ones of `dtype` inside the block, the 4-bit ones back after it (copying a
    4-bit tensor quantizes it again, with torchao's default groups)."""
    quantized = four_bit_weights(model)
    dequantize(model, dtype)
    try:
        yield
    finally:
        for module, weight in quantized.items():
            module.weight = weight
