"""generate(stream=True): the text as it is made, as an iterator of pieces.

transformers' streamers are the tool (generate(streamer=...) hands each new token to `put`), but its
TextIteratorStreamer ends at the end of one generate() call, and a text past the context is made by several
(generation.py slides the window): `Tokens` passes on the new tokens of every call and skips each call's
window, and the iterator ends when the whole text is made.  Decoding runs in a thread, the iterator in the
caller's; leaving the iterator early (break, Ctrl-C, an error) stops the decoding at its next token and waits
for the thread, so nothing runs on after it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_DONE = object()


class Tokens:
    """A streamer (transformers' BaseStreamer protocol: put, end) passing on each new token, not the window
    each generate() call starts from; `stop` set, every call stops at its next token."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self._window_next = True  # each generate() call first puts its input

    def put(self, value: torch.Tensor) -> None:
        if self._window_next:
            self._window_next = False
            return
        self.queue.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self._window_next = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """As a stopping criterion: every row done once the iterator has been left."""
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_text(decode: Callable[[Any], list[int]], tokenizer: Any, prompt_ids: torch.Tensor, lstrip: bool,
                skip_special_tokens: bool, seed: int | None) -> Iterator[str]:
    """The pieces of the text decode(streamer) makes, the prompt first: joined, they are the text
    generate(return_as_list=True) returns for the same seed (each piece is what decoding every token so far
    adds, held back while it ends inside a character)."""
    tokens = Tokens()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            decode(tokens)
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)
        finally:
            tokens.queue.put(_DONE)

    return _pieces(run, tokens, failure, tokenizer, prompt_ids.tolist(), lstrip, skip_special_tokens, seed)


def _pieces(run: Callable[[], None], tokens: Tokens, failure: list[BaseException], tokenizer: Any,
            ids: list[int], lstrip: bool, skip_special_tokens: bool, seed: int | None) -> Iterator[str]:
    from aitextgen.utils import reset_seed

    thread = threading.Thread(target=run, name="lowmem_aitextgen generate(stream=True)", daemon=True)
    # the text of ids[:start], decoded once: it ends a line, where decoding what follows apart gives the same
    # text (transformers' TextStreamer resets there too), so each token decodes the current line, not the text
    shown, done, start = "", "", 0
    thread.start()
    try:
        while True:
            text = done + tokenizer.decode(ids[start:], skip_special_tokens=skip_special_tokens)
            text = text.lstrip() if lstrip else text
            if not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
                if shown.endswith("\n"):
                    done, start = shown, len(ids)
            new = tokens.queue.get()
            if new is _DONE:
                break
            ids += new
        if failure:
            raise failure[0]
        if len(text) > len(shown):  # it ends inside a character: as the whole text's decoding does
            yield text[len(shown):]
    finally:
        tokens.stop.set()
        thread.join()
        if seed is not None:
            reset_seed()
