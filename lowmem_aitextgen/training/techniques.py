"""The plan's memory techniques applied to a model, in one place (`apply_memory_plan`), each in its own module
with its trade-off:

| technique                     | saves                                   | costs                          |
|-------------------------------|-----------------------------------------|--------------------------------|
| (checkpointing.py: all blocks,| activations of each checkpointed block  | one extra forward of each      |
|   or the first k)             | but its input                           | checkpointed block             |
| layers_to_freeze (here)       | gradients + optimizer state of frozen   | those layers do not adapt      |
| (16-bit storage, storage16.py)| half of every frozen weight (no fp32)   | frozen weights rounded to 16 b;|
|   under autocast, or in fp32  |                                         | in fp32 an upcast per use      |
| (4-bit base, four_bit.py)     | 3/4 of the 16-bit base's block matrices | rounded to NF4; a dequantize   |
|                               |                                         | per matmul                     |
| (LoRA, see lora.py; other     | gradients + optimizer state of the base | adapter capacity only          |
|   peft adapters, adapters.py) |                                         |                                |
| (mixed precision, Lightning)  | half of activation memory, faster matmul| 16-bit rounding in forward     |
| (chunked loss, chunked_loss.py)| full-block fp32 logits and their grads | gradients made in forward      |
| (8-bit AdamW, optimizers.py)  | 3/4 of AdamW's state                    | states rounded to 8 bits       |
| (updates inside backward,     | the whole gradient copy                 | no accumulation; each tensor   |
|   in_backward.py)             |                                         | clipped alone                  |
| (sharding, offload:           | all but a block's weights per process;  | collectives; host-device copies|
|   sharding.py)                | on a GPU, the optimizer state           |                                |
| (glibc's heap, heap.py)       | heap fragmentation, page faults (CPU)   | see heap.py                    |
"""

from __future__ import annotations

from torch import nn

from . import four_bit, storage16
from .adapters import add_adapter, is_adapter_model
from .checkpointing import enable_gradient_checkpointing
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
