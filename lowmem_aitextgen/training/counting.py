"""What a model holds and what a process reached, counted: parameters, distinct tensors' bytes (tied weights once,
4-bit ones as held), the state training adds to the weights, the peak.  The estimate, the plan line and the run's
record read them."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn

from . import four_bit, storage16


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights counted once."""
    seen: set[int] = set()
    trainable = total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total


def unique_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (tied weights once; a 4-bit one as four_bit.py holds it)."""
    return sum(four_bit.nf4_bytes(t.numel()) if storage16.is_quantized(t) else t.numel() * t.element_size()
               for t in {id(t): t for t in tensors}.values())


def parameter_state_bytes(model: nn.Module) -> int:
    """Weights + gradients + AdamW's two moments: what training holds before any activation.

    Exact for the parameters as they are now (dtypes included); tied weights once.
    """
    weights = unique_tensor_bytes(model.parameters())
    trainable = unique_tensor_bytes(p for p in model.parameters() if p.requires_grad)
    return weights + 3 * trainable  # gradient + exp_avg + exp_avg_sq, each in the parameter's dtype


def peak_memory_bytes(accelerator: str) -> int:
    """GPU: peak allocated by torch; CPU: the process's peak resident set size."""
    if accelerator == "gpu" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
