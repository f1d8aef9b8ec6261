"""LoRA adapters through peft: its settings, targets and merge.

Only the adapters train; the base stays frozen (and, under mixed precision, is held in 16 bits by
storage16.py).  What LoRA shares with peft's other adapters (saving the adapter beside the merged model,
the record of its base weights, merging after training) is adapters.py's; here is what is LoRA's own:
which layers it adapts by default, and a merge that rounds each weight once.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _compat
from .plan import LoraSettings

ADAPTER_SUBFOLDER = "lora_adapter"  # beside the merged model

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


def check_target_modules(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Fail before training with the names that do exist, not deep inside peft."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if type(m).__name__ in ("Linear", "Conv1D")})
        raise ValueError(
            f"lora_target_modules {missing} are not in this model; its linear layers are {linear}."
        )


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a peft LoRA model; only adapter weights require grad."""
    from peft import LoraConfig, get_peft_model

    targets = settings.target_modules or default_target_modules(model)
    check_target_modules(model, tuple(targets))
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        # GPT-2's Conv1D stores weights transposed (in_features, out_features).
        fan_in_fan_out=getattr(model.config, "model_type", "") == "gpt2",
        task_type="CAUSAL_LM",
    )
    with _compat.without_warning(_compat.PEFT_IS_GRADIENT_CHECKPOINTING, FutureWarning):
        return get_peft_model(model, config)


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
            merged = base_weight.to(exact, copy=True)
        merged.add_(delta)
        del delta
    return merged.to(dtype) if merged is not None else base_weight.to(dtype)
