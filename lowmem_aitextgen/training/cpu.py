"""CPU training: what makes a step faster or leaner on CPU, in place for the length of train() only.

A callback, `CpuSpeedups`, installs these at train start and undoes them when training ends or fails.
glibc's heap settings, which hold on every device (the host's heap), are heap_callbacks.py's.

| change                            | saves                                  | costs / differs by         |
|-----------------------------------|----------------------------------------|----------------------------|
| CpuDropout, gpt2_attention        | torch's slow CPU dropout masks         | p rounded to 2^-16         |
| gpt2_attention in autocast's dtype| fp32 copies of every attention matrix  | the last bit of some bf16  |
|                                   | and their casts, forward and backward  | probabilities              |
| gelu_new -> one-kernel tanh GELU  | five elementwise ops and their backward| float rounding only        |
| peft's adapter input upcast, off  | two casts of every adapter input       | nothing (autocast is bf16) |
|   (only under autocast)           |                                        |                            |

Dropout. torch draws a CPU dropout mask one float at a time from its Mersenne Twister
(``bernoulli_``), the largest single cost of a CPU LoRA step with checkpointing (GPT-2's
attention, residual and embedding dropout and LoRA's own, each drawn twice: checkpointing recomputes
the block).  Here one 64-bit draw from the same generator gives the masks of four elements (16 random
bits each).  What that changes, and why it is the same training:
- p is rounded to a multiple of 2^-16 (0.1 becomes 0.100006); the kept values are scaled by
  1/(1-p) of the rounded p, so the expectation stays exact;
- the mask comes from torch's CPU generator: a seed repeats a run, and checkpointing's RNG restore
  makes the recompute draw the forward's mask;
- GPT-2's attention is transformers' eager math while dropout is on: SDPA draws its dropout
  internally, and with dropout its CPU path is that math.

On other devices (CUDA's dropout is one fused kernel, its allocator caches) none of this applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pytorch_lightning.callbacks import Callback
from torch import nn
from transformers import AttentionInterface
from transformers.activations import ACT2FN, NewGELUActivation
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from .callbacks import WhileTraining
from .plan import TrainPlan

MASK_LEVELS = 2**16  # one 16-bit lane per element
ATTENTION = "lowmem_cpu_dropout"  # the name registered with transformers' AttentionInterface


class _ScaleKept(torch.autograd.Function):
    """x * keep / (1 - p) with a 0/1 keep mask in x's dtype, saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _scale_kept(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return _scale_kept(grad, keep.to(grad.dtype), ctx.scale), None, None


