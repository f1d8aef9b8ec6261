"""The `lowmem_aitextgen` console script: aitextgen's verbs and flags, parsed by fire, checked first.

aitextgen's CLI handed every flag to every call, whose **kwargs dropped what they did not know, and
fire turns values into Python literals: `--num_stepz=3` started a default 5,000-step run over
trained_model/, and `--output_dir=2024` became the number 2024.  Here each verb knows the names its
callees take: an unknown flag is an error before any work, naming the closest flags, and a flag whose
parameter is text is handed to fire quoted, so it arrives as typed.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import fire

from .aitextgen import aitextgen
from .estimate import estimate_memory
from .TokenDataset import TokenDataset
from .tokenizers import train_tokenizer


def _accepted(func: Any, kwargs: dict[str, Any], accepted: bool = True) -> dict[str, Any]:
    """The flags `func` names itself, or (accepted=False) all the others."""
    names = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if (k in names) == accepted}


def encode_cli(file_path: str, **kwargs: Any) -> None:
    """Encode and compress a dataset (written to cache_destination)."""
    TokenDataset(file_path, save_cache=True, **kwargs)


def train_cli(file_path: str, **kwargs: Any) -> None:
    """Train on a text file or an encoded .tar.gz cache."""
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    from_cache = file_path.endswith(".tar.gz")
    dataset_kwargs = _accepted(TokenDataset.__init__, kwargs)
    dataset_kwargs.setdefault("block_size", ai.model.config.n_positions)
    dataset = TokenDataset(file_path, from_cache=from_cache, tokenizer=ai.tokenizer, **dataset_kwargs)
    train_kwargs = _accepted(ai.train, kwargs)
    val_data = train_kwargs.get("val_data")
    if isinstance(val_data, str):  # a file, encoded as the training file is
        train_kwargs["val_data"] = TokenDataset(val_data, from_cache=val_data.endswith(".tar.gz"),
                                                tokenizer=ai.tokenizer, **dataset_kwargs)
    ai.train(dataset, **train_kwargs)


def generate_cli(to_file: bool = True, **kwargs: Any) -> None:
    """Generate from a trained model (model_folder=...) to a file or the console."""
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    generate_kwargs = _accepted(aitextgen.__init__, kwargs, accepted=False)
    if to_file:
        ai.generate_to_file(**generate_kwargs)
    else:
        ai.generate(**generate_kwargs)


def estimate_cli(model: str = "355M", table: bool = False, **kwargs: Any) -> None:
    """Print the memory one training step needs: a GPT-2 size name, a config.json or a model folder;
    --table: for a GPT-2 size, the plan train() makes on each common GPU (full fine-tune and LoRA)."""
    if table:
        from .cards import fits_table

        print(fits_table((model,)))
        return
    if os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if os.path.isfile(model):
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(model)
    print(estimate_memory(model, **kwargs))


def train_tokenizer_cli(files: str, **kwargs: Any) -> None:
    """Train a byte-level BPE tokenizer on the given file(s)."""
    train_tokenizer(files, **kwargs)


def _generation_settings() -> list[str]:
    from transformers import GenerationConfig

    return list(GenerationConfig().to_dict())


# Each verb, and the callables whose parameters are its flags (and the names of any other flags).
COMMANDS: dict[str, tuple[Callable, list[Callable], Callable[[], list[str]]]] = {
    "encode": (encode_cli, [TokenDataset.__init__], list),
    "train": (train_cli, [aitextgen.__init__, TokenDataset.__init__, aitextgen.train], list),
    "generate": (generate_cli, [generate_cli, aitextgen.__init__, aitextgen.generate_to_file, aitextgen.generate],
                 _generation_settings),
    "train_tokenizer": (train_tokenizer_cli, [train_tokenizer], list),
    "estimate": (estimate_cli, [estimate_cli, estimate_memory], list),
}


def flag_types(verb: str) -> dict[str, str]:
    """Every flag the verb takes, with its parameter's annotation as text ("" where none)."""
    _, callables, others = COMMANDS[verb]
    flags = dict.fromkeys(others(), "")
    for function in callables:
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) and name != "self":
                annotation = parameter.annotation
                flags.setdefault(name, annotation if isinstance(annotation, str) else getattr(
                    annotation, "__name__", str(annotation)))
    return flags


def is_text(annotation: str) -> bool:
    """A parameter that takes only text (str, str | None, a path): fire must not read it as a number."""
    parts = {part.strip() for part in annotation.replace("Optional[", "").rstrip("]").split("|")} - {"None", ""}
    return bool(parts) and parts <= {"str", "os.PathLike", "PathLike"}


def checked_argv(verb: str, argv: list[str]) -> list[str]:
    """argv for fire: unknown flags refused (SystemExit 2 with the closest names), text values quoted."""
    flags = flag_types(verb)
    first = next(iter(inspect.signature(COMMANDS[verb][0]).parameters.values()))
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg in ("--help", "--"):
            text = i == 0 and is_text(str(first.annotation))
            out.append(repr(arg) if text and not arg.startswith("-") else arg)
            i += 1
            continue
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        bare = name[2:] if name.startswith("no") and name not in flags and name[2:] in flags else name
        if bare not in flags:
            close = difflib.get_close_matches(bare, flags, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join('--' + c for c in close)}?" if close else "see --help."
            print(f"lowmem_aitextgen {verb}: unknown flag {arg}; {hint}", file=sys.stderr)
            raise SystemExit(2)
        takes_next = not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("-")
        if takes_next:
            value, i = argv[i + 1], i + 1
        quote = is_text(flags[bare]) and (has_value or takes_next)
        out.append(f"--{name}={repr(value) if quote else value}" if has_value or takes_next else f"--{name}")
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        argv = [argv[0], *checked_argv(argv[0], argv[1:])]
    fire.Fire({verb: function for verb, (function, _, _) in COMMANDS.items()}, command=argv,
              name="lowmem_aitextgen")


def aitextgen_cli(**kwargs: Any) -> None:
    """aitextgen's entry point, under its old name."""
    main()


if __name__ == "__main__":
    main()
