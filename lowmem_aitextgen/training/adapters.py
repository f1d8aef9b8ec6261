"""peft adapters: putting one on a model, merging it after training, and what a save writes of it.  Their
settings are adapter_settings.py's; LoRA's own choices (default targets, its rounding) are lora.py's.

| method (peft)                 | trains                              | merged after training | output_dir holds                  |
|-------------------------------|-------------------------------------|-----------------------|-----------------------------------|
| LoRA (lora=True, peft_config) | low-rank deltas of the projections  | yes                   | merged model, lora_adapter/       |
| IA3, LoHa, LoKr, AdaLoRA, ... | scales or deltas of the projections | yes                   | merged model, adapter/            |
| prefix tuning (adapter=       | keys and values every layer attends | no: they are inputs,  | the base model, adapter/ (which   |
|   "prefix"), prompt tuning,   | to (prefix), or embeddings before   | not weights           | aitextgen(model_folder=...) puts  |
|   p-tuning                    | the text (prompt, p-tuning)         |                       | on it)                            |

Prefix tuning gives its keys and values to every block through the KV cache, which transformers does not
hand to a block it checkpoints: a prefix-tuning plan recomputes no block (plan.decide_checkpointing).

An adapter is only right on the weights it was trained on, and adapter_config.json names them by place (a
folder, a hub id), not by content: a later run into that folder replaces them.  Every adapter folder a save
writes therefore also holds base_weights.json, a SHA-256 of the base's weights (each in the dtype training
held it in; for prompt learning, of the base saved beside it), which loading.py checks before it puts the
adapter on a base.  peft's own loader checks nothing: put on output_dir's merged model, a LoRA adapter would
count twice (the README's table of outputs says which base each loader takes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any

import torch
from torch import nn

from .. import _compat, saving
from ..heap import release_freed_heap
from ..saving import WeightSource, model_weights, save_model_files
from . import four_bit, lora
from .adapter_settings import ADAPTER_SUBFOLDER, AdapterSettings
from .storage16 import dense, is_quantized

BASE_RECORD = "base_weights.json"  # in the adapter folder: which weights the adapter was trained on


def is_adapter_model(model: nn.Module) -> bool:
    """A peft model: a base with an adapter (LoRA or any other) on it."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def loaded_adapter(model: nn.Module) -> AdapterSettings | None:
    """The adapter a loaded model already has (it keeps training), None for a plain model."""
    if not is_adapter_model(model):
        return None
    return AdapterSettings.of(model.peft_config[model.active_adapter])


def positions_taken(model: nn.Module) -> int:
    """Positions of the model's context its adapter's virtual tokens take (AdapterSettings.positions_taken)."""
    settings = loaded_adapter(model)
    return settings.positions_taken if settings is not None else 0


def add_adapter(model: nn.Module, settings: AdapterSettings) -> nn.Module:
    """`model` wrapped in the peft adapter `settings` names (LoRA completed for the model: lora.for_model);
    only the adapter's parameters require grad.  Layers named that the model lacks fail here, with the
    names it has, not deep inside peft."""
    from peft import get_peft_model

    config = settings.peft_config()
    if settings.is_lora:
        config = lora.for_model(config, model)
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, (list, tuple, set, frozenset)):
        check_target_modules(model, tuple(sorted(targets)))
    with _compat.without_warning(_compat.PEFT_IS_GRADIENT_CHECKPOINTING, FutureWarning):
        return get_peft_model(model, config)


def check_adapter_fits(config: Any, settings: AdapterSettings, argument: str) -> None:
    """The adapter put on a model of `config` on the meta device (nothing allocated, nothing trained): what
    peft refuses fails here, before any work, with peft's message and the argument that chose the adapter."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        add_adapter(model, settings)
    except (ValueError, TypeError, KeyError, AttributeError) as error:  # what peft and transformers raise
        raise ValueError(f"{argument}: this {settings.describe()} adapter does not fit this "
                         f"{getattr(config, 'model_type', '')} model: {error}") from error


def check_target_modules(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Every target a layer of the model (by its name or the end of it); else the linear layers it has."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if type(m).__name__ in ("Linear", "Conv1D")})
        raise ValueError(f"target_modules {missing} are not in this model (lora_target_modules=, or peft_config's "
                         f"target_modules); its linear layers are {linear}.")


def is_prompt_learning(model: nn.Module) -> bool:
    """A peft model whose adapter is prompt learning (prefix, prompt, p-tuning): virtual tokens, no weights."""
    return is_adapter_model(model) and model.peft_config[model.active_adapter].is_prompt_learning


def is_prefix_tuning(model: nn.Module) -> bool:
    """A peft model whose adapter is prefix tuning (its virtual tokens are keys and values, not embeddings)."""
    from peft.utils import PeftType

    return is_adapter_model(model) and model.peft_config[model.active_adapter].peft_type == PeftType.PREFIX_TUNING


def is_mergeable(model: nn.Module) -> bool:
    return is_adapter_model(model) and not is_prompt_learning(model)


def _tuner_layers(base: nn.Module) -> dict[str, nn.Module]:
    """The base's layers an adapter wraps and that are not merged yet, by their names."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in base.named_modules()
            if isinstance(module, BaseTunerLayer) and not module.merged}


