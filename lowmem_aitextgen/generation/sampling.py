"""One text being decoded (`Row`): its settings, its own random stream, how it picks each token and when it
stops, so that a text is the same whether it is decoded alone or beside others (engine.py steps the rows;
generate() and the server both make them).

transformers' sampling draws every row of a batch from one random stream, so a seeded row's text depends on
which rows share its batch, and its temperature, top_p and stop strings are one per batch.  Here each row draws
from a torch.Generator of its own, seeded by one rule (`row_seed`: the call's seed, the prompt's index, the
choice's index), with its own settings, and stops on its own (its length, its stop strings, end-of-text, a
stopping criterion, or its client gone).  What each row's model outputs must not depend on the other rows
either: decoding.py's int8 form quantizes each token's activations alone for that.  The rows whose settings only
scale and draw (no penalty, processor, top-k or top-p), and those that add only top_k (generate()'s default, 50),
are picked a few calls for all of them (next_tokens; 8 rows of top_k 50: half the time of a row at a time,
RESULTS.md), each row's arithmetic the one it gets alone; a top_k row's draw is one call of our kernel, alone or
beside others (native_top_k.draws, where it runs).  top_k and top_p keep what transformers' warpers
keep (at top_p's edge up to rounding: the likelier tokens' probabilities summed in float64 here, in float32 from
the least likely up there), found among the likeliest tokens (likeliest_kept: the k-th logit, or the likeliest
until they hold top_p), and the token is drawn among those alone: a pick with top_p sorted the whole vocabulary
(GPT-2's 50,257 tokens: 5 ms on the CPU, RESULTS.md) and top_k alone made four more passes over it (a mask, its
fill, a softmax, a cumulative sum).  Where the likeliest are many (a top_k past our kernel's, a top_p the 64
likeliest do not hold, a tie at the k-th) the whole row is cut (cutoffs.py: what transformers' warpers keep, found
without their sort) and drawn over.  The draw is the same inverse CDF in the order of the ids; its probabilities
are the softmax over what is kept, rounded as a softmax over fewer numbers rounds.

| setting            | applied                                          | as in                                   |
|--------------------|--------------------------------------------------|-----------------------------------------|
| repetition_penalty | over the row's own prompt and tokens (no padding) | transformers' RepetitionPenalty...      |
| processors         | transformers' LogitsProcessors given to generate()| transformers' order: before the warpers |
| min_new            | end-of-text impossible before it                  | transformers' MinNewTokensLength...     |
| temperature        | 0: the most likely token (OpenAI's convention)    | transformers' TemperatureLogitsWarper   |
| top_k, top_p       | after the temperature, then `warpers` (a warper   | transformers' TopK/TopPLogitsWarper     |
|                    | given: both cut over the whole vocabulary)        | (their cuts: cutoffs.TopK, TopP)        |
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..native import native_top_k
from . import cutoffs
from .detokenizer import Detokenizer

# how many of the likeliest tokens a top-p pick without top-k looks among before it cuts the whole vocabulary
# (cutoffs.TopP): our kernel's 64 largest of 50,257 ~0.02 ms here, a cut and a draw over the row ~0.35
CANDIDATES = 64
SEED_BITS = 63  # a row's seed: derived by row_seed, or (unseeded) drawn from the OS, never from torch's global
# A temperature below this decodes as 0 (the most likely token), the limit of sampling as it goes to zero: divided by a
# smaller one, a float32 logit past 3.4e8 overflows (the draw then picked among NaNs), and two logits further apart
# than 1e-27 are already e^-1000 apart, a probability of zero beside the likeliest
MIN_TEMPERATURE = 1e-30


def row_seed(seed: int | None, prompt: Sequence[int], choice: int, attempt: int = 0) -> int:
    """The seed of the random stream of one text: choice `choice` (0, 1, ...) of the prompt whose ids are
    `prompt`, in a call seeded `seed` (`attempt`: generate() making again a text that came out empty).  The one
    rule generate(), generate_to_file() and the server share: a seeded text is the same alone, in a prompt list
    (the prompt itself enters, not its place in the list), in a file, streamed and served.  Unseeded: a fresh
    seed from the OS (torch's global generator is never read)."""
    if seed is None:
        return secrets.randbits(SEED_BITS)
    key = hashlib.blake2b(digest_size=8)
    key.update(f"{seed}/{choice}/{attempt}/".encode())
    key.update(",".join(map(str, prompt)).encode())
    return int.from_bytes(key.digest(), "big") >> (64 - SEED_BITS)


@dataclass(frozen=True)
class RowSettings:
    """How one text is decoded.  `seed`: its stream's seed as row_seed made it (None: drawn from the OS)."""

    max_new: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    min_new: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos: tuple[int, ...] | None = None  # the tokens that end the text (None: the tokenizer's end-of-text)
    processors: tuple[Any, ...] = ()  # transformers LogitsProcessors, before the temperature
    warpers: tuple[Any, ...] = ()  # transformers LogitsProcessors, after top_k and top_p
    criteria: tuple[Any, ...] = ()  # transformers StoppingCriteria
    logprobs: int | None = None  # each token made scored, with this many likeliest alternatives (None: not)
    score_prompt: bool = False  # the prompt's own tokens scored too (the server's echo with logprobs)
    # its text must be the same beside any others (a seed given, or greedy): in the form of seeded texts its
    # attention is computed alone (row_attention.each_row_alone); False (the server's unseeded sampled requests):
    # the batch's attention (a 355M step of 16 rows a ninth to a seventh faster: RESULTS.md)
    repeatable: bool = True

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # (frozen) the one place a temperature is normalized


# A token scored: its id, its log-probability under the model's own scores (before temperature, top-k/p) and
# the likeliest alternatives' (id, log-probability), likeliest first
Scored = tuple[int, float, list[tuple[int, float]]]


def scored(logits: torch.Tensor, tokens: torch.Tensor, alternatives: int) -> list[Scored]:
    """Each of `tokens` scored by the logits that predicted it (one row of logits a token)."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(alternatives, dim=-1) if alternatives else (logprobs[:, :0],) * 2
    return [(int(t), p, list(zip(ids, values))) for t, p, ids, values
            in zip(tokens.tolist(), chosen, top_ids.tolist(), top_values.tolist())]


class Row:
    """One text being decoded: its prompt's ids, its settings and random stream, the tokens made, the text
    handed on so far (`on_text` gets each new piece; kept only where pieces or stop strings need it) and why it
    finished ("stop", "length", "cancelled")."""

    def __init__(self, prompt: torch.Tensor, settings: RowSettings,
                 on_text: Callable[[str], None] | None = None) -> None:
        self.prompt, self.settings, self.on_text = prompt, settings, on_text
        seed = settings.seed if settings.seed is not None else secrets.randbits(SEED_BITS)
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens: list[int] = []
        self.ended_on: int | None = None  # the end-of-text token that ended it (not in `tokens`)
        self.text = ""
        self.finish: str | None = None
        self.cancelled = threading.Event()
        self.scored: list[Scored] = []  # each token made, where settings.logprobs asks
        self.prompt_scored: list[Scored] | None = None  # the prompt's tokens after the first (score_prompt)
        self.first_token_at: float | None = None  # time.monotonic() when its first token was taken
        self._detokenizer: Detokenizer | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.cancelled.is_set()

    def ids(self) -> torch.Tensor:
        """The prompt and the tokens made, as one row (1, length)."""
        return torch.cat((self.prompt, torch.tensor(self.tokens, dtype=self.prompt.dtype)))[None]

    @property
    def plain(self) -> bool:
        """Its pick only bars end-of-text (min_new), scales and draws, or takes the likeliest: no penalty,
        processor, top-k, top-p or warper.  next_tokens picks such rows together."""
        return self._scales_and_draws and not self.settings.top_k

    def only_top_k(self, vocabulary: int) -> bool:
        """Its pick is a plain row's with top_k among `vocabulary` tokens (generate()'s default: top_k 50), no
        top_p.  next_tokens picks such rows together too."""
        return self._scales_and_draws and 0 < self.settings.top_k < vocabulary

    @property
    def _scales_and_draws(self) -> bool:
        """No penalty, processor, warper or top_p: what a plain row and a row adding only top_k share."""
        s = self.settings
        return s.repetition_penalty == 1.0 and not (s.processors or s.warpers) and s.top_p >= 1.0

    def next_token(self, scores: torch.Tensor, eos: tuple[int, ...]) -> int:
        """The row's next token from the model's scores for it (1-D, the vocabulary)."""
        if self.only_top_k(scores.shape[-1]) and self.settings.temperature != 0:  # the draw rows together take
            token = _drawn_among_top_k([self], scores[None], self.settings.top_k, eos)[0]
            if token is not None:
                return token
        return self._picked(scores, eos)

    def _picked(self, scores: torch.Tensor, eos: tuple[int, ...]) -> int:
        """next_token's pick by transformers' processors and warpers, or among what they keep (likeliest_kept)."""
        from transformers import RepetitionPenaltyLogitsProcessor

        s = self.settings
        logits = scores.float()[None]
        seen = self.ids() if s.repetition_penalty != 1.0 or s.processors or s.warpers else None
        if s.repetition_penalty != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(seen, logits)
        for processor in s.processors:
            logits = processor(seen, logits)
        if eos and len(self.tokens) < s.min_new:
            logits = logits.clone()
            logits[0, list(eos)] = -torch.inf
        if s.temperature == 0:
            return int(logits.argmax())
        logits = _scaled([self], logits)
        kept = None if s.warpers else likeliest_kept(logits[0], s.top_k, s.top_p)
        if kept is not None:
            return _draw_among(*kept, self.generator)
        if s.top_k:  # (the whole row cut: cutoffs.py's warpers find what transformers' keep without their sort)
            logits = cutoffs.TopK(s.top_k)(None, logits)
        if s.top_p < 1.0:
            logits = cutoffs.TopP(s.top_p)(None, logits)
        for warper in s.warpers:
            logits = warper(seen, logits)
        return _draw(logits.softmax(-1)[0], self.generator)

    def took(self, token: int, tokenizer: Any, eos: tuple[int, ...], scores: torch.Tensor | None = None) -> None:
        """`token` appended: the finish decided (end-of-text is not kept), the new text handed on, less what may
        yet turn out to be a stop string or half a character."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if token in eos:
            self.ended_on = token
            self._finish("stop", self.text + self._held(tokenizer))
            return
        self.tokens.append(token)
        if self.settings.logprobs is not None and scores is not None:
            self.scored += scored(scores[None], torch.tensor([token]), self.settings.logprobs)
        if self._follows_text:
            text = self._text(tokenizer)
            cut = min((text.find(stop) for stop in self.settings.stop if stop in text), default=-1)
            if cut >= 0:
                self._finish("stop", text[:cut])
                return
            if len(self.tokens) < self.settings.max_new:
                self._hand_on(text[:len(text) - _unsure_tail(text, self.settings.stop)])
        if len(self.tokens) >= self.settings.max_new:
            self._finish("length", self.text + self._held(tokenizer))
        elif self.settings.criteria and _criteria_met(self.settings.criteria, self.ids(), scores):
            self._finish("stop", self.text + self._held(tokenizer))

    @property
    def _follows_text(self) -> bool:
        return self.on_text is not None or bool(self.settings.stop)

    def _held(self, tokenizer: Any) -> str:
        return self._text(tokenizer)[len(self.text):]

    def _text(self, tokenizer: Any) -> str:
        """The text of the tokens made (detokenizer.py: the line being written decoded again, not the text)."""
        if self._detokenizer is None:
            self._detokenizer = Detokenizer(tokenizer)
        return self._detokenizer.text(self.tokens)

    def _hand_on(self, text: str) -> None:
        if len(text) > len(self.text) and text.startswith(self.text):
            piece, self.text = text[len(self.text):], text
            if self.on_text is not None:
                self.on_text(piece)

    def _finish(self, reason: str, text: str) -> None:
        self._hand_on(text)
        self.finish = reason

    def end(self, tokenizer: Any) -> None:
        """The decoding is over: a row that neither stopped nor reached its length was cut off by its client."""
        if self.finish is None:
            self._finish("cancelled" if self.cancelled.is_set() else "length", self.text + self._held(tokenizer))


