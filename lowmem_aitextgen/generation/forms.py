"""The forms generate() decodes in, one record each (`Form`): every fact about a form lives on its record, so that
a new form is a record and its view's kernel, not a change of the planner (decoding.py reads the records; views.py
makes the views).

| form | chosen by default where                      | speed (355M, 128 tokens; RESULTS.md)  | held-out loss vs fp32 |
|------|----------------------------------------------|---------------------------------------|-----------------------|
| int8 | a CPU with int8 kernels, a family SMOOTHED   | 3.6-10x fp32 at batch 1, 6-16x at 8   | within QUALITY_BOUND  |
|      | names (GPT-2, GPT-Neo), held in 32 or 16 bits| (our kernels; by CPU: RESULTS.md)     |                       |
| bf16 | a GPU with native bf16; a native-bf16 CPU    | CPU: 2.4x at batch 1, 3.7x at batch 8 | within QUALITY_BOUND  |
|      | without int8 kernels                         | (projections packed: packed16.py)     |                       |
| fp16 | a GPU without native bf16                    | GPU: 3-4x fp32                        | within QUALITY_BOUND  |
| fp32 | exact=True; otherwise                        | 1x                                    | the model as trained  |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import hardware
from . import int8_kernels, views
from .packed16 import head_copied


def _int8_here(device: str, model: nn.Module) -> str | None:
    if device == "gpu":
        return "int8 decoding runs on the CPU; on a GPU use decoding='auto' (16 bits)"
    if not hardware.cpu().int8_kernels:
        missing = hardware.missing_int8_kernels() + hardware.missing_onednn_int8_kernels()  # both kernels'
        return (f"this torch lacks {', '.join(missing)}, which int8 decoding calls" if missing else
                "torch's int8 kernels are for CPUs, and this one has none")
    if getattr(model.config, "model_type", None) not in views.SMOOTHED:
        return (f"no int8 view is made of {model.config.model_type} models (views.SMOOTHED names the families "
                "whose is measured); use decoding='auto'")
    return None


def _bf16_here(device: str, model: nn.Module) -> str | None:
    card = hardware.gpu()
    native = card is not None and card.bf16 if device == "gpu" else hardware.cpu().bf16_native
    return None if native else "this device computes bf16 by emulation, slower than fp32; use decoding='auto'"


def _fp16_here(device: str, model: nn.Module) -> str | None:
    if device == "cpu":
        return "a CPU computes fp16 by emulation, many times slower than fp32; use decoding='auto'"
    card = hardware.gpu()
    return None if card is not None and card.fp16 else "this card has no fp16 arithmetic; use decoding='auto'"


def _int8_because(device: str) -> str:
    kernel = int8_kernels.product_kernel()  # the same bits on each (int8_kernels.py)
    if kernel is int8_kernels.OneDNNProduct:  # slower at batch 1
        return f"{hardware.cpu().name} has int8 kernels (oneDNN's: this torch lacks torch.ao's fbgemm ones)"
    if kernel is int8_kernels.NativeProduct:
        return f"{hardware.cpu().name} has int8 kernels (our own, native_int8.py)"
    return f"{hardware.cpu().name} has int8 kernels (fbgemm's)"


def _sixteen_because(name: str) -> Callable[[str], str]:
    def because(device: str) -> str:
        machine = hardware.gpu() if device == "gpu" else hardware.cpu()
        return f"{machine.name} computes {name} natively" + (", not bf16" if name == "fp16" else "")
    return because


def _copy_bytes(dtype: torch.dtype) -> Callable[[nn.Module, str, bool], int]:
    """A copy's new weights: the model in `dtype` (on a CPU in bf16, a packed copy of the LM head beside it where
    our kernel packs it: packed16.head_copied), read first where it is not yet."""
    def view_bytes(model: nn.Module, device: str, read: bool) -> int:
        parameters = sum(p.numel() for p in model.parameters())
        copied = dtype == torch.bfloat16 and device == "cpu" and head_copied()
        head = model.get_input_embeddings().weight.numel() if copied else 0
        return dtype.itemsize * (parameters + head) + (0 if read else parameters * views.held_dtype(model).itemsize)
    return view_bytes


def _int8_bytes(model: nn.Module, device: str, read: bool) -> int:
    """An int8 view's new weights: a byte a projection's weight, the LM head a copy of the tied embedding, the
    embeddings shared (held in fp32) or copied to fp32 (held in 16 bits, or not read yet)."""
    parameters = sum(p.numel() for p in model.parameters())
    head = model.get_input_embeddings().weight.numel()
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    fp32_copy = read and views.held_dtype(model) != torch.float32
    return parameters - embeddings + head + (4 * embeddings if fp32_copy or not read else 0)


def _int8_cache() -> torch.dtype | None:
    """bf16 on a CPU that computes bf16 natively (kv_cache.py's table: half the bytes, the attention's kernel twice
    as quick there; emulated elsewhere, slower than fp32), else the activations' fp32."""
    return torch.bfloat16 if hardware.cpu().bf16_native else None


