"""Files in and out: atomic saves, loading models, adapters and tokenizers.

Saving never loses a user's weights: everything is written to a staging folder
inside output_dir, flushed to disk, then moved over the old files one by one
with os.replace (atomic on POSIX and Windows).  A crash at any moment leaves
every file either old or new, never half-written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any

from torch import nn

from . import _compat
from .lora import ADAPTER_SUBFOLDER

logger = logging.getLogger("lowmem_aitextgen")

# tf_gpt2 sizes are OpenAI's GPT-2 checkpoints; the hub holds the same weights.
TF_GPT2_HUB_IDS = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ADAPTER_CONFIG = "adapter_config.json"
STAGING_PREFIX, WRITING_PREFIX = ".saving-", ".writing-"  # names of files not yet complete


# --- saving ------------------------------------------------------------------


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def _move_into(staging: str, target: str) -> None:
    """os.replace every staged file into target, weights before config."""
    entries = sorted(os.listdir(staging), key=lambda n: (n == "config.json", n))
    for name in entries:
        source = os.path.join(staging, name)
        if os.path.isdir(source):
            os.makedirs(os.path.join(target, name), exist_ok=True)
            _move_into(source, os.path.join(target, name))
        else:
            os.replace(source, os.path.join(target, name))


def remove_leftovers(output_dir: str) -> None:
    """Half-written files of a save that was killed (only one process saves into output_dir)."""
    for name in os.listdir(output_dir):
        if name.startswith((STAGING_PREFIX, WRITING_PREFIX)):
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write one file so that readers see the old or the new content, never a mix."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=WRITING_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def atomic_save(
    output_dir: str,
    model: nn.Module,
    tokenizer: Any | None = None,
    adapter: nn.Module | None = None,
) -> None:
    """Save model (+ tokenizer, + peft adapter in lora_adapter/) so a crash never corrupts output_dir."""
    os.makedirs(output_dir, exist_ok=True)
    remove_leftovers(output_dir)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if adapter is not None:
            adapter_dir = os.path.join(staging, ADAPTER_SUBFOLDER)
            adapter.save_pretrained(adapter_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(adapter_dir)
        _fsync_tree(staging)
        written = _compat.find_weights(staging)
        _move_into(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # A pytorch_model.bin from an older save is shadowed by the new safetensors
    # (transformers prefers them) and would only confuse people.
    legacy = os.path.join(output_dir, "pytorch_model.bin")
    if written == "model.safetensors" and os.path.isfile(legacy):
        os.remove(legacy)


# --- loading models ------------------------------------------------------------


def hub_error(name: str, cache_dir: str | None, error: Exception) -> OSError:
    return OSError(
        f"Could not load {name!r} from the Hugging Face hub ({type(error).__name__}: {error}). "
        f"The hub is unreachable or HF_HUB_OFFLINE is set, and {name!r} is not in the cache "
        f"folder {cache_dir!r}. Download it once where the hub is reachable, or save the model "
        f"with save_pretrained() to a folder and pass aitextgen(model_folder='that/folder')."
    )


def from_hub(loader: Any, name: str, cache_dir: str | None, **kwargs: Any) -> Any:
    """loader.from_pretrained(name) with one clear message when the hub cannot be reached."""
    try:
        return loader.from_pretrained(name, cache_dir=cache_dir, **kwargs)
    except OSError as error:
        raise hub_error(name, cache_dir, error) from error


def check_model_folder(model_folder: str) -> None:
    """The files a model folder needs, each missing one named."""
    if not os.path.isdir(model_folder):
        raise FileNotFoundError(
            f"model_folder={model_folder!r} does not exist; pass the output_dir of a previous train() "
            "or a folder written by save_pretrained()."
        )
    if os.path.isfile(os.path.join(model_folder, ADAPTER_CONFIG)) and not os.path.isfile(
        os.path.join(model_folder, "config.json")
    ):
        return  # a LoRA adapter folder: load_adapter_folder checks it
    if not os.path.isfile(os.path.join(model_folder, "config.json")):
        raise FileNotFoundError(f"There is no config.json in model_folder={model_folder!r}; it is not a saved model.")
    if _compat.find_weights(model_folder) is None:
        raise FileNotFoundError(
            f"model_folder={model_folder!r} has config.json but no weights "
            f"(expected one of {', '.join(_compat.WEIGHT_FILES)})."
        )


def load_adapter_folder(model_folder: str, cache_dir: str | None) -> nn.Module:
    """Base model + peft adapter, from a lora_adapter/ folder; the adapter stays trainable."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_folder, ADAPTER_CONFIG), encoding="utf-8") as f:
        base_name = json.load(f).get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"The adapter in model_folder={model_folder!r} does not name its base model; "
            "load the merged model from its parent folder instead."
        )
    if os.path.isdir(base_name):
        base = AutoModelForCausalLM.from_pretrained(base_name, local_files_only=True)
    else:
        base = from_hub(AutoModelForCausalLM, base_name, cache_dir)
    return PeftModel.from_pretrained(base, model_folder, is_trainable=True)


