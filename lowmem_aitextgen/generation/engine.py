"""The batch engine: rows (sampling.Row) decoded a step at a time, a decoding view's prompts and steps by
stepping.py's decoder (every default GPT-2 and GPT-Neo decode), the model as held over its own forward, shared by
generate() and the server.

transformers' generate() decodes one batch from start to end: every row waits for the longest, a row cannot
join, its logits processors see the padding, and peft's prompt learning reaches it only through
`past_key_values`, which transformers 5's generate() no longer reads (a prefix-tuned model generated as its
base).  Here each step feeds every running row its last token; a row that ends leaves at once, rows join
(admit: their prompts computed within the next step, beside the running rows' tokens, one pass over the weights
for both; join: encoded at once) into the cache's free slots (kv_cache.py), and a row that reaches the context
slides its window on its own.

| what                 | how                                                                                    |
|----------------------|----------------------------------------------------------------------------------------|
| left padding         | rows of different lengths share the cache, padded on the left; the attention mask hides |
|                      | the padding and each row's positions are its own (position_ids), so a row decodes as   |
|                      | it would alone                                                                          |
| virtual tokens       | prefix and prompt tuning: their keys and values (`Prefix`) start every row's cache and |
|                      | a row's tokens take the positions after them, as peft's forward gives them in training |
| past the context     | a row whose window is full is encoded again from its last window_kept() tokens         |
| the logits           | only the last position's (logits_to_keep=1): a prompt's other logits are made only     |
|                      | where a row asks its prompt scored (the server's echo with logprobs)                   |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import _compat
from ..training.storage16 import activation_dtype
from . import stepping
from .kv_cache import new_cache, refilled
from .sampling import Row, next_tokens, scored


def window_kept(context: int) -> int:
    """Tokens a slide keeps: three quarters of the context.  GPT-2's positions are absolute, so a slide
    encodes the kept window again (one forward pass of it); keeping less would slide more often, more
    would re-encode for fewer new tokens.  Text past the context sees the last kept tokens, not all."""
    return context * 3 // 4


@dataclass(frozen=True)
class Decoder:
    """What the engine runs: a causal LM (the model, or its decoding view) and, for a prompt-learning adapter
    (prefix, prompt, p-tuning), the peft model whose virtual tokens every text starts from; `view`: the model is
    a decoding view (decoding.py's copy in a faster form), which steps with the stepping decoder where it has
    one (stepping.py); the model itself steps by its own forward, token for token transformers'."""

    model: nn.Module
    prompt_learning: nn.Module | None = None
    view: bool = False
    cache_dtype: torch.dtype | None = None  # a view's KV cache's dtype where it steps (kv_cache.py; None: its own)


def as_decoder(model: nn.Module | Decoder) -> Decoder:
    """A model (or a Decoder) as the engine runs it: a prompt-learning peft model as its base and itself."""
    from ..training.adapters import is_prompt_learning

    if isinstance(model, Decoder):
        return model
    if is_prompt_learning(model):
        return Decoder(model.get_base_model(), model)
    return Decoder(model)


def pad_id(tokenizer: Any) -> int:
    """The id a text's padding takes: the tokenizer's padding, else its end-of-text, else 0.  Padding is masked out
    (or cut off again), so any id the embeddings hold will do (a custom eos_token_id may be outside them)."""
    return next(t for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None), 0)
                if t is not None and 0 <= t)


class Prefix:
    """The virtual tokens' keys and values, each layer's (1, heads, tokens, head size), in the decoder's dtype:
    prefix tuning's are the adapter's own; prompt tuning's (and p-tuning's) the decoder's keys and values of
    its virtual embeddings, at positions 0.. (as peft's forward puts them before the text)."""

    def __init__(self, decoder: Decoder) -> None:
        from ..training.adapters import is_prefix_tuning

        peft_model, model = decoder.prompt_learning, decoder.model
        dtype, device = _compute_dtype(model), _device(model)
        with torch.no_grad():
            if is_prefix_tuning(peft_model):
                states = _layers_of(peft_model.get_prompt(1))
            else:
                embeds = peft_model.get_prompt(1).to(device=device, dtype=dtype)
                positions = torch.arange(embeds.shape[1], device=device)[None]
                out = model(inputs_embeds=embeds, position_ids=positions, use_cache=True)
                states = _layers_of(_compat.cache_of(out))
        self.layers = [(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)) for k, v in states]
        self.length = self.layers[0][0].shape[-2]

    def cache(self, rows: int, dtype: torch.dtype | None = None) -> Any:
        """A cache in `dtype` (None: the prefix's) holding the prefix for `rows` rows."""
        return new_cache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.layers], dtype)


