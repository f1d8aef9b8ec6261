"""Weights stored in 16 bits: frozen weights cast (`cast_frozen_weights`, computed by autocast in 16 bits),
or stored in bf16 and computed in fp32 (LoRA's frozen base, or a full fine-tune's weights under 8-bit
AdamW) at half the memory on any CPU.  Every cast of weights to 16 bits for training is made here.

Under mixed precision LoRA's frozen base is held in bf16 and autocast computes in bf16.
A CPU without native bf16 (no AVX512-BF16/AMX) emulates bf16 matmuls several times slower than fp32,
so there the plan computes in fp32, and the base used to be held in fp32 too: twice the memory of the
largest thing a LoRA run holds.  Here the base stays in bf16 and each layer upcasts its weight for the
one matmul that needs it, as QLoRA dequantizes its 4-bit base:

| choice                              | memory of the frozen base          | cost                              |
|-------------------------------------|------------------------------------|-----------------------------------|
| fp32 base, fp32 compute             | 4 bytes a weight                   | none                              |
| bf16 base, bf16 autocast            | 2 bytes a weight                   | bf16 math: fast only with native  |
|                                     |                                    | bf16; weights rounded to bf16     |
| bf16 base, fp32 compute (this file) | 2 bytes a weight, and one layer's  | each weight upcast in forward,    |
|                                     | fp32 copy at a time                | recompute and backward; weights   |
|                                     |                                    | rounded to bf16                   |

A full fine-tune is the same with every weight trainable: its gradients come out in bf16 (each the fp32
gradient rounded once; the tied embedding sums two rounded ones), and 8-bit AdamW rounds each update to
bf16 stochastically (optimizers.py), as under precision="bf16-true", whose bf16 math the planner weighs
against this one's upcasts (budget.py).

`_UpcastMatmul` keeps the 16-bit weight for backward, not its fp32 copy (autograd would keep every
layer's copy until backward: the fp32 base again), and upcasts it once more there.  A layer whose weight
trains gets its gradient in the weight's dtype.  Only where a layer's weight and its input differ in
dtype and no autocast runs does the upcast path run; anything else is the layer's own forward, so a
model left with these forwards computes as before once its weights are fp32 again.  A 4-bit weight
(four_bit.py) has no matmul of its own: for it these forwards always run, making it dense (`dense`) in the
dtype the layer computes in, autocast's where it runs (bf16, or fp16 on GPUs without bf16).
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .plan import STORAGE_DTYPE, TrainPlan


class _UpcastMatmul(torch.autograd.Function):
    """``x @ weight`` (``x @ weight.T`` when `transposed`) in x's dtype, `weight` held in 16 bits (or 4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
        ctx.transposed = transposed
        ctx.save_for_backward(weight, x if ctx.needs_input_grad[1] else None)
        upcast = dense(weight, x.dtype)
        return x @ (upcast.T if transposed else upcast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        weight, x = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            upcast = dense(weight, grad.dtype)
            grad_x = grad @ (upcast if ctx.transposed else upcast.T)
        if ctx.needs_input_grad[1]:
            flat_x, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
            grad_weight = (flat_grad.T @ flat_x if ctx.transposed else flat_x.T @ flat_grad).to(weight.dtype)
        return grad_x, grad_weight, None


def is_quantized(weight: torch.Tensor) -> bool:
    """A weight held in fewer than 16 bits (four_bit.py's NF4), which has no matmul of its own."""
    return hasattr(weight, "get_original_weight")


def dense(weight: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """`weight` as a plain tensor of `dtype` (a 4-bit one dequantized, always a new tensor)."""
    if is_quantized(weight):
        with torch.autocast(weight.device.type, enabled=False):  # fp16 autocast breaks torchao's bf16 arithmetic
            return weight.get_original_weight().to(dtype)
    return weight.to(dtype, copy=copy)


def _upcasting(module: nn.Module, x: torch.Tensor) -> bool:
    return module.weight.dtype != x.dtype and x.is_floating_point() and not torch.is_autocast_enabled(x.device.type)


def _matmul_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype a layer's stored weight is made dense in for its matmul, or None for the layer's own forward:
    a 4-bit weight always (in the dtype autocast computes in, if it runs), a 16-bit one where it differs
    from x's and no autocast runs."""
    if not is_quantized(module.weight):
        return x.dtype if _upcasting(module, x) else None
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _bias(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.to(x.dtype)


def _matmul_forward(self: nn.Module, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    dtype = _matmul_dtype(self, x)
    if dtype is None:
        return type(self).forward(self, x)
    x = x.to(dtype)
    out = _UpcastMatmul.apply(x, self.weight, transposed)
    return out + _bias(self, x) if self.bias is not None else out


def _conv1d_forward(self: Conv1D, x: torch.Tensor) -> torch.Tensor:
    return _matmul_forward(self, x, transposed=False)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _matmul_forward(self, x, transposed=True)


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if self.weight is None or not _upcasting(self, x):
        return type(self).forward(self, x)
    return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), _bias(self, x), self.eps)


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if self.weight.dtype == torch.float32 or torch.is_autocast_enabled(ids.device.type):
        return type(self).forward(self, ids)
    rows = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                       self.sparse)
    return rows.float()  # the rows only: the table itself is never upcast


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model`'s activations are in outside autocast: its embeddings' rows', fp32 where a 16-bit table
    is computed in fp32 (compute_in_fp32: a base stored in bf16 on a CPU without native bf16), else the table's."""
    embeddings = model.get_input_embeddings()
    upcast = embeddings.__dict__.get("forward")
    if upcast is not None and getattr(upcast, "__func__", None) is _embedding_forward:
        return torch.float32
    return embeddings.weight.dtype


FORWARDS: dict[type, Callable] = {Conv1D: _conv1d_forward, nn.Linear: _linear_forward,
                                  nn.LayerNorm: _layer_norm_forward, nn.Embedding: _embedding_forward}


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def supported(model: nn.Module) -> bool:
    """Whether every layer holding weights is one this file computes for (GPT-2's are)."""
    return all(type(m) in FORWARDS for m in model.modules() if _holds_parameters(m))


def supported_config(config: object) -> bool:
    """Whether every layer of a model of `config` computes here (`supported` on the model built on the meta
    device, nothing allocated): the planner offers bf16 storage with fp32 math only then."""
    return _supported_config(config.to_json_string())


@functools.lru_cache(maxsize=16)
def _supported_config(config_json: str) -> bool:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return supported(AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(config_json))))


def compute_in_fp32(model: nn.Module) -> None:
    """Give every supported layer of `model` the forward that upcasts a 16-bit weight; undo:
    restore_forwards.  Idempotent."""
    for module in model.modules():
        forward = FORWARDS.get(type(module))
        if forward is not None:
            module.forward = types.MethodType(forward, module)


def restore_forwards(model: nn.Module) -> None:
    """The layers' own forwards again."""
    for module in model.modules():
        if type(module) in FORWARDS and "forward" in module.__dict__:
            del module.forward


def hold_base_before_adapters(model: nn.Module, plan: TrainPlan) -> None:
    """LoRA's base in the plan's 16 bits before peft adds the adapters, as when train() reads a saved model
    straight into 16 bits (loading.DeferredModel): peft initialises adapters in the base's dtype, so both
    ways start from the same adapters."""
    if plan.weights_dtype is not None:
        for tensor in (*model.parameters(), *model.buffers()):  # not model.to(): it would dequantize a 4-bit one
            if tensor.is_floating_point() and not is_quantized(tensor) and tensor.dtype != plan.weights_dtype:
                tensor.data = tensor.data.to(plan.weights_dtype)


def hold_frozen_base(model: nn.Module, plan: TrainPlan) -> None:
    """LoRA's frozen base in 16 bits: in bf16 computed in fp32 where the plan upcasts, else in the dtype
    autocast computes in (nothing under fp32)."""
    if plan.bf16_weights_computed_in_fp32:
        store_frozen_weights(model)
    elif plan.half_dtype is not None:
        cast_frozen_weights(model, plan.half_dtype)


def hold_every_weight_in_bf16(model: nn.Module) -> None:
    """A full fine-tune's every weight in bf16, computed in fp32, updated by 8-bit AdamW's stochastic
    rounding (optimizers.py)."""
    model.to(STORAGE_DTYPE)
    compute_in_fp32(model)


def store_frozen_weights(model: nn.Module) -> int:
    """Frozen floating-point weights held in STORAGE_DTYPE and computed in fp32; returns bytes saved."""
    saved = cast_frozen_weights(model, STORAGE_DTYPE)
    compute_in_fp32(model)
    return saved


def cast_frozen_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold frozen floating-point weights in `dtype` (no fp32 master copy); returns bytes saved.

    Autocast computes in 16 bits anyway, so frozen weights lose nothing the forward
    pass would have kept; the trainable ones (LoRA adapters) stay fp32.
    """
    saved = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype and not is_quantized(param):
            saved += param.numel() * (param.element_size() - torch.finfo(dtype).bits // 8)
            param.data = param.data.to(dtype)
    return saved