def _merged_parameter(module: nn.Module, parameter: str, dtype: torch.dtype) -> torch.Tensor:
    """One wrapped layer's own parameter ("weight", "bias") with the adapter folded in, in `dtype`: LoRA's
    weight rounded once (lora.merged_weight); anything else by peft's own merge on a copy of that one layer
    in fp32 (at least), rounded once.  Every parameter goes through the merge, since methods change more than
    the weight: IA3 scales a projection's output, so its merge scales the bias too."""
    from peft.tuners.lora import LoraLayer

    exact = torch.promote_types(dtype, torch.float32)
    if isinstance(module, LoraLayer) and parameter == "weight":
        return lora.merged_weight(module.get_base_layer().weight, module, dtype)
    if isinstance(module, LoraLayer) and not lora.changes_bias(module):
        return dense(module.get_base_layer().bias, dtype)
    with four_bit.dense_while(module, exact):  # peft merges into plain weights
        layer = copy.deepcopy(module)
    layer.to(exact)
    layer.merge()
    return getattr(layer.get_base_layer(), parameter).detach().to(dtype)


def _adapter_prefix(model: nn.Module) -> str:
    """What the names of a tuner's own parameters start with ("lora_", "ia3_", ...)."""
    return getattr(model.base_model, "prefix", "lora_")


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None) -> list[WeightSource]:
    """The base model's weights with the adapter folded in (a prompt-learning adapter folds in nothing: the
    base's own), in `dtype` (default: the base's), as saving.WeightSource: each merged weight is made when it is written, one at a time, so no second copy
    of the model ever exists; `model` is left as it is (merging in place into 16-bit base weights and
    unmerging would round them at every periodic save)."""
    base, prefix = model.get_base_model(), _adapter_prefix(model)
    adapted = _tuner_layers(base)
    weights = []
    for weight in model_weights(base):
        if prefix in weight.name:
            continue
        name = weight.name.replace(".base_layer.", ".")
        out = dtype or weight.dtype
        layer, _, parameter = name.rpartition(".")
        module = adapted.get(layer)
        if module is None:
            make = lambda weight=weight, out=out: dense(weight.make(), out)  # noqa: E731
        else:
            make = lambda out=out, module=module, parameter=parameter: _merged_parameter(  # noqa: E731
                module, parameter, out)
        weights.append(WeightSource(name, out, weight.shape, make))
    return weights


def merge_in_place(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The plain transformers model with the adapter folded into its own weights, each weight as the save
    writes it (_merged_parameter) in `dtype` (default: the dtype the base is held in), one weight at a
    time; the model's other weights cast to `dtype` too.  (peft's merge_and_unload adds a LoRA delta already
    rounded to bf16 to the bf16 weight: rounded twice, it differs from the saved model in the last bit of some
    weights.)"""
    with torch.no_grad():
        for module in _tuner_layers(model.get_base_model()).values():
            layer = module.get_base_layer()
            for parameter, value in list(layer.named_parameters(recurse=False)):
                merged = _merged_parameter(module, parameter, dtype or value.dtype)
                if merged.dtype == value.dtype and not is_quantized(value):  # into a 4-bit one: quantized again
                    value.copy_(merged)
                else:
                    setattr(layer, parameter, nn.Parameter(merged, requires_grad=value.requires_grad))
                del merged
                release_freed_heap()  # the merged copy's memory back at once, as the streamed save does
        plain = model.unload()
    return plain.to(dtype) if dtype is not None else plain


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own parameters by their plain names (a peft wrapper's base without adapters)."""
    if not is_adapter_model(model):
        return dict(model.named_parameters())
    prefix = _adapter_prefix(model)
    return {name.replace(".base_layer.", "."): param for name, param in model.get_base_model().named_parameters()
            if prefix not in name}


