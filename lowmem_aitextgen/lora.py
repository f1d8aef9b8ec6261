"""LoRA adapters through peft, kept separate from the model they wrap.

Only the adapters train; the base stays frozen (and, under mixed precision,
is held in 16 bits by memory.cast_frozen_weights).  Saving produces both the
peft adapter and a merged plain model, so nothing downstream must know LoRA
was used.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _compat
from .plan import LoraSettings

ADAPTER_SUBFOLDER = "lora_adapter"

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


def is_lora_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


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


def merged_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in, without touching `model`.

    peft's merge_and_unload() merges in place; merging into 16-bit base weights and
    unmerging again would round them at every periodic save, so we build a copy.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {
        key.replace(".base_layer.", "."): value.to(dtype)
        for key, value in base.state_dict().items()
        if "lora_" not in key
    }
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter).to(dtype)
                state[f"{name}.weight"] = state[f"{name}.weight"] + delta
    return state


def merged_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A plain transformers model equal to base + adapters, in `dtype`."""
    from transformers import AutoModelForCausalLM

    config = model.get_base_model().config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(merged_state_dict(model, dtype), strict=False, assign=True)
    plain.tie_weights()
    # Non-persistent buffers (e.g. rotary frequencies) are not in a state dict.
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:
            module_name, _, buffer_name = name.rpartition(".")
            plain.get_submodule(module_name).register_buffer(
                buffer_name, model.get_base_model().get_buffer(name).clone(), persistent=False
            )
    leftover = [name for name, p in plain.named_parameters() if p.is_meta]
    if leftover:
        raise RuntimeError(f"merging LoRA left parameters without values: {leftover[:5]}")
    return plain.to(dtype)