def _criteria_met(criteria: tuple[Any, ...], ids: torch.Tensor, scores: torch.Tensor | None) -> bool:
    """transformers' StoppingCriteria on one row: each answers a bool, or a tensor of one per row."""
    scores = scores[None] if scores is not None and scores.dim() == 1 else scores
    return any(bool(torch.as_tensor(criterion(ids, scores)).any()) for criterion in criteria)


def next_tokens(rows: list[Row], scores: torch.Tensor, eos: tuple[int, ...]) -> list[int | None]:
    """Each row's next token (None for a row done) from its row of `scores` (rows, vocabulary), as
    Row.next_token picks it; `eos`: the end-of-text tokens of a row whose settings name none.  The plain rows
    (Row.plain) are picked together, and so are the rows that only add top_k (Row.only_top_k), a few calls for all
    of them in place of a few a row: a row's division, softmax, top-k and cumulative sum are computed as alone (each
    row's own arithmetic, whatever rows are beside it: tests/test_sampling.py), its uniform number drawn from its
    own stream."""
    live = [i for i, row in enumerate(rows) if not row.done]
    top_k = [i for i in live if rows[i].only_top_k(scores.shape[-1])]
    # (one row adding top_k: its own calls are quicker than the copies for several)
    together = [i for i in live if rows[i].plain] + (top_k if len(top_k) > 1 else [])
    picks: dict[int, int | None] = {i: None for i in range(len(rows))}
    for i in set(live).difference(together):
        picks[i] = rows[i].next_token(scores[i], rows[i].settings.eos or eos)
    if together:  # (every row: the scores as they are, not a copy by a list of 400,000 floats for 8 rows, ~0.15 ms)
        theirs = scores if len(together) == scores.shape[0] and together == sorted(together) else scores[together]
        picks.update(zip(together, _picked_together([rows[i] for i in together], theirs.float(), eos)))
    return [picks[i] for i in range(len(rows))]


