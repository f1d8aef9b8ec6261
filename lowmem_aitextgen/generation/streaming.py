"""generate(stream=True): the text as it is made, as an iterator of pieces that decodes when it is asked.

The iterator steps the engine (engine.py) on the caller's thread: each next() decodes until the text has a
new piece, so a stream nobody reads does no work and holds no thread, and leaving it (break, close(), an
error, or dropping it) frees its cache at once.  It draws from the row's own random stream
(sampling.row_seed), so it changes nothing a later call makes.  transformers' `streamer=` is fed the same
way (feed_streamer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .detokenizer import Detokenizer
from .engine import Engine
from .sampling import Row


def stream_text(engine: Engine, row: Row, tokenizer: Any, lstrip: bool, skip_special_tokens: bool) -> Iterator[str]:
    """The pieces of `row`'s text, the prompt first: joined, they are the text generate(return_as_list=True)
    returns for the same seed (each piece is what decoding every token so far adds, held back while it ends
    inside a character)."""
    shown, detokenizer = "", Detokenizer(tokenizer, skip_special_tokens)
    ids = row.prompt.tolist()
    try:
        engine.join([row])
        while True:
            text = detokenizer.text(ids)
            text = text.lstrip() if lstrip else text
            if not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
            if not engine.rows:
                break
            engine.step()
            ids = row.prompt.tolist() + row.tokens + ([row.ended_on] if row.ended_on is not None else [])
        if len(text) > len(shown):  # it ends inside a character: as the whole text's decoding does
            yield text[len(shown):]
    finally:
        engine.close()


def feed_streamer(engine: Engine, row: Row, streamer: Any) -> None:
    """transformers' streamer protocol for one text: put() the prompt (1, length), then each new token, end()."""
    streamer.put(row.prompt[None])
    made = 0
    try:
        engine.join([row])
        while engine.rows:
            engine.step()
            new = row.tokens[made:] + ([row.ended_on] if row.ended_on is not None and row.done else [])
            if new:
                streamer.put(torch.tensor(new))
                made += len(new)
    finally:
        engine.close()
        streamer.end()
