"""LoRA through peft: the layers it adapts by default, and a merge that rounds each weight once.

Only the adapters train; the base stays frozen (and, under mixed precision, is held in 16 bits by
storage16.py).  LoRA's settings are an adapter_settings.AdapterSettings like any peft method's; what LoRA
shares with the others (adding it, saving it beside the merged model, the record of its base weights) is
adapters.py's.  Here is what is LoRA's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .storage16 import dense

# Every projection of the block: attention in/out and both MLP layers.  peft's own
# defaults adapt only attention (e.g. GPT-2: c_attn), which fine-tunes style less well.
DEFAULT_TARGETS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neo": ("q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"),
    "gptj": ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    model_type = getattr(model.config, "model_type", "")
    if model_type in DEFAULT_TARGETS:
        return DEFAULT_TARGETS[model_type]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    if model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
        return tuple(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type])
    raise ValueError(
        f"lowmem_aitextgen has no default LoRA targets for model type {model_type!r}; "
        "pass lora_target_modules=[...] with the names of its linear layers."
    )


def for_model(config: Any, model: nn.Module) -> Any:
    """A LoraConfig completed for `model`: the model type's default targets where none are named, and
    GPT-2's transposed weights (its Conv1D stores them as in_features x out_features)."""
    if not config.target_modules:
        config.target_modules = set(default_target_modules(model))
    config.fan_in_fan_out = getattr(model.config, "model_type", "") == "gpt2"
    return config


def merged_weight(base_weight: torch.Tensor, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """base + deltas, added in fp32 (at least) and rounded to `dtype` once: the saved model and the merge
    kept in memory agree to the bit whatever dtype each is in.  The delta is made before the copy of the
    base and added into it: two fp32 weight-sized tensors alive at once, not three (and, for a 16-bit
    `dtype`, the rounded result as the sum is freed)."""
    exact = torch.promote_types(dtype, torch.float32)
    merged = None
    for adapter in module.active_adapters:
        delta = module.get_delta_weight(adapter).to(exact)
        if merged is None:
            merged = dense(base_weight, exact, copy=True)
        merged.add_(delta)
        del delta
    return merged.to(dtype) if merged is not None else dense(base_weight, dtype)


def changes_bias(module: nn.Module) -> bool:
    """Whether merging this LoRA layer changes its bias (peft's lora_bias=True trains a bias for lora_B)."""
    return any(getattr(module, "lora_bias", {}).get(adapter, False) for adapter in module.active_adapters)
