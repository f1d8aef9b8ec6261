"""LoRA adapters through peft, kept separate from the model they wrap.

Only the adapters train; the base stays frozen (and, under mixed precision,
is held in 16 bits by storage16.py).  Saving produces both the
peft adapter and the merged weights (streamed, a tensor at a time), so nothing
downstream must know LoRA was used; after training the object keeps the base
with the adapters merged into it in place.

An adapter is only right on the weights it was trained on, and its adapter_config.json names them by
place (a folder, a hub id), not by content: a later run into that folder replaces them.  The adapter
folder therefore also holds base_weights.json, a SHA-256 of the base's weights (each in the dtype
training held it in), which loading.py checks before it puts the adapter on a base.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch import nn

from . import _compat
from .plan import LoraSettings
from .saving import WeightSource, model_weights, save_model_files

ADAPTER_SUBFOLDER = "lora_adapter"
BASE_RECORD = "base_weights.json"  # in the adapter folder: which weights the adapter was trained on

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


def merge_in_place(model: nn.Module) -> nn.Module:
    """The plain transformers model with the adapters folded into its own weights, in the dtype the base
    is held in: each weight the fp32 merge rounded once (_merged), as the save writes it, one weight at a
    time.  (peft's merge_and_unload adds a delta already rounded to bf16 to the bf16 weight: rounded twice,
    it differs from the saved model in the last bit of some weights.)"""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in model.get_base_model().modules():
            if isinstance(module, LoraLayer) and not module.merged:
                weight = module.get_base_layer().weight
                weight.copy_(_merged(weight, module, weight.dtype))
        return model.unload()


def write_lora_model(folder: str, model: nn.Module, tokenizer: Any | None, dtype: torch.dtype | None,
                     base_record: dict[str, Any]) -> None:
    """A LoRA model as a save stages it: the merged model (in `dtype`) and tokenizer, and the adapter
    in lora_adapter/ with the record of its base (base_fingerprint, plus who wrote it)."""
    save_model_files(folder, model.get_base_model(), merged_weights(model, dtype))
    adapter_dir = os.path.join(folder, ADAPTER_SUBFOLDER)
    model.save_pretrained(adapter_dir)
    with open(os.path.join(adapter_dir, BASE_RECORD), "w", encoding="utf-8") as f:
        json.dump(base_record, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        tokenizer.save_pretrained(adapter_dir)


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own parameters by their plain names (a peft wrapper's base without adapters)."""
    base = model.get_base_model() if is_lora_model(model) else model
    return {name.replace(".base_layer.", "."): param for name, param in base.named_parameters()
            if "lora_" not in name}


def base_fingerprint(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, str]:
    """{"dtype", "sha256"}: a hash of every base weight (names, shapes and values) cast to `dtype`
    (default: the dtype the weights are held in now, recorded so that a base read in another dtype is
    cast the same way before it is compared).  One tensor's cast at a time."""
    parameters = base_weights(model)
    dtype = dtype or next((p.dtype for p in parameters.values() if p.is_floating_point()), torch.float32)
    digest = hashlib.sha256()
    with torch.no_grad():
        for name in sorted(parameters):
            value = parameters[name].detach()
            value = value.to(dtype) if value.is_floating_point() else value
            digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
            digest.update(value.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return {"dtype": str(dtype).removeprefix("torch."), "sha256": digest.hexdigest()}


def read_base_record(adapter_folder: str) -> dict[str, Any] | None:
    """The adapter's base_weights.json (None: an adapter saved elsewhere, which records nothing)."""
    path = os.path.join(adapter_folder, BASE_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read ({error}); it records which weights the adapter was trained on. "
                         "Restore it from the run's output_dir, or delete it to load the adapter unchecked.") from error
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise ValueError(f"{path} is not a lowmem_aitextgen base record; restore it, or delete it to load the "
                         "adapter unchecked.")
    return record


def base_matches(record: dict[str, Any], base: nn.Module) -> bool:
    """Whether `base` holds the weights the adapter's record names."""
    dtype = getattr(torch, str(record.get("dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype):
        return False
    return base_fingerprint(base, dtype)["sha256"] == record["sha256"]