def write_adapter_model(folder: str, model: nn.Module, tokenizer: Any | None, dtype: torch.dtype | None,
                        base_record: dict[str, Any]) -> None:
    """An adapter model as a save stages it: the model every loader reads at the top (in `dtype`: the merged
    model for a mergeable method, the base for prompt learning, which changes no weight) and, in
    lora_adapter/ (adapter/ for other methods), the adapter with the record of its base (base_fingerprint,
    plus who wrote it).  No adapter_config.json at the top: transformers would put it on the model itself."""
    save_model_files(folder, model.get_base_model(), merged_weights(model, dtype))
    if not is_mergeable(model):  # trained on the base as held (rounded to 16 or 4 bits, maybe): the one saved
        # above; the base as loaded is kept too, which the adapter also applies to (a 4-bit base's original)
        original = {key: base_record[key] for key in ("dtype", "sha256") if key in base_record}
        base_record = {**base_record, **base_fingerprint(model, dtype), "original": original}
    adapter_dir = os.path.join(folder, adapter_subfolder(model))
    model.save_pretrained(adapter_dir)
    with open(os.path.join(adapter_dir, BASE_RECORD), "w", encoding="utf-8") as f:
        json.dump(base_record, f, indent=2)
    for destination in (adapter_dir, folder) if tokenizer is not None else ():
        tokenizer.save_pretrained(destination)


def read_adapter_into(model: nn.Module, folder: str) -> None:
    """The adapter weights saved in `folder` (adapter_model.safetensors) into `model`'s adapter."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(os.path.join(folder, "adapter_model.safetensors")))


def prompt_learning_beside(folder: str) -> str | None:
    """The subfolder of a model folder that holds a prompt-learning adapter for the model beside it (which
    aitextgen(model_folder=folder) puts on it), or None."""
    path = os.path.join(folder, ADAPTER_SUBFOLDER, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    try:
        settings = AdapterSettings.of(saving.read_json(path))
        return None if settings.mergeable else os.path.join(folder, ADAPTER_SUBFOLDER)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} cannot be read as a peft adapter config ({error}); restore it from the run's "
                         "output_dir, or delete the adapter folder to load the model alone.") from error


def adapter_subfolder(model: nn.Module) -> str:
    """Where beside the merged model its adapter is saved (AdapterSettings.subfolder)."""
    return AdapterSettings.of(model.peft_config[model.active_adapter]).subfolder


class Fingerprint:
    """base_fingerprint's hash, fed one base weight at a time in name order (a base read straight into 4
    bits is hashed as each weight is read, before it is quantized)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.digest = hashlib.sha256()

    def add(self, name: str, value: torch.Tensor) -> None:
        with torch.no_grad():
            value = dense(value.detach(), self.dtype) if value.is_floating_point() else value.detach()
            self.digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
            self.digest.update(value.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def record(self) -> dict[str, str]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "sha256": self.digest.hexdigest()}


def base_fingerprint(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, str]:
    """{"dtype", "sha256"}: a hash of every base weight (names, shapes and values) cast to `dtype`
    (default: the dtype the weights are held in now, recorded so that a base read in another dtype is
    cast the same way before it is compared).  One tensor's cast at a time."""
    parameters = base_weights(model)
    fingerprint = Fingerprint(dtype or next((p.dtype for p in parameters.values() if p.is_floating_point()),
                                            torch.float32))
    for name in sorted(parameters):
        fingerprint.add(name, parameters[name])
    return fingerprint.record()


def read_base_record(adapter_folder: str) -> dict[str, Any] | None:
    """The adapter's base_weights.json (None: an adapter saved elsewhere, which records nothing)."""
    path = os.path.join(adapter_folder, BASE_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        record = saving.read_json(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{error}; it records which weights the adapter was trained on. "
                         "Restore it from the run's output_dir, or delete it to load the adapter unchecked.") from error
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise ValueError(f"{path} is not a lowmem_aitextgen base record; restore it, or delete it to load the "
                         "adapter unchecked.")
    return record


def base_matches(record: dict[str, Any], base: nn.Module) -> bool:
    """Whether `base` holds the weights the adapter's record names: those it was saved with, or (prompt learning)
    the base as it was loaded, before training held it in 16 or 4 bits."""
    hashes: dict[torch.dtype, str] = {}  # the base hashed once per dtype (both records may name one)
    for named in (record, record.get("original") or {}):
        dtype = getattr(torch, str(named.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype) or "sha256" not in named:
            continue
        if dtype not in hashes:
            hashes[dtype] = base_fingerprint(base, dtype)["sha256"]
        if hashes[dtype] == named["sha256"]:
            return True
    return False
