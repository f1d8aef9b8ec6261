"""The batch engine's key-value cache: each layer's keys and values for the rows decoding, held in buffers with
room, so that a step, a row joining and a row leaving each write only what changed.

transformers' DynamicCache concatenates each step's keys to the layer's (a copy of every row's whole cache,
each layer, each step), and a batch that rows join and leave (engine.py) was cut and put side by side by
indexing and concatenating the whole cache again.  With 16 rows coming and going in a server, those copies
were a fifth of its time (HISTORY.md, "Serving and decoding").  Here a layer's keys and values are views into
two buffers (`Slots`):

| event          | what is written                                                                      |
|----------------|--------------------------------------------------------------------------------------|
| a step         | the new places, after the last, in the buffer's room: ROOM places, or what the rows  |
|                | present may still add where the engine says (`expect`: their max_new), so that a long|
|                | text is not copied to a new buffer every ROOM steps (16 rows of 512 tokens: those    |
|                | copies were 6-9% of a step, RESULTS.md); a full buffer moves the rows to a new one   |
| memory follows | every ROOM steps, where the buffer holds rows gone or ROOM places no row needs, the  |
| the rows       | rows move to a new buffer that keeps only the rows present and their places (room    |
|                | never written is not resident: the system maps a page at its first write)            |
| rows leave     | each of the last rows kept moves into a slot left free (one row's places each);      |
|                | places no row needs any more are dropped from the view's left                        |
| rows join      | their places into the slots after the running rows (a new buffer only where the rows |
|                | or a longer prompt do not fit), right-aligned as the running rows are                |
| padding        | what the cache adds before a row's own places is zeros, as F.pad made it: the        |
|                | attention mask hides it, and a slot reused never shows its former row's values       |
| after the last | PAD places of zeros after every row's last, rewritten as places are added: a         |
|                | repeatable row's one-token attention reads up to PAD of them, masked                 |
|                | (row_attention.py; the buffers are not zeroed, and masked garbage could be NaN)      |

The buffers' dtype is the keys' unless the engine names one (decoding.cache_dtype decides it): an int8 view
computes in fp32, and at long texts its steps are bound by reading the cache, not the int8 weights (355M, 8
rows, ~520 places: attention half of a compiled step; HISTORY.md, nineteenth session).  The stepping decoder's
one-token attention reads a bf16 cache widened to fp32 on our kernel (native_attention.py), and elsewhere attends
in the cache's dtype, the output back in fp32 (stepping.py):

| an int8 view's cache | bytes a place | attention kernel (8 rows, 355M's heads) | quality (kv_quality.py)             |
|----------------------|---------------|-----------------------------------------|-------------------------------------|
| fp32 (no native bf16)| 4             | 1x                                      | the int8 form's own                 |
| bf16 (native bf16)   | 2             | ~2x quicker where the CPU computes bf16 | held-out loss unchanged; the worst  |
|                      |               | natively (emulated elsewhere: slower)   | place's KL from the forward 0.0056  |
|                      |               |                                         | on our kernel (0.012 on torch's)    |
| fp16 (not taken)     | 2             | no quicker than fp32 on such a CPU      | within the int8 form's own          |
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

ROOM = 64  # places a buffer gets past what it holds at least; steps between the moves that free rows gone
PAD = 3  # zeros kept after each row's last place (module docstring)
ZEROED = 16  # places zeroed at once after the last: a write every 13 steps


class Slots:
    """One layer's keys and values (rows, heads, places, head size): the views [:rows, :, start:end] of two
    buffers with room for more places (and, after rows left, more rows).  Each row's places end at `end`; those
    the cache pads it with are zeros."""

    @torch.inference_mode()  # the buffers are inference tensors, written only in inference mode
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self.rows, self.start, self.end = keys.shape[0], 0, 0
        self.reach = 0  # places the rows present may still add (expect): a new buffer's room past theirs
        self.moved_at = 0  # `end` when the buffers were made
        self._hold(_buffers(keys, dtype or keys.dtype, keys.shape[0], keys.shape[-2] + ROOM))  # (dtype: docstring)
        self.zeroed = 0  # the rows' places are zeros from `end` up to here
        self.append(keys, values)

    def views(self, after: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values, with `after` (at most PAD) of the zeros after their last places."""
        keys, values = self.buffers
        end = self.end + after
        return keys[:self.rows, :, self.start:end], values[:self.rows, :, self.start:end]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`keys` and `values` (rows, heads, new places) after each row's own."""
        if not torch.is_inference_mode_enabled():  # (a step is in inference mode: entering it again costs ~2 us)
            with torch.inference_mode():
                return self.append(keys, values)
        added = keys.shape[-2]
        self.make_room(added)
        for buffer, new in zip(self.buffers, (keys, values)):
            buffer[:self.rows, :, self.end:self.end + added] = new
        self.added(added)

    def make_room(self, added: int) -> None:
        """Room for `added` places after each row's last (a move where there is none, or where it frees memory), for
        the caller to write at `views(added)`'s last places, then to count by `added`."""
        if self.end + added + PAD > self.buffers[0].shape[-2] or self._frees_memory():
            self._move(self.rows, self.end - self.start, added)

    def added(self, added: int) -> None:
        """`added` places written after each row's last (make_room's)."""
        self.end += added
        self.reach = max(0, self.reach - added)
        self._zeros_after()

    def expect(self, places: int) -> None:
        """The rows present may add up to `places` more places: the next buffer made keeps room for what is left of
        them (not a move now: rows joining one at a time would each move every row's places)."""
        self.reach = places

    def _frees_memory(self) -> bool:
        """Whether a move now gives memory back: ROOM places added since the buffer was made, and it holds slots
        of rows gone or ROOM places no row needs (module docstring: memory follows the rows)."""
        return self.end - self.moved_at >= ROOM and (self.rows < self.buffers[0].shape[0] or self.start >= ROOM)

    @torch.inference_mode()
    def keep(self, order: list[int], cut: int) -> None:
        """Only the rows `order` names go on, row i the one that was at slot order[i]; each slot moved from
        must not be kept where it is (`refilled`'s order); the first `cut` places are dropped."""
        self.start += cut
        for slot, row in enumerate(order):
            if row != slot:
                for buffer in self.buffers:
                    buffer[slot, :, self.start:self.end] = buffer[row, :, self.start:self.end]
        self.rows = len(order)

    @torch.inference_mode()
    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New rows' `keys` and `values` after the running rows', their places ending where theirs end; the
        shorter padded on the left with zeros."""
        rows, places = self.rows + keys.shape[0], keys.shape[-2]
        width = max(self.end - self.start, places)
        if rows > self.buffers[0].shape[0] or width > self.end:
            self._move(rows, width)
        start = self.end - width
        for buffer, new in zip(self.buffers, (keys, values)):
            buffer[:self.rows, :, start:self.start] = 0  # the running rows' new padding
            buffer[self.rows:rows, :, start:self.end - places] = 0
            buffer[self.rows:rows, :, self.end - places:self.end] = new
        self.both[:, self.rows:rows, :, self.end:self.zeroed] = 0  # as the running rows' after theirs
        self.rows, self.start = rows, start
        self._zeros_after()

    def _move(self, rows: int, width: int, adding: int = 0) -> None:
        """Into new buffers for `rows` rows and `width` places and room (ROOM, or what the rows may still add, and at
        least the `adding` places the caller writes next: a prompt after a prefix's virtual tokens, a slid window,
        of any length), the rows held ending at `width`."""
        held = self.end - self.start
        room = max(ROOM, self.reach + PAD, adding + PAD)
        both = _buffers(self.buffers[0], self.both.dtype, rows, width + room)
        for buffer, old in zip(both.unbind(), self.views()):
            buffer[:self.rows, :, width - held:width] = old
        self._hold(both)
        self.start, self.end = width - held, width
        self.zeroed = self.moved_at = width
        self._zeros_after()

    def _hold(self, both: torch.Tensor) -> None:
        """The rows' places held in `both` (keys, values) from now on."""
        self.both, self.buffers, self._addresses = both, both.unbind(), None

    def addresses(self) -> tuple[int, int, tuple[int, int, int], int]:
        """The keys' and the values' buffers' addresses, their strides (rows, heads, places; in elements) and the
        size of an element: for a kernel writing them (native_block.steps), made once a buffer."""
        if self._addresses is None:
            keys, values = self.buffers
            self._addresses = (keys.data_ptr(), values.data_ptr(), keys.stride()[:3], keys.element_size())
        return self._addresses

    def _zeros_after(self) -> None:
        """At least PAD places of zeros after the rows' last, written ZEROED places at a time (a write a step cost
        ~3 us a layer)."""
        if self.end + PAD > self.zeroed:
            self.zeroed = min(self.end + ZEROED, self.both.shape[-2])
            self.both[:, :self.rows, :, self.end:self.zeroed] = 0  # keys' and values' in one write


