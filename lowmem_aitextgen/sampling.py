"""Texts decoded side by side, each with its own settings and its own random stream, so that a text is the same
whether it is decoded alone or in a batch with others (the server's batches: serving.py).

transformers' sampling draws every row of a batch from one random stream, so a seeded row's text depends on
which rows share its batch, and its temperature, top_p and stop strings are one per batch.  Here each row
(`Row`) draws from a torch.Generator of its own, seeded by its request, with its own settings, and stops on
its own (its length, its stop strings, the end-of-text token, or its client gone).  The batch runs through
transformers' generate() in greedy mode with `RowSampler` as the last logits processor: it samples each row
itself and hands generate() logits that leave one token possible, so generate() keeps what it is good at
(the KV cache, padding, finished rows) and the rows stay independent.  What each row's model outputs must not
depend on the other rows either: decoding.py's int8 form quantizes each token's activations alone for that.

| setting            | applied                                          | as in                                   |
|--------------------|--------------------------------------------------|-----------------------------------------|
| repetition_penalty | over the row's own prompt and tokens (no padding) | transformers' RepetitionPenalty...      |
| min_new            | end-of-text impossible before it                  | transformers' MinNewTokensLength...     |
| temperature        | 0: the most likely token (OpenAI's convention)    | transformers' TemperatureLogitsWarper   |
| top_k, top_p       | after the temperature                             | transformers' TopK/TopPLogitsWarper     |
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

SEED_BITS = 63  # an unseeded row's seed: drawn from the OS, never from torch's global stream


@dataclass(frozen=True)
class RowSettings:
    """How one text is decoded."""

    max_new: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    min_new: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Row:
    """One text being decoded: its prompt's ids, its settings and random stream, the tokens made, the text
    handed on so far (`on_text` gets each new piece) and why it finished ("stop", "length", "cancelled")."""

    def __init__(self, prompt: torch.Tensor, settings: RowSettings,
                 on_text: Callable[[str], None] | None = None) -> None:
        self.prompt, self.settings, self.on_text = prompt, settings, on_text
        seed = settings.seed if settings.seed is not None else secrets.randbits(SEED_BITS)
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self.cancelled = threading.Event()

    def next_token(self, scores: torch.Tensor, eos: int | None) -> int:
        """The row's next token from the model's scores for it (1-D, the vocabulary)."""
        from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

        s = self.settings
        logits = scores.float().clone()[None]
        if s.repetition_penalty != 1.0:
            seen = torch.cat((self.prompt, torch.tensor(self.tokens, dtype=self.prompt.dtype)))[None]
            logits = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(seen, logits)
        if eos is not None and len(self.tokens) < s.min_new:
            logits[0, eos] = -torch.inf
        if s.temperature == 0:
            return int(logits.argmax())
        logits = logits / s.temperature
        if s.top_k:
            logits = TopKLogitsWarper(s.top_k)(None, logits)
        if s.top_p < 1.0:
            logits = TopPLogitsWarper(s.top_p)(None, logits)
        return _draw(logits.softmax(-1)[0], self.generator)

    def took(self, token: int, tokenizer: object, eos: int | None) -> None:
        """`token` appended: the finish decided, the new text handed on, less what may yet turn out to be a
        stop string or half a character."""
        if token == eos:
            self._finish("stop", self.text + self._held(tokenizer))
            return
        self.tokens.append(token)
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((text.find(stop) for stop in self.settings.stop if stop in text), default=-1)
        if cut >= 0:
            self._finish("stop", text[:cut])
        elif len(self.tokens) >= self.settings.max_new:
            self._finish("length", text)
        else:
            self._hand_on(text[:len(text) - _unsure_tail(text, self.settings.stop)])

    def _held(self, tokenizer: object) -> str:
        return tokenizer.decode(self.tokens, skip_special_tokens=True)[len(self.text):]

    def _hand_on(self, text: str) -> None:
        if len(text) > len(self.text) and text.startswith(self.text):
            piece, self.text = text[len(self.text):], text
            if self.on_text is not None:
                self.on_text(piece)

    def _finish(self, reason: str, text: str) -> None:
        self._hand_on(text)
        self.finish = reason

    def end(self, tokenizer: object) -> None:
        """The decoding is over: a row that neither stopped nor reached its length was cut off by its client."""
        if self.finish is None:
            self._finish("cancelled" if self.cancelled.is_set() else "length", self.text + self._held(tokenizer))


def _draw(probabilities: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from `probabilities` with one uniform number of the row's stream (inverse CDF): what
    torch.multinomial draws, at a fifteenth of its time over GPT-2's 50,257 tokens (multinomial: 1.2 ms)."""
    cumulative = probabilities.double().cumsum(0)
    point = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, point, right=True)), len(probabilities) - 1)


def _unsure_tail(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` not to hand on yet: a half-decoded character, or the start of a stop
    string (OpenAI's streams never show any of a stop string)."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


class RowSampler:
    """The last logits processor of a batch of rows: samples each unfinished row itself and leaves generate()
    one possible token per row (finished rows: the padding, which generate() puts there anyway)."""

    def __init__(self, rows: list[Row], tokenizer: object, eos: int | None, pad: int) -> None:
        self.rows, self.tokenizer, self.eos, self.pad = rows, tokenizer, eos, pad

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = torch.full_like(scores, -torch.inf)
        for i, row in enumerate(self.rows):
            if row.finish is not None or row.cancelled.is_set():
                chosen[i, self.pad] = 0
                continue
            token = row.next_token(scores[i], self.eos)
            chosen[i, token] = 0
            row.took(token, self.tokenizer, self.eos)
        return chosen


class RowsDone:
    """generate()'s stopping criterion and streamer for the batch: a row is done once finished or cancelled."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.tensor([row.finish is not None or row.cancelled.is_set() for row in self.rows],
                            device=input_ids.device)

    def put(self, value: torch.Tensor) -> None:
        """Streamer side: the rows hand their text on themselves (Row.took)."""

    def end(self) -> None:
        """Streamer side: nothing to flush."""


def decode_together(model: torch.nn.Module, tokenizer: object, rows: list[Row]) -> None:
    """Every row decoded in one batch (left-padded: generation.decode_rows), each as it would be alone."""
    from .generation import Lengths, decode_rows

    eos = getattr(tokenizer, "eos_token_id", None)
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else (eos or 0)
    # every row takes one step a token: the batch needs the most any row asks (each stops itself at its own)
    longest = min(len(row.prompt) for row in rows) + max(row.settings.max_new for row in rows)
    settings = dict(do_sample=False, pad_token_id=pad, use_cache=True,
                    logits_processor=[RowSampler(rows, tokenizer, eos, pad)])
    decode_rows(model, [row.prompt for row in rows], Lengths(longest), settings, streamer=RowsDone(rows))
    for row in rows:
        row.end(tokenizer)
