"""The `lowmem_aitextgen` console script: aitextgen's verbs and flags, parsed by fire, checked first.

aitextgen's CLI handed every flag to every call, whose **kwargs dropped what they did not know, and
fire turns values into Python literals: `--num_stepz=3` started a default 5,000-step run over
trained_model/, and `--output_dir=2024` became the number 2024.  Here each verb knows the names its
callees take: an unknown flag is an error before any work, naming the closest flags, and a flag whose
parameter is text is handed to fire quoted, so it arrives as typed.  A user's mistake (a value our checks
refuse) is one line on stderr and exit status 2; --debug (or LOWMEM_AITEXTGEN_DEBUG=1) shows its traceback,
and a crash of ours always does.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import fire

from . import arguments
from .aitextgen import aitextgen
from .generation import generation
from .TokenDataset import TokenDataset, check_text_file
from .tokenizers import train_tokenizer
from .training.estimate import estimate_memory


def _accepted(func: Any, kwargs: dict[str, Any], accepted: bool = True) -> dict[str, Any]:
    """The flags `func` names itself, or (accepted=False) all the others."""
    names = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if (k in names) == accepted}


def encode_cli(file_path: str, **kwargs: Any) -> None:
    """Encode and compress a dataset (written to cache_destination)."""
    TokenDataset(file_path, save_cache=True, **kwargs)


def train_cli(file_path: str, **kwargs: Any) -> None:
    """Train on a text file or an encoded .tar.gz cache."""
    from_cache = file_path.endswith(".tar.gz")
    train_kwargs = _accepted(aitextgen.train, kwargs)
    # the file and train()'s values checked before the model is loaded and the file encoded
    check_text_file(file_path, "file_path", text=not from_cache)
    arguments.check_train(aitextgen.train, arguments.of_call(aitextgen.train, train_data=file_path, **train_kwargs))
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    dataset_kwargs = _accepted(TokenDataset.__init__, kwargs)
    dataset_kwargs.setdefault("block_size", ai.model.config.n_positions)
    dataset = TokenDataset(file_path, from_cache=from_cache, tokenizer=ai.tokenizer, **dataset_kwargs)
    val_data = train_kwargs.get("val_data")
    if isinstance(val_data, str):  # a file, encoded as the training file is
        train_kwargs["val_data"] = TokenDataset(val_data, from_cache=val_data.endswith(".tar.gz"),
                                                tokenizer=ai.tokenizer, **dataset_kwargs)
    ai.train(dataset, **train_kwargs)


def generate_cli(to_file: bool = True, prompt: str = "", prompt_file: str | None = None, stream: bool = False,
                 **kwargs: Any) -> None:
    """Generate from a trained model (model_folder=...) to a file or the console; --prompt_file: a UTF-8 file
    of prompts, one a line (n texts for each); --stream: print one text to the console as it is made
    (Ctrl-C stops it at once)."""
    generate_kwargs = _accepted(aitextgen.__init__, kwargs, accepted=False)
    generate_kwargs["prompt"] = read_prompts(prompt_file) if prompt_file is not None else prompt
    generation.check_values({**generate_kwargs, "stream": stream}, to_file and not stream)  # before the model is read
    ai = aitextgen(**_accepted(aitextgen.__init__, kwargs))
    if stream:
        _print_stream(ai.generate(stream=True, **generate_kwargs))
    elif to_file:
        ai.generate_to_file(**generate_kwargs)
    else:
        ai.generate(**generate_kwargs)


def serve_cli(model_folder: str = "trained_model", host: str = "127.0.0.1", port: int = 8000,
              api_key: str | None = None, max_tokens: int = 256, max_batch: int = 8, queue: int = 64,
              timeout: float = 60.0, cors: str | None = None, threads: int | None = None,
              shutdown_timeout: float = 10.0, **kwargs: Any) -> None:
    """Serve a trained model behind OpenAI's completions API (/v1/completions, /v1/models) and a page (/),
    batching requests that arrive together (docs/serve.md); --api_key: every /v1 request then needs it;
    --max_tokens: the most a request may ask; --max_batch: texts decoded together; --queue: requests that may
    wait (more are answered 429); --timeout: seconds a request may take (then 504); --cors: origins a browser
    page elsewhere may call it from (comma-separated, * for any); --threads: CPU threads it decodes with (replicas
    on one machine: its cores divided among them); --shutdown_timeout: after SIGTERM, seconds the texts being
    decoded have to end (the queued ones are answered 503 at once), then the process exits."""
    from .serving.serving import ServeSettings, serve

    settings = ServeSettings(host, port, api_key, max_tokens, max_batch, queue, timeout, cors, threads,
                             shutdown_timeout)
    settings.check()  # before the model is read, and the port bound and held (no other server takes it meanwhile)
    settings.take_threads()  # before the model is read: preparing its serving form uses them too
    listening = settings.listen()
    ai = aitextgen(model_folder=model_folder, **_accepted(aitextgen.__init__, kwargs))
    _log_requests_to_stderr()
    serve(ai, model_folder, settings, listening)


def _log_requests_to_stderr() -> None:
    """serve's access log (server_metrics.access_logger) on stderr, a line a request, as uvicorn's own is; an
    application embedding the server configures logging itself."""
    import logging

    from .serving.server_metrics import access_logger

    if not access_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access_logger.addHandler(handler)
        access_logger.setLevel(logging.INFO)
        access_logger.propagate = False


def read_prompts(path: str) -> list[str]:
    """--prompt_file's prompts: its lines (blank ones left out), checked before any work."""
    if not (os.path.isfile(path) and os.path.getsize(path) == 0):  # its own message for that: below
        check_text_file(path, "prompt_file", text=False)
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\r\n") for line in f if line.strip()]
    except UnicodeDecodeError as error:
        raise ValueError(f"prompt_file={path!r} is not UTF-8 text (byte {error.start}); save it as UTF-8.") from None
    if not prompts:
        raise ValueError(f"prompt_file={path!r} holds no prompt; write one a line.")
    return prompts