def refilled(kept: list[int]) -> list[int]:
    """The order of the rows `kept` (their slots, ascending) once the others have gone, as Slots.keep takes it:
    each kept row stays in its slot, except the last ones, which move into the slots left free below them (a row
    copied for each row gone, not every row after it)."""
    staying = {i for i in kept if i < len(kept)}
    order = [i if i in staying else -1 for i in range(len(kept))]
    free = (slot for slot, row in enumerate(order) if row < 0)
    for row in kept[len(staying):]:
        order[next(free)] = row
    return order


def _buffers(keys: torch.Tensor, dtype: torch.dtype, rows: int, places: int) -> torch.Tensor:
    """Buffers in `dtype` for keys like `keys` and their values (one tensor: keys, values), for `rows` rows and
    `places` places; not zeroed: a view holds only places written (a row's own, the zeros join writes as its
    padding, the PAD zeros after), and a new buffer's memory is the system's until written (zeroing a 16-row
    buffer's room touched every page of it: most of a join's time, RESULTS.md)."""
    return keys.new_empty(2, rows, keys.shape[1], places, keys.shape[-1], dtype=dtype)


class _SlotViews:
    """What slot_layer's class adds to transformers' DynamicLayer (it comes first in the class's order, so that its
    keys and values are the slots' views)."""

    slots: Slots | None = None
    slot_dtype: torch.dtype | None = None  # the views' dtype (None: the keys' own)
    # keys and values: the slots' views, made again where read after the slots changed (`_stale`), not at each
    # change (a step's 24 layers' views cost ~0.15 ms a token, read by no one in a step of the stepping decoder);
    # a tensor transformers' own methods set is kept as set
    _held: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    _stale = False

    @property
    def keys(self) -> torch.Tensor | None:
        return self._current()[0]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._held = (tensor, self._current()[1])

    @property
    def values(self) -> torch.Tensor | None:
        return self._current()[1]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._held = (self._current()[0], tensor)

    def _current(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._stale:
            self._held, self._stale = self.slots.views(), False
        return self._held

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.slots is None:
            self.slots = Slots(key_states, value_states, self.slot_dtype)
        else:
            self.slots.append(key_states, value_states)
        self._stale = True
        return self._current()

    def written(self, places: int, write: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        """What `write(keys, values)` returns, given the views with room for `places` more places at their end,
        which it writes (the stepping decoder's one-token attention appends a step's keys itself)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.written(places, write)
        done = write(*self.room(places).views(places))
        self.wrote(places)
        return done

    def room(self, places: int) -> Slots:
        """The slots, with room for `places` more places after the rows' last, for the caller to write (in
        inference mode) and count by `wrote`."""
        self.slots.make_room(places)
        return self.slots

    def wrote(self, places: int) -> None:
        """`places` places written after the rows' last (`room`'s)."""
        self.slots.added(places)
        self._stale = True

    def keep(self, order: list[int], cut: int) -> None:
        self.slots.keep(order, cut)
        self._stale = True

    def join(self, other: Any) -> None:
        self.slots.join(other.keys, other.values)
        self._stale = True


@functools.cache
def slot_layer(dtype: torch.dtype | None = None) -> type:
    """transformers' DynamicLayer whose keys and values are a `Slots`' views in `dtype` (None: the keys' own): a
    step writes its places in place (transformers' forward and stepping.py's decoder both call `update`); `keep`
    and `join` are the engine's."""
    from transformers.cache_utils import DynamicLayer  # (transformers imported where a cache is first made)

    return type("SlotLayer", (_SlotViews, DynamicLayer), {"slot_dtype": dtype})


def new_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype | None = None) -> Any:
    """transformers' DynamicCache of slot layers holding `layers` (keys, values) each (none: the model writes
    them as it first runs), in `dtype` (None: the keys' own; only the stepping decoder reads another)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = slot_layer(dtype)  # the layers made as the model first writes each
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return cache