def _barred_ids(row: Row, eos: tuple[int, ...]) -> list[int]:
    """The tokens `row` may not pick now: its end-of-text while it is short of its min_new (transformers'
    MinNewTokensLength), as Row.next_token bars them."""
    ends = row.settings.eos or eos
    return list(ends) if ends and len(row.tokens) < row.settings.min_new else []


def _barred(rows: list[Row], logits: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """`logits` (a row each of `rows`) with each row's _barred_ids impossible: a copy where a row is barred, else
    `logits`."""
    barred = [(j, ids) for j, row in enumerate(rows) if (ids := _barred_ids(row, eos))]
    if barred:
        logits = logits.clone()
    for j, ends in barred:
        logits[j, ends] = -torch.inf
    return logits


def _scaled(rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
    """`logits` (a row each of `rows`) divided by each row's temperature, each row's division as alone (x / 1.0 is
    x: no call where no row scales): the one place a row's logits are divided (top_k.c's draw divides its k + 1
    largest as this does, each logit alone in float: native_top_k.draws)."""
    temperatures = [row.settings.temperature for row in rows]
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / torch.tensor(temperatures, dtype=logits.dtype)[:, None]


def _picked_together(rows: list[Row], logits: torch.Tensor, eos: tuple[int, ...]) -> list[int]:
    """next_tokens's picks for plain rows and rows adding only top_k, `logits` their scores (rows, vocabulary),
    never changed: the rows of one top_k (0: none) drawn by a few calls for all of them; a row tied at its k-th
    logit picked by Row._picked (transformers' warper keeps every tied token)."""
    # (barred in a copy only for what reads the whole row: a greedy row's argmax, a plain row's softmax)
    wholly = any(row.settings.temperature == 0 or not row.settings.top_k for row in rows)
    barred = _barred(rows, logits, eos) if wholly else logits
    picks = {j: int(barred[j].argmax()) for j, row in enumerate(rows) if row.settings.temperature == 0}
    drawn = [j for j, row in enumerate(rows) if row.settings.temperature != 0]
    for k in sorted({rows[j].settings.top_k for j in drawn}):
        group = [j for j in drawn if rows[j].settings.top_k == k]
        members = [rows[j] for j in group]
        tokens = (_drawn_among_top_k(members, logits if len(group) == len(rows) else logits[group], k, eos) if k
                  else _drawn(_scaled(members, barred[group]).softmax(-1), _uniform(members)).tolist())
        for j, token in zip(group, tokens):
            picks[j] = rows[j]._picked(logits[j], rows[j].settings.eos or eos) if token is None else token
    return [picks[j] for j in range(len(rows))]


def _uniform(rows: list[Row]) -> torch.Tensor:
    """A uniform number (float64) from each row's own stream."""
    if len(rows) == 1:
        return torch.rand(1, generator=rows[0].generator, dtype=torch.float64)
    return torch.cat([torch.rand(1, generator=row.generator, dtype=torch.float64) for row in rows])


def _drawn_among_top_k(rows: list[Row], logits: torch.Tensor, k: int, eos: tuple[int, ...]) -> list[int | None]:
    """Each row's token drawn among its `k` likeliest of `logits` (a row each of `rows`, not yet divided by their
    temperatures, its _barred_ids not yet barred) by a uniform number of its stream, as likeliest_kept and
    _draw_among would draw it; None for a row tied at its k-th logit (it keeps more than k: left to Row._picked;
    its uniform number drawn and not used).  On our kernel where it takes the row (native_top_k.draws: one call
    for all, its probabilities in float64), else on torch's (_top_k_on_torch)."""
    uniforms = _uniform(rows)
    tokens = native_top_k.draws(logits, k, [_barred_ids(row, eos) for row in rows],
                                [row.settings.temperature for row in rows], uniforms.tolist())
    if tokens is None:  # (not here: every row on torch's)
        tokens = [native_top_k.REFUSED] * len(rows)
    refused = [m for m, token in enumerate(tokens) if token == native_top_k.REFUSED]
    if refused:
        theirs = _top_k_on_torch([rows[m] for m in refused], logits[refused], k, eos, uniforms[refused])
        for m, token in zip(refused, theirs):
            tokens[m] = token
    return [None if token == native_top_k.TIED else token for token in tokens]


def _top_k_on_torch(rows: list[Row], logits: torch.Tensor, k: int, eos: tuple[int, ...], uniforms: torch.Tensor
                    ) -> list[int | None]:
    """_drawn_among_top_k on torch's kernels, `uniforms` the rows' numbers.  The k + 1 largest are divided, not the
    whole row: a division rounds each logit alone and never reorders two (it may make them equal: the tie is seen
    after it), so they are the k + 1 largest of the divided row, with its bits (the draw is in the order of the
    ids, whatever order equal values come in)."""
    if k > native_top_k.KERNEL_MAX_K:
        return _top_k_by_threshold(rows, logits, k, eos, uniforms)
    logits = _barred(rows, logits, eos)
    values, ids = native_top_k.largest(logits, k + 1)
    values = _scaled(rows, values)
    tied = (values[:, k] == values[:, k - 1]).tolist()
    kept = [m for m, tie in enumerate(tied) if not tie]
    tokens: list[int | None] = [None] * len(rows)
    if not kept:
        return tokens
    values, ids = (values[:, :k], ids[:, :k]) if len(kept) == len(rows) else (values[kept, :k], ids[kept, :k])
    order = ids.argsort(-1)  # the draw in the order of the ids, as _draw_among's
    found = _drawn(values.gather(-1, order).softmax(-1), uniforms[kept])
    for m, token in zip(kept, ids.gather(-1, order.gather(-1, found[:, None]))[:, 0].tolist()):
        tokens[m] = token
    return tokens


def _top_k_by_threshold(rows: list[Row], logits: torch.Tensor, k: int, eos: tuple[int, ...], uniforms: torch.Tensor
                        ) -> list[int | None]:
    """_top_k_on_torch for a k past the kernel's (native_top_k.KERNEL_MAX_K, up to the vocabulary's size): each row
    divided by its temperature, its k-th largest and the next by a cut (cutoffs.kth_and_next; torch's topk of
    40,000 sorted the row, 3.2 ms), and the draw over the whole row with what TopK removes at -inf, in the order of
    the ids as _draw_among's; None for a row whose k-th is tied with the next (Row._picked keeps every tied token,
    as transformers' warper, and as the kernel's rows leave a tie to it)."""
    scaled = _scaled(rows, _barred(rows, logits, eos))
    kth, after = cutoffs.kth_and_next(scaled, k)
    untied = (kth != after)[:, 0].tolist()
    tokens: list[int | None] = [None] * len(rows)
    if any(untied):
        keep = [m for m, clear in enumerate(untied) if clear]
        theirs = scaled if len(keep) == len(rows) else scaled[keep]
        masked = theirs.masked_fill(theirs < kth[keep], -torch.inf)
        for m, token in zip(keep, _drawn(masked.softmax(-1), uniforms[keep]).tolist()):
            tokens[m] = token
    return tokens


def likeliest_kept(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What transformers' TopK and then TopP warpers keep of `logits` (1-D; min_tokens_to_keep 1), as (logits,
    ids), likeliest first, found among the likeliest tokens (module docstring); None where nothing is filtered,
    where a tie with the k-th logit keeps more than top_k tokens, or where top_p needs more than the candidates
    (the whole vocabulary is filtered then)."""
    size = logits.shape[-1]
    if top_k > native_top_k.KERNEL_MAX_K:
        return None  # (the cut over the whole row is the quicker: cutoffs.TopK)
    if top_k and top_k < size:
        values, ids = (t[0] for t in native_top_k.largest(logits[None], top_k + 1))
        if values[top_k] == values[top_k - 1]:
            return None
        values, ids = values[:top_k], ids[:top_k]
        if top_p >= 1.0:
            return values, ids
        held = values.softmax(0).double().cumsum(0)  # the probability of what top_k keeps, likeliest first
    elif top_p < 1.0:
        values, ids = (t[0] for t in native_top_k.largest(logits[None], min(CANDIDATES, size)))
        held = logits.softmax(0)[ids].double().cumsum(0)
        if float(held[-1]) < top_p:
            return None
    else:
        return None
    kept = 1 + int((held[:-1] < top_p).sum())  # while the likelier hold less than top_p (TopP: above 1 - top_p)
    return values[:kept], ids[:kept]


def _draw_among(values: torch.Tensor, ids: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn among `ids` by their logits `values`, in the order of their ids, as _draw draws over the
    whole vocabulary with every other token's probability zero (one uniform number of the row's stream)."""
    order = ids.argsort()
    return int(ids[order[_draw(values[order].softmax(-1), generator)]])


def _draw(probabilities: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from `probabilities` with one uniform number of the row's stream (inverse CDF): what
    torch.multinomial draws, at a fifteenth of its time over GPT-2's 50,257 tokens (multinomial: 1.2 ms)."""
    return int(_drawn(probabilities[None], torch.rand(1, generator=generator, dtype=torch.float64))[0])


def _drawn(probabilities: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token of each row of `probabilities` (rows, vocabulary) where its cumulative sum (in float64) passes
    that row's `uniform` number (rows) times its total."""
    cumulative = probabilities.cumsum(-1, dtype=torch.float64)
    found = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)[:, 0]
    return found.clamp_(max=probabilities.shape[-1] - 1)


def _unsure_tail(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` not to hand on yet: a half-decoded character, or the start of a stop
    string (OpenAI's streams never show any of a stop string)."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)