def _print_stream(pieces: Iterator[str]) -> None:
    """Each piece as it comes; Ctrl-C ends the text there (leaving the iterator stops the decoding)."""
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        print(flush=True)
        raise SystemExit(130) from None
    print()


def estimate_cli(model: str = "355M", table: bool = False, **kwargs: Any) -> None:
    """Print the memory one training step needs: a GPT-2 size name, a config.json or a model folder;
    --table: for a GPT-2 size, the plan train() makes on each common GPU and CPU machine (full fine-tune and
    LoRA)."""
    if table:
        from .cards import fits_table

        print(fits_table((model,)))
        return
    if os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if os.path.isfile(model):
        from transformers import AutoConfig

        try:
            model = AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as error:  # transformers' own errors, a JSON decoding one among them
            raise ValueError(f"{model} cannot be read as a model config ({' '.join(str(error).split())[:200]}); "
                             "name a GPT-2 size (124M, 355M, 774M, 1558M), a model folder or its config.json.") \
                from error
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
    "serve": (serve_cli, [serve_cli, aitextgen.__init__], list),
}


def flag_parameters(verb: str) -> Iterator[tuple[str, inspect.Parameter]]:
    """Each named parameter of the callables whose parameters are the verb's flags, the first callable's first
    where two share a name."""
    for function in COMMANDS[verb][1]:
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) and name != "self":
                yield name, parameter


def flag_types(verb: str) -> dict[str, str]:
    """Every flag the verb takes, with its parameter's annotation as text ("" where none)."""
    flags = dict.fromkeys(COMMANDS[verb][2](), "")
    for name, parameter in flag_parameters(verb):
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


def verb_help(verb: str) -> str:
    """`lowmem_aitextgen VERB --help`: what the verb does and every flag it takes, with its default."""
    function, _, others = COMMANDS[verb]
    defaults: dict[str, Any] = dict.fromkeys(others(), "transformers' generation default")
    for name, parameter in flag_parameters(verb):
        defaults.setdefault(name, "required" if parameter.default is parameter.empty else parameter.default)
    first, parameter = next(iter(inspect.signature(function).parameters.items()))
    positional = "" if parameter.annotation == "bool" else \
        first.upper() + " " if parameter.default is parameter.empty else f"[{first.upper()}] "
    lines = [f"usage: lowmem_aitextgen {verb} {positional}[--FLAG=VALUE ...]",
             "", (function.__doc__ or "").strip(), "", "flags (default):"]
    lines += [f"  --{name}" + ("" if default == "required" else f" ({default!r})")
              for name, default in sorted(defaults.items()) if name != first or default != "required"]
    lines += ["  --debug (a traceback for every error)"]
    return "\n".join(lines)


# What a user's mistake raises from our own checks (each message names the argument, its value and the fix);
# anything else, or any of these raised inside another library, is a crash that keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, MemoryError, ImportError)  # ImportError: an extra not installed
DEBUG_VARIABLE = "LOWMEM_AITEXTGEN_DEBUG"  # set (to anything but "" or "0"): tracebacks, as --debug
PACKAGE = os.path.dirname(os.path.abspath(__file__))


def raised_by_our_checks(error: BaseException) -> bool:
    """Whether `error` is one of USER_ERRORS raised by this package's own code (not inside a library)."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, USER_ERRORS) and bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE)


def one_line(error: BaseException, verb: str) -> str:
    """The message on one line, an argument it starts with written as the verb's flag (--name=value)."""
    message = " ".join(str(error).split())
    name = message.split("=", 1)[0]
    return f"--{message}" if name.isidentifier() and name in flag_types(verb) else message


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    verb = argv[0] if argv and argv[0] in COMMANDS else None
    if verb is not None and {"--help", "-h"} & set(argv[1:]):
        print(verb_help(verb))
        return
    if verb is not None:
        argv = [verb, *checked_argv(verb, argv[1:])]
    try:
        fire.Fire({name: function for name, (function, _, _) in COMMANDS.items()}, command=argv,
                  name="lowmem_aitextgen")
    except USER_ERRORS as error:
        if debug or verb is None or not raised_by_our_checks(error):
            raise
        print(f"lowmem_aitextgen {verb}: {one_line(error, verb)} (--debug shows where)", file=sys.stderr)
        raise SystemExit(2) from None


def aitextgen_cli(**kwargs: Any) -> None:
    """aitextgen's entry point, under its old name."""
    main()


if __name__ == "__main__":
    main()
