"""The adapter a run trains, as settings: any peft method for causal LMs, LoRA included, in one value.

A plan holds one `AdapterSettings` (or None for full fine-tuning); lora=True, peft_config= and adapter=
all become one.  What differs between methods is asked of the settings here, by peft type, and decided
nowhere else:

| question                      | LoRA                          | other mergeable methods | prompt learning (prefix, prompt, p-tuning) |
|-------------------------------|-------------------------------|-------------------------|--------------------------------------------|
| merged after training         | yes, each weight rounded once | yes, by peft's merge    | no: the adapter is inputs, not weights     |
| output_dir's subfolder        | lora_adapter/                 | adapter/                | adapter/                                   |
| checkpointable blocks         | yes                           | yes                     | not prefix tuning (its KV cache)           |

peft is imported only when a config is made, so the planner can hold settings without loading peft.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# lora=True's defaults (the LoRA paper's common setup); its target modules are the model type's (lora.py)
LORA_R, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.05
LORA_SUBFOLDER = "lora_adapter"  # beside the merged model
ADAPTER_SUBFOLDER = "adapter"  # any other adapter: beside the merged model, or beside the base (prompt learning)

# train(adapter=...)'s short forms: peft's config for the method, with these settings
SHORT_FORMS: dict[str, dict[str, Any]] = {
    # 20 virtual tokens: the prefix-tuning paper's setting for generation tasks (Li & Liang, 2021)
    "prefix": {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 20},
}
# a config's fields that say where or when it was made, or that peft fills in from the model: not settings
_NOT_SETTINGS = ("peft_version", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
                 "num_layers", "token_dim", "num_attention_heads", "num_transformer_submodules")
# prefix tuning's keys and values reach each block as a KV cache, dropped from checkpointed blocks
NOT_CHECKPOINTABLE = ("PREFIX_TUNING",)


@dataclass(frozen=True)
class AdapterSettings:
    """A peft method and its settings (a peft config's fields as JSON: comparable, hashable, and kept in a
    checkpoint's run description and the summary)."""

    peft_type: str
    settings_json: str

    @classmethod
    def of(cls, config: Any, model_type: str | None = None) -> AdapterSettings:
        """From a peft config (or a short form's fields, or `settings`).  A LoraConfig that names no
        target_modules gets peft's own default for `model_type`, named: None stands for lora=True's default."""
        fields = config if isinstance(config, dict) else config.to_dict()
        fields = {k: v for k, v in fields.items() if k not in _NOT_SETTINGS and k != "peft_type"}
        peft_type = str(getattr(config, "peft_type", None) or config["peft_type"]).removeprefix("PeftType.")
        fields["task_type"] = "CAUSAL_LM"
        if peft_type == "LORA" and not fields.get("target_modules") and model_type is not None:
            fields["target_modules"] = _peft_default_targets(model_type)
        return cls(peft_type, json.dumps(fields, sort_keys=True, default=_jsonable))

    @classmethod
    def short_form(cls, name: str) -> AdapterSettings:
        return cls.of(SHORT_FORMS[name])

    @classmethod
    def lora(cls, r: int = LORA_R, alpha: float = LORA_ALPHA, dropout: float = LORA_DROPOUT,
             target_modules: tuple[str, ...] | list[str] | None = None) -> AdapterSettings:
        """lora=True's adapter, from a peft LoraConfig; target_modules None: the model type's default
        (lora.py's, every projection of the block, put in when the adapter is added)."""
        from peft import LoraConfig

        targets = list(target_modules) if target_modules else None
        # numbers as floats: lora_alpha=16 and 16.0 are one setting (a resumed run compares them)
        return cls.of(LoraConfig(r=int(r), lora_alpha=float(alpha), lora_dropout=float(dropout),
                                 target_modules=targets, task_type="CAUSAL_LM"))

    def same_as(self, other: AdapterSettings) -> bool:
        """Whether `other` is this adapter: the same method and settings, peft's defaults filled in, but for the
        fields one leaves to peft (None) that peft fills in from the model (a loaded adapter's config has them;
        the call that made it, repeated, has not)."""
        if other.peft_type != self.peft_type:
            return False
        mine, theirs = (json.loads(AdapterSettings.of(a.peft_config()).settings_json) for a in (self, other))
        return all(mine.get(key) == theirs.get(key) or None in (mine.get(key), theirs.get(key))
                   for key in mine.keys() | theirs.keys())

    def peft_config(self) -> Any:
        """A new peft config of these settings (get_peft_model fills in the model's fields)."""
        from peft import PeftConfig

        return PeftConfig.from_peft_type(peft_type=self.peft_type, **json.loads(self.settings_json))

    @property
    def settings(self) -> dict[str, Any]:
        return {"peft_type": self.peft_type, **json.loads(self.settings_json)}

    @property
    def is_lora(self) -> bool:
        return self.peft_type == "LORA"

    @property
    def mergeable(self) -> bool:
        """Whether the trained adapter folds into the base's weights (not for prompt learning)."""
        return not self.peft_config().is_prompt_learning

    @property
    def subfolder(self) -> str:
        """The subfolder of output_dir the adapter is saved in (beside the merged model, or the base)."""
        return LORA_SUBFOLDER if self.is_lora else ADAPTER_SUBFOLDER

    @property
    def positions_taken(self) -> int:
        """Positions of the model's context the adapter's virtual tokens take before the text (prefix and
        prompt tuning shift the text's positions by them): the text gets the rest."""
        return 0 if self.mergeable else int(json.loads(self.settings_json).get("num_virtual_tokens") or 0)

    @property
    def checkpointable(self) -> bool:
        return self.peft_type not in NOT_CHECKPOINTABLE

    def lora_fields(self) -> dict[str, Any] | None:
        """LoRA's own hyper-parameters by train()'s names (r, alpha, dropout, target_modules); None for
        other methods."""
        if not self.is_lora:
            return None
        fields = json.loads(self.settings_json)
        return {"r": fields["r"], "alpha": fields["lora_alpha"], "dropout": fields["lora_dropout"],
                "target_modules": fields.get("target_modules")}

    def describe(self) -> str:
        if self.is_lora:
            return f"LoRA r={json.loads(self.settings_json)['r']}"
        tokens = json.loads(self.settings_json).get("num_virtual_tokens")
        return self.peft_type.lower().replace("_", " ") + (f", {tokens} virtual tokens" if tokens else "")


def _peft_default_targets(model_type: str) -> list[str] | None:
    """What peft's get_peft_model adapts for a LoraConfig without target_modules (None: peft knows none)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return sorted(targets) if targets else None


def _jsonable(value: Any) -> Any:
    """Sets (target_modules) as sorted lists, enums by value."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", str(value))


def from_description(saved: dict[str, Any], model_type: str) -> AdapterSettings | None:
    """The adapter a checkpoint's run description names, also one written while LoRA had a field of its own
    ("lora": r, alpha, dropout, target_modules, beside "adapter"): checkpoints from before keep resuming."""
    if not saved.get("adapter") and not saved.get("lora"):
        return None
    if "lora" not in saved:  # as this version writes it: the settings as they were planned
        return AdapterSettings.of(saved["adapter"])
    lora = saved["lora"]
    if lora:
        return AdapterSettings.lora(lora["r"], lora["alpha"], lora["dropout"], lora.get("target_modules"))
    # then a LoraConfig without target_modules meant peft's default, named now (AdapterSettings.of)
    return AdapterSettings.of(saved["adapter"], model_type)