@dataclass(frozen=True)
class Form:
    """One decoding form and every fact about it.

    | field             | what                                                                                 |
    |-------------------|--------------------------------------------------------------------------------------|
    | dtype             | its activations' (a copy's weights' too)                                             |
    | quality           | the worst relative increase of held-out loss over fp32 its view measured, on the     |
    |                   | trained study model and on it carrying GPT-2's activation outliers (0.0: at most     |
    |                   | fp32's; benchmarks/generate_quality.py; int8 unsmoothed at 100x outliers: 2.4%)      |
    | tokenwise_quality | the same of its view quantizing each token alone, where it has one (int8), else None |
    | score_error       | a bound on its first-step scores' distance from the model's as trained (measured on  |
    |                   | tests/test_engine.py's trained models: int8 0.021, bf16 0.013; fp16 not on a CPU)    |
    | preferred         | the devices whose planner tries it, and in which order (0 first)                     |
    | pays_after        | per device, the tokens decoding as held takes to cost what making its view does      |
    |                   | (355M on the native-bf16 CPU: int8 2.9 s against 65 ms saved a token, bf16 0.6 s     |
    |                   | against 16 ms; a GPU's 16-bit copy is made in milliseconds)                          |
    | not_native        | why a device (and the model's family) cannot run it natively; None where it can      |
    | because           | why the plan takes it on a device                                                    |
    | view              | its view of a base model, (base, tokenwise) -> model (views.py)                      |
    | view_bytes        | the new weights its view needs, (model, device, read) -> bytes                       |
    | cache_dtype       | its view's KV cache dtype where the stepping decoder runs it (None: the activations')|
    | from_folder       | its view read straight from a model's folder, a block at a time, where it has one    |
    """

    name: str
    dtype: torch.dtype
    quality: float
    score_error: float
    not_native: Callable[[str, nn.Module], str | None]
    because: Callable[[str], str]
    view: Callable[[nn.Module, bool], nn.Module]
    view_bytes: Callable[[nn.Module, str, bool], int]
    preferred: Mapping[str, int] = field(default_factory=dict)
    pays_after: Mapping[str, int] = field(default_factory=dict)
    tokenwise_quality: float | None = None
    cache_dtype: Callable[[], torch.dtype | None] = lambda: None
    from_folder: Callable[[Any, bool], nn.Module | None] | None = None

    def view_name(self, tokenwise: bool) -> str:
        """Its view's name: the form, and where it has a view quantizing each token alone, whether this is it."""
        return f"{self.name}, each token alone" if tokenwise and self.tokenwise_quality is not None else self.name

    def measured(self, tokenwise: bool) -> float:
        """The quality its view (tokenwise: the one quantizing each token alone, where it has one) measured."""
        return self.tokenwise_quality if tokenwise and self.tokenwise_quality is not None else self.quality


def _copy(name: str, dtype: torch.dtype, **facts: Any) -> Form:
    """A form whose view is a copy of the model in `dtype` (views.sixteen_bit_view)."""
    return Form(name, dtype, view=lambda base, tokenwise: views.sixteen_bit_view(base, dtype),
                view_bytes=_copy_bytes(dtype), **facts)


FORM_RECORDS: Mapping[str, Form] = {
    "fp32": _copy("fp32", torch.float32, quality=0.0, score_error=0.0, not_native=lambda device, model: None,
                  because=lambda device: "fp32"),
    "bf16": _copy("bf16", torch.bfloat16, quality=0.0, score_error=0.03, not_native=_bf16_here,
                  because=_sixteen_because("bf16"), preferred={"cpu": 1, "gpu": 0}, pays_after={"cpu": 40}),
    "fp16": _copy("fp16", torch.float16, quality=0.0, score_error=0.03, not_native=_fp16_here,
                  because=_sixteen_because("fp16"), preferred={"gpu": 1}),
    "int8": Form("int8", torch.float32, quality=0.0, tokenwise_quality=0.0, score_error=0.03, not_native=_int8_here,
                 because=_int8_because, view=views.int8_view, view_bytes=_int8_bytes, preferred={"cpu": 0},
                 pays_after={"cpu": 45}, cache_dtype=_int8_cache, from_folder=views.int8_view_from),
}
FORMS = tuple(FORM_RECORDS)
