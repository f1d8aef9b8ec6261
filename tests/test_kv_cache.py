"""The engine's key-value cache (kv_cache.Slots) against what it stands for: each row's own keys and values, one
after the other, right-aligned with the other rows' and padded on the left with zeros."""

from __future__ import annotations

import random

import pytest
import torch

from lowmem_aitextgen.generation import kv_cache
from lowmem_aitextgen.generation.kv_cache import refilled

HEADS, SIZE = 2, 3


def places(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.randn(rows, HEADS, length, SIZE)
    return keys, keys + 100  # values told from keys


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows' places (heads, length, size each) right-aligned, zeros on the left: what the views must hold."""
    width = max(row.shape[1] for row in rows)
    return torch.stack([torch.cat((row.new_zeros(HEADS, width - row.shape[1], SIZE), row), 1) for row in rows])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_slots_hold_each_rows_own_places_through_steps_rows_leaving_and_joining_and_moving_buffers(monkeypatch,
                                                                                                   dtype):
    """A long random run of steps, rows leaving (refilled's order, as the engine keeps them, the padding no row
    needs cut) and rows joining with shorter and longer prompts, past ROOM places (new buffers): after each, the
    views are the rows' own keys and values right-aligned, followed by PAD zeros (row_attention.py reads them,
    masked), and a slot reused shows nothing of the row that held it.  New buffers hold NaN where not written,
    as memory reused may.  Held as given, and in bf16 (an int8 view's cache: each value rounded to it)."""
    made = kv_cache._buffers
    monkeypatch.setattr(kv_cache, "_buffers", lambda *args: made(*args).fill_(float("nan")))
    generator = random.Random(0)
    keys, values = places(3, 4)
    slots = kv_cache.Slots(keys, values, dtype)
    truth = [(k, v) for k, v in zip(keys, values)]
    for _ in range(3 * kv_cache.ROOM):
        event = generator.random()
        if event < 0.15 and len(truth) > 1:
            kept = sorted(generator.sample(range(len(truth)), generator.randint(1, len(truth) - 1)))
            order = refilled(kept)
            truth = [truth[i] for i in order]
            width = max(k.shape[1] for k, _ in truth)
            slots.keep(order, slots.end - slots.start - width)
        elif event < 0.3:
            keys, values = places(generator.randint(1, 3), generator.choice((1, 2, 30, 90)))
            slots.join(keys, values)
            truth += list(zip(keys, values))
            slots.expect(generator.choice((0, 10, 200)))  # as the engine says after rows join
        else:
            keys, values = places(len(truth), 1)
            slots.append(keys, values)
            truth = [(torch.cat((k, nk), 1), torch.cat((v, nv), 1)) for (k, v), nk, nv in zip(truth, keys, values)]
        held_keys, held_values = slots.views()
        assert slots.addresses() == (slots.buffers[0].data_ptr(), slots.buffers[1].data_ptr(),
                                     slots.buffers[0].stride()[:3], slots.buffers[0].element_size())
        assert held_keys.dtype == held_values.dtype == (dtype or torch.float32)
        assert torch.equal(held_keys, padded([k for k, _ in truth]).to(held_keys.dtype))
        assert torch.equal(held_values, padded([v for _, v in truth]).to(held_keys.dtype))
        for held, after in zip((held_keys, held_values), slots.views(kv_cache.PAD)):
            assert torch.equal(after, torch.cat((held, held.new_zeros(len(truth), HEADS, kv_cache.PAD, SIZE)), 2))


def test_a_layers_keys_and_values_are_its_slots_views_after_each_change_and_what_transformers_sets_them_to():
    """A slot layer (transformers' DynamicLayer) read after update, a kernel's write (room, wrote), keep and join:
    its keys and values are the slots' views at that moment; a tensor transformers' own methods assign is kept."""
    layer = kv_cache.slot_layer(None)()
    layer.update(*places(2, 3))
    with torch.inference_mode():
        for event in range(2 * kv_cache.ROOM):
            if event % 7 == 3:
                layer.keep([1, 0], 0)
            elif event % 11 == 5:
                other = kv_cache.slot_layer(None)()
                other.update(*places(1, 2))
                layer.join(other)
            elif event % 2:
                layer.update(*places(layer.slots.rows, 1))
            else:
                held = layer.room(1)
                for buffer, new in zip(held.views(1), places(held.rows, 1)):
                    buffer[:, :, -1:] = new
                layer.wrote(1)
            keys, values = layer.slots.views()
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
            assert layer.keys.data_ptr() == keys.data_ptr() and layer.get_seq_length() == keys.shape[-2]
    chosen = layer.keys[:1].clone()
    layer.batch_select_indices(torch.tensor([0]))  # transformers' own: keys and values set to its selection
    assert torch.equal(layer.keys, chosen) and layer.values.shape[0] == 1


def stepped(slots: kv_cache.Slots, steps: int, rows: int) -> int:
    """`steps` places appended to `rows` rows; how many new buffers the slots made meanwhile."""
    made = 0
    for _ in range(steps):
        before = slots.both
        slots.append(*places(rows, 1))
        made += slots.both is not before
    return made


def test_a_buffer_keeps_room_for_what_the_rows_may_still_add():
    """Told the rows may add 300 places, the slots replace their buffer once (when the first one's ROOM is used)
    and not every ROOM places after; told nothing, every ROOM places."""
    told, untold = kv_cache.Slots(*places(2, 4)), kv_cache.Slots(*places(2, 4))
    told.expect(300)
    assert stepped(told, 300, 2) == 1
    assert stepped(untold, 300, 2) >= 300 // kv_cache.ROOM


def test_memory_follows_the_rows_however_much_room_a_buffer_has():
    """With room for hundreds of places, rows gone or places no row needs any more are still given back within
    ROOM places: the next buffer holds only the rows present and their places."""
    slots = kv_cache.Slots(*places(4, 4))
    slots.expect(1000)
    stepped(slots, kv_cache.ROOM, 4)  # the first buffer's room used: a buffer with room for the rest
    slots.keep([0], 0)
    assert stepped(slots, kv_cache.ROOM, 1) == 1 and slots.both.shape[1] == 1
    stepped(slots, kv_cache.ROOM, 1)
    slots.keep([0], slots.end - slots.start - 2)  # all but the last two places dropped
    assert stepped(slots, kv_cache.ROOM, 1) == 1 and slots.start < kv_cache.ROOM


def test_refilled_moves_only_the_last_rows_into_the_slots_left_free():
    assert refilled([0, 1, 2]) == [0, 1, 2]
    assert refilled([0, 2, 3]) == [0, 3, 2]  # row 1 left: the last row moves into its slot
    assert refilled([3, 4]) == [3, 4]
    assert refilled([1, 4]) == [4, 1]
    for kept in ([0, 3, 5, 6], [2, 5, 7], [0]):
        order = refilled(kept)
        assert sorted(order) == kept
        assert all(row == slot or row >= len(kept) for slot, row in enumerate(order))  # no kept row overwritten
