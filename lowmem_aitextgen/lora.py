"""LoRA adapters through peft, kept separate from the model they wrap.

Only the adapters train; the base stays frozen (and, under mixed precision,
is held in 16 bits by memory.cast_frozen_weights).  Saving produces both the
peft adapter and the merged weights (streamed, a tensor at a time), so nothing
downstream must know LoRA was used; after training the object keeps the base
with the adapters merged into it in place.
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


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None) -> list:
    """The base model's weights with every adapter folded in, in `dtype` (default: the base's), as
    saving.WeightSource: each merged weight is made when it is written, one at a time, so no second
    copy of the model ever exists; `model` is left as it is (merging in place into 16-bit base weights
    and unmerging would round them at every periodic save)."""
    from peft.tuners.lora import LoraLayer

    from .saving import WeightSource, model_weights

    base = model.get_base_model()
    adapted = {f"{name}.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer) and not module.merged}
    weights = []
    for weight in model_weights(base):
        if "lora_" in weight.name:
            continue
        name = weight.name.replace(".base_layer.", ".")
        out = dtype or weight.dtype
        module = adapted.get(name)
        if module is None:
            make = lambda weight=weight, out=out: weight.make().to(out)  # noqa: E731
        else:
            make = lambda weight=weight, out=out, module=module: _merged(weight.make(), module, out)  # noqa: E731
        weights.append(WeightSource(name, out, weight.shape, make))
    return weights


def _merged(base_weight: torch.Tensor, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """base + deltas in `dtype`, the delta made before the copy of the base and added into it: two
    tensors of the weight's size alive at once, not three."""
    merged = None
    for adapter in module.active_adapters:
        delta = module.get_delta_weight(adapter).to(dtype)
        if merged is None:
            merged = base_weight.to(dtype, copy=True)
        merged.add_(delta)
        del delta
    return merged if merged is not None else base_weight.to(dtype)


def merge_in_place(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters folded into its own weights, in the dtype the base
    is held in (bf16 under mixed precision: merged_weights(model, torch.float32) rounded once), no second
    copy made."""
    with torch.no_grad():
        return model.merge_and_unload()