class Engine:
    """Rows decoding together.  join() encodes new rows' prompts and puts them beside the running ones; admit()
    leaves that to the next step; step() picks each running row's next token, lets the finished rows go and feeds
    the others one token, beside the admitted rows' prompts."""

    def __init__(self, decoder: Decoder | nn.Module, tokenizer: Any, eos: tuple[int, ...]) -> None:
        from aitextgen.utils import model_max_length

        self.decoder = as_decoder(decoder)
        self.model, self.tokenizer, self.eos = self.decoder.model, tokenizer, eos
        for model in (self.model, self.decoder.prompt_learning):  # no dropout: a model left in training mode
            if model is not None:  # (after train(), or sampled while training) decodes as it is evaluated
                model.eval()
        self.prefix = Prefix(self.decoder) if self.decoder.prompt_learning is not None else None
        self.virtual = self.prefix.length if self.prefix is not None else 0
        self.context = model_max_length(self.model.config) - self.virtual  # a row's tokens, past the virtual ones
        self.pad = pad_id(tokenizer)
        self.cache_keyword = _compat.cache_keyword(self.model)
        self.stepper = stepping.stepper(self.model) if self.decoder.view else None
        self.cache_dtype = self.decoder.cache_dtype if self.stepper is not None else None  # (the forward's: its own)
        self.rows: list[Row] = []
        self.joining: list[Row] = []  # admitted: their prompts computed within the next step (admit)
        self.cache: Any = None
        self.mask = self.positions = self.scores = self.window = None

    def join(self, rows: list[Row]) -> None:
        """`rows` encoded from their prompts (within the context) and added to the running ones, all or none; a
        row asking for it gets its prompt scored (Row.prompt_scored); a row asking no new token ends at the next
        step."""
        before = len(self.rows)
        plain = [row for row in rows if not row.settings.score_prompt]
        try:
            if plain:
                self._encode(plain, [row.prompt[-self.context:] for row in plain])
            for row in rows:  # one at a time: all of a prompt's logits are a context's worth of vocabularies
                if row.settings.score_prompt:
                    self._encode([row], [row.prompt[-self.context:]], score=True)
        except BaseException:
            self._keep(list(range(before)))  # all or none of `rows` join: the running rows as they were
            raise
        self._end_asking_none(rows)

    def admit(self, rows: list[Row]) -> None:
        """`rows` join at the next step, their prompts computed within it beside the running rows' tokens (one
        pass over the weights for both: joining costs the running rows little more than their step).  Joined at
        once (join) where nothing runs, where the model steps by transformers' forward, or where a row asks its
        prompt scored.  A failure to encode them fails that step."""
        if not self.rows or self.stepper is None or any(row.settings.score_prompt for row in rows):
            self.join(rows)
        else:
            self.joining += rows

    @property
    def held(self) -> int:
        """Rows running or admitted."""
        return len(self.rows) + len(self.joining)

    def step(self) -> list[Row]:
        """Each running row's next token, the admitted rows' prompts beside them; the rows that finished (Row.end
        called on them) leave and are returned."""
        if not self.rows:
            self.join(self._admitted())
            return []
        tokens = next_tokens(self.rows, self.scores, self.eos)
        for i, (row, token) in enumerate(zip(self.rows, tokens)):
            if token is None:  # done: fed padding
                tokens[i] = self.pad
            else:
                row.took(token, self.tokenizer, row.settings.eos or self.eos, self.scores[i])
        # whether a row leaves is read once: a cancel from another thread (batching.Job.cancel) may land between
        # two reads, and a row must not leave without its end (Row.end: what its request is answered by)
        leaving = [row.done for row in self.rows]
        ended = [row for row, left in zip(self.rows, leaving) if left]
        for row in ended:
            row.end(self.tokenizer)
        staying = [i for i, left in enumerate(leaving) if not left]
        full = [i for i in staying if int(self.window[i]) >= self.context]
        going = [i for i in staying if i not in full]
        sliding = [self.rows[i] for i in full]
        order = self._keep(going)
        if going:
            self._feed(torch.tensor([tokens[i] for i in order])[:, None], self._admitted())
        else:
            self.join(self._admitted())
        if sliding:
            kept = window_kept(self.context)
            self._encode(sliding, [row.ids()[0, -kept:] for row in sliding])
        return ended

    def run(self) -> None:
        """Every row stepped until it ends."""
        while self.rows:
            self.step()

    def close(self) -> None:
        """Every row let go, the cache freed."""
        self._keep([])
        self.joining = []

    def _admitted(self) -> list[Row]:
        rows, self.joining = self.joining, []
        return rows

    def _encode(self, rows: list[Row], inputs: list[torch.Tensor], score: bool = False) -> None:
        prompt = self._prompts(inputs, rows, None if score else self.cache_dtype)
        ids = prompt.ids
        logits, cache = self._forward(prompt, every=score)
        if score:  # all of the prompt's logits made (logits_to_keep=0) only for its scores
            for row, given, row_logits in zip(rows, inputs, logits):
                row.prompt_scored = scored(row_logits[ids.shape[1] - len(given):-1], given[1:], row.settings.logprobs)
            if self.cache_dtype is not None:  # the forward's cache in the engine's dtype, as the others' is
                cache = new_cache([(layer.keys, layer.values) for layer in cache.layers], self.cache_dtype)
        self._add(rows, prompt._replace(cache=cache), logits[:, -1])

    def _prompts(self, inputs: list[torch.Tensor], rows: list[Row], dtype: torch.dtype | None) -> stepping.Part:
        """`rows`' prompts (`inputs`, token ids) as a step takes them: padded on the left to the longest, each
        row's positions its own, after a prefix's virtual tokens (whose cache they start from), their cache in
        `dtype` (None: the activations')."""
        width = max(len(ids) for ids in inputs)
        ids = torch.stack([F.pad(r, (width - len(r), 0), value=self.pad) for r in inputs])
        mask = torch.stack([F.pad(torch.ones_like(r), (width - len(r), 0)) for r in inputs])
        positions = (mask.cumsum(1) - 1).clamp(min=0) + self.virtual
        cache = self.prefix.cache(len(inputs), dtype) if self.prefix is not None else new_cache([], dtype)
        if self.prefix is not None:
            mask = torch.cat((torch.ones(len(inputs), self.virtual, dtype=mask.dtype), mask), dim=1)
        return stepping.Part(ids, positions, mask, cache, _alone(rows))

    def _add(self, rows: list[Row], prompt: stepping.Part, scores: torch.Tensor) -> None:
        """Rows whose prompts were encoded (`prompt`, its cache written) beside the running ones."""
        positions, mask, cache = prompt.positions, prompt.mask, prompt.cache
        window = mask[:, self.virtual:].sum(1)
        following = positions[:, -1] + 1  # each row's next token's position
        if self.cache is None:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            self.scores, self.window, self.positions = scores, window, following
        else:
            for layer, theirs in zip(self.cache.layers, cache.layers):
                layer.join(theirs)
            width = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat((_left_pad(self.mask, width), _left_pad(mask, width)))
            self.rows += rows
            self.scores, self.window = torch.cat((self.scores, scores)), torch.cat((self.window, window))
            self.positions = torch.cat((self.positions, following))
        self._expect()

    def _expect(self) -> None:
        """The cache told what the rows present may still add, within the context (kv_cache.Slots.expect: the room
        of the next buffer it makes)."""
        more = min(self.context, max(row.settings.max_new - len(row.tokens) for row in self.rows))
        for layer in self.cache.layers:
            if getattr(layer, "slots", None) is not None:
                layer.slots.expect(more)

    def _feed(self, tokens: torch.Tensor, joining: list[Row]) -> None:
        """The running rows fed `tokens` (rows, 1); `joining`'s prompts computed beside them, then joined."""
        self.mask = torch.cat((self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype)), dim=1)
        if joining:
            prompt = self._prompts([row.prompt[-self.context:] for row in joining], joining, self.cache_dtype)
            self.scores, scores = self._together([stepping.Part(tokens, self.positions[:, None], self.mask,
                                                                self.cache, _alone(self.rows)), prompt])
        else:
            logits, self.cache = self._forward(stepping.Part(tokens, self.positions[:, None], self.mask, self.cache,
                                                             _alone(self.rows)))
            self.scores = logits[:, -1]
        self.positions, self.window = self.positions + 1, self.window + 1
        if joining:
            self._add(joining, prompt, scores)
            self._end_asking_none(joining)

    def _together(self, parts: list[stepping.Part]) -> list[torch.Tensor]:
        """Each part's last logits (rows, vocabulary; fp32, on the CPU), the parts in one stepping pass."""
        device = _device(self.model)
        with torch.inference_mode():
            logits = self.stepper.together([p._replace(ids=p.ids.to(device), positions=p.positions.to(device))
                                            for p in parts])
        return [part_logits.float().cpu()[:, -1] for part_logits in logits]

    def _end_asking_none(self, rows: list[Row]) -> None:
        """Rows asking no new token end (and leave at the next step)."""
        for row in rows:
            if row.settings.max_new == 0:
                row.end(self.tokenizer)

    def _forward(self, part: stepping.Part, every: bool = False) -> tuple[torch.Tensor, Any]:
        """The logits (fp32, on the CPU) of the last position, or of every position where `every`; the cache.
        The stepping decoder computes them where it has one and only the last position's are asked for (a step,
        a prompt): a text's prompt and steps in one arithmetic, alone or beside others (stepping.py)."""
        device = _device(self.model)
        ids, positions, mask, cache = part.ids, part.positions, part.mask, part.cache
        with torch.inference_mode():
            if not every and self.stepper is not None:
                logits = self.stepper(ids.to(device), positions.to(device), mask, cache, part.alone)
            else:
                out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 position_ids=positions.to(device), use_cache=True, logits_to_keep=0 if every else 1,
                                 **{self.cache_keyword: cache})
                logits, cache = out.logits, _compat.cache_of(out)
        return logits.float().cpu(), cache

    def _keep(self, indices: list[int]) -> list[int]:
        """Only the rows at `indices` go on, in the order returned (kv_cache.Slots: a row leaving, the last row
        moves into its slot); padding no row needs any more is cut off."""
        if len(indices) == len(self.rows):
            return indices
        if not indices:
            self.rows, self.cache, self.mask, self.positions, self.scores, self.window = [], None, None, None, None, None
            return []
        order = refilled(indices)
        index = torch.tensor(order)
        self.rows = [self.rows[i] for i in order]
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.scores, self.window = self.scores[index], self.window[index]
        cut = int(self.mask.any(0).nonzero()[0])
        self.mask = self.mask[:, cut:]
        for layer in self.cache.layers:
            layer.keep(order, cut)
        return order


def _alone(rows: list[Row]) -> list[int]:
    """The rows whose attention is computed alone in the form of seeded texts (their text must be the same beside
    any others: sampling.RowSettings.repeatable)."""
    return [i for i, row in enumerate(rows) if row.settings.repeatable]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations are in (an int8 view keeps fp32 embeddings; a 16-bit base computed in fp32
    on a CPU without native bf16 has bf16 ones and fp32 activations): the prefix's keys must be theirs."""
    return activation_dtype(model)


def _layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer of a cache, or of a tuple of them as older peft gives prefix tuning's."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(keys, values) for keys, values in cache]


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`tensor` padded with zeros on the left of `dim` to `width`."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [missing, 0]
    return F.pad(tensor, pad)