def load_model(
    model: str | None,
    model_folder: str | None,
    config: Any,
    tf_gpt2: str | None,
    cache_dir: str | None,
) -> tuple[nn.Module, str | None]:
    """The model aitextgen's constructor arguments name, and where it came from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model is not None and os.path.isfile(model):
        raise ValueError(
            f"model={model!r} is a file; as in aitextgen >= 0.5, load a saved model with model_folder='its/folder'."
        )
    if tf_gpt2 is not None:
        if tf_gpt2 not in TF_GPT2_HUB_IDS:
            raise ValueError(f"tf_gpt2={tf_gpt2!r} is not a GPT-2 size; use one of {', '.join(TF_GPT2_HUB_IDS)}.")
        name = TF_GPT2_HUB_IDS[tf_gpt2]
        logger.info(f"Loading OpenAI's {tf_gpt2} GPT-2 weights from the hub as {name!r}.")
        return from_hub(AutoModelForCausalLM, name, cache_dir), name
    if model_folder is not None:
        check_model_folder(model_folder)
        source = os.path.abspath(model_folder)
        if os.path.isfile(os.path.join(model_folder, "config.json")):
            logger.info(f"Loading model from {model_folder}.")
            return AutoModelForCausalLM.from_pretrained(model_folder, local_files_only=True), source
        logger.info(f"Loading base model and LoRA adapter from {model_folder}.")
        return load_adapter_folder(model_folder, cache_dir), source
    if config is not None:
        logger.info("Constructing model from provided config.")
        if isinstance(config, (str, os.PathLike)):
            if not os.path.exists(config):
                raise FileNotFoundError(f"config={config!r} does not exist; pass a config.json path or a GPT2Config.")
            config = AutoConfig.from_pretrained(config)
        return AutoModelForCausalLM.from_config(config), None
    name = model or "gpt2"
    logger.info(f"Loading {name!r} from the hub (cache: {cache_dir}).")
    return from_hub(AutoModelForCausalLM, name, cache_dir), name


# --- loading tokenizers ----------------------------------------------------------


def load_tokenizer(
    *,
    tokenizer_file: str | None,
    vocab_file: str | None,
    merges_file: str | None,
    model: str | None,
    model_folder: str | None,
    cache_dir: str | None,
    special_tokens: dict[str, str],
) -> Any:
    """aitextgen's tokenizer choice, working under transformers 5.

    Order: tokenizer_file, vocab+merges files, a non-GPT-2 hub model's own
    tokenizer, the tokenizer saved beside model_folder, GPT-2's BPE.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_file is not None:
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"tokenizer_file={tokenizer_file!r} does not exist.")
        return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **special_tokens)
    if vocab_file is not None or merges_file is not None:
        if vocab_file is None or merges_file is None:
            raise ValueError("vocab_file and merges_file must be given together (or use tokenizer_file=).")
        for name, path in (("vocab_file", vocab_file), ("merges_file", merges_file)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name}={path!r} does not exist.")
        return _compat.gpt2_tokenizer_from_files(vocab_file, merges_file, **special_tokens)
    if model is not None and "gpt2" not in model:
        logger.info(f"Using the tokenizer for {model}.")
        return from_hub(AutoTokenizer, model, cache_dir)
    if model_folder is not None and any(
        os.path.isfile(os.path.join(model_folder, f)) for f in TOKENIZER_FILES
    ):
        return AutoTokenizer.from_pretrained(model_folder, local_files_only=True)
    vocab, merges = _compat.default_gpt2_vocab_files()
    return _compat.gpt2_tokenizer_from_files(vocab, merges, **special_tokens)