def _scale_kept(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    # 0 + scale * x * keep in one pass, the scalar scale at full precision for 16-bit x, instead of a
    # multiply and then a scaling.  The mask is in x's dtype because a 1-byte or
    # bool mask is converted to it inside torch's kernel anyway, into a fresh temporary each call
    # (twice the time of the multiply, page faults included, for a 355M layer's attention mask).
    return torch.addcmul(x.new_zeros(()), x, keep, value=scale)


def keep_mask(like: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """A 0/1 mask shaped like `like` (its dtype and device) keeping each element with probability
    1 - p (p rounded to 2^-16), and 1/(1 - p)."""
    dropped_levels = min(round(p * MASK_LEVELS), MASK_LEVELS - 1)  # p just under 1 keeps 1 level in 2^16
    shape, numel = like.shape, like.numel()
    # random_(from, to) over (almost) all of int64: every 16-bit lane uniform on the int16 range
    bits = torch.empty((numel + 3) // 4, dtype=torch.int64, device=like.device).random_(-(2**63), 2**63 - 1)
    lanes = bits.view(torch.int16)[:numel].view(shape)
    keep = torch.empty(shape, dtype=like.dtype, device=like.device)
    torch.ge(lanes, -(MASK_LEVELS // 2) + dropped_levels, out=keep)
    return keep, MASK_LEVELS / (MASK_LEVELS - dropped_levels)


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``torch.nn.functional.dropout``, with the cheap mask on CPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or x.numel() == 0:
        return nn.functional.dropout(x, p, training)
    keep, scale = keep_mask(x, p)
    return _ScaleKept.apply(x, keep, scale)


class CpuDropout(nn.Dropout):
    """nn.Dropout drawing its mask with `fast_dropout` (``inplace`` is ignored: a new tensor is returned)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_dropout(x, self.p, self.training)


def gpt2_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GPT-2's eager attention with `fast_dropout` on the probabilities; SDPA when nothing is dropped.

    transformers' eager function calls torch's dropout itself, so the math is written out here:
    the same four steps as ``modeling_gpt2.eager_attention_forward``, all in the compute dtype.
    Under bf16 autocast eager attention leaves it: the fp32 mask of a full fine-tune promotes the
    scores to fp32, autocast's softmax runs in fp32 and its output is cast back, and backward undoes
    each cast, (heads x seq x seq) every time.  Here the mask is cast instead, and the softmax takes
    and gives bf16 (it accumulates in fp32 inside), the probabilities rounded to bf16 as before.
    """
    scaling = _gpt2_scaling(module, query) if scaling is None else scaling
    if dropout == 0.0 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    with torch.autocast(device, enabled=False):
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        scores = attention_mask.to(dtype).add(torch.matmul(query, key.transpose(-1, -2)), alpha=scaling)
        probabilities = fast_dropout(nn.functional.softmax(scores, dim=-1), dropout, module.training)
        return torch.matmul(probabilities, value).transpose(1, 2), probabilities


def _gpt2_scaling(module: nn.Module, query: torch.Tensor) -> float:
    """GPT-2's score scale: transformers 5.0 passes none to attention functions (later 5.x pass
    ``GPT2Attention.scaling``) and its eager attention applies these two config flags itself."""
    scaling = query.size(-1) ** -0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scaling /= module.layer_idx + 1
    return scaling


def _register_attention() -> None:
    """Make ATTENTION a name transformers' attention and mask dispatch know (idempotent); done when the
    swaps are first used, not at import, so importing the package changes no other library's tables."""
    AttentionInterface.register(ATTENTION, gpt2_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)  # an additive float mask, as eager attention takes


class UpcastOutsideAutocast:
    """A value for peft's ``cast_input_dtype_enabled``: true (peft casts an adapter's input to the
    adapter's fp32) except under CPU autocast, whose bf16 matmul casts that input straight back.
    A plain False would break what runs without autocast, like a sample generated during training."""

    def __bool__(self) -> bool:
        return not torch.is_autocast_enabled("cpu")


def use_cpu_speedups(model: nn.Module) -> Callable[[], None]:
    """Swap in the cheap CPU dropout (and GPT-2's attention), the one-kernel GELU, and peft's
    adapters without their input upcast under autocast; returns the undo."""
    swapped = [(name, module, CpuDropout(module.p)) for name, module in model.named_modules()
               if type(module) is nn.Dropout and module.p > 0]
    swapped += [(name, module, ACT2FN["gelu_pytorch_tanh"]) for name, module in model.named_modules()
                if type(module) is NewGELUActivation]
    for name, original, replacement in swapped:
        model.set_submodule(name, replacement.train(original.training))
    upcasting = [(module, module.cast_input_dtype_enabled) for module in model.modules()
                 if getattr(module, "cast_input_dtype_enabled", False) is True]
    for module, _ in upcasting:
        module.cast_input_dtype_enabled = UpcastOutsideAutocast()
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    switch_attention = (getattr(config, "model_type", None) == "gpt2" and config.attn_pdrop > 0
                        and not getattr(config, "reorder_and_upcast_attn", False))
    if switch_attention:
        _register_attention()
        config._attn_implementation = ATTENTION

    def undo() -> None:
        for name, original, _ in swapped:
            model.set_submodule(name, original)
        for module, flag in upcasting:
            module.cast_input_dtype_enabled = flag
        if switch_attention:
            config._attn_implementation = attention

    return undo


# --- the callbacks ---------------------------------------------------------------------


class CpuSpeedups(WhileTraining):
    """The swaps above (cheap dropout masks, one-kernel GELU, no adapter upcast) while training; the
    model is back as it was after training."""

    def __init__(self) -> None:
        super().__init__(use_cpu_speedups)


def cpu_callbacks(plan: TrainPlan) -> list[Callback]:
    """The CPU callbacks a plan asks for (plan.cpu_speedups); glibc's are heap_callbacks.py's."""
    return [CpuSpeedups()] if plan.cpu_speedups else []
