"""The text of a growing list of token ids, decoded a line at a time: one detokenizer for a row's text as it is
made (sampling.Row: stop strings, the server's streams) and for generate(stream=True) (streaming.py).

Decoding the whole text again at every token costs a text's length at each of its tokens.  A byte-level BPE text
(GPT-2's, GPT-Neo's, train_tokenizer's) decodes to the same characters in pieces wherever a piece ends a line (a
newline is a whole character, and transformers' clean-up of spaces never reaches across one), so the text up to
the last finished line is kept and only the line being written is decoded again: transformers' TextStreamer resets
there too.  A tokenizer for which that does not hold (SentencePiece's drops a piece's leading space) is found by a
probe, once, and decodes the whole text every time.  A text that ends inside a character (a trailing U+FFFD) is
the caller's to hold back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

PROBE = ("The end.\n", " Next 's line,\n", "\n", "  é and 日本\n", "last")  # lines as a text's pieces come
_SPLITS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def splits_at_lines(tokenizer: Any) -> bool:
    """Whether `tokenizer` decodes a text to the same characters as its lines decoded apart (asked once a
    tokenizer, on PROBE)."""
    try:
        return _SPLITS[tokenizer]
    except (KeyError, TypeError):
        pass
    lines = [tokenizer.encode(line, add_special_tokens=False) for line in PROBE]
    whole = tokenizer.decode([i for ids in lines for i in ids], skip_special_tokens=True)
    splits = whole == "".join(tokenizer.decode(ids, skip_special_tokens=True) for ids in lines)
    try:
        _SPLITS[tokenizer] = splits
    except TypeError:  # (not weakly referable: asked again next time)
        pass
    return splits


class Detokenizer:
    """`text(ids)`: the decoding of `ids`, a list that only grows between calls, as tokenizer.decode gives it."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.splits = splits_at_lines(tokenizer)
        self.done, self.start = "", 0  # the text of ids[:start], which ends a line

    def text(self, ids: Sequence[int]) -> str:
        """The text of `ids` (the ids of the last call, and more)."""
        text = self.done + self.tokenizer.decode(ids[self.start:], skip_special_tokens=self.skip_special_tokens)
        if self.splits and text.endswith("\n"):
            self.done, self.start = text, len(ids)
        return text
