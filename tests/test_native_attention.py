"""Our one-token attention kernel (native_attention.py, one_token_attention.c) against the exact attention, and
a row's bits its own alone, beside any rows and at any number of threads."""

import pytest
import torch
from torch.nn import functional as F

from lowmem_aitextgen.native import native, native_attention

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="our attention kernel needs AVX512F and gcc")


def cache(rows: int, heads: int, width: int, size: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Keys and values (rows, heads, width, size) as the engine's cache holds them: views into buffers with room,
    and a query (rows, heads, 1, size) as GPT-2's one projection gives it (a view of the query, key and value)."""
    generator = torch.Generator().manual_seed(seed)
    buffers = torch.randn(2, rows + 1, heads, width + 9, size, generator=generator).to(dtype)
    keys, values = buffers[0, :rows, :, 4:width + 4], buffers[1, :rows, :, 4:width + 4]
    qkv = torch.randn(rows, 1, 3, heads, size, generator=generator) * 3
    return qkv.permute(2, 0, 3, 1, 4)[0], keys, values


def exact(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, places: list[int], window: int | None,
          scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Each row's attention over its last min(places, window) places by torch, in `dtype` (rows, heads x size)."""
    rows = []
    for row, n in enumerate(places):
        n = n if window is None else min(n, window)
        got = F.scaled_dot_product_attention(*(t[row:row + 1].to(dtype) for t in (query, keys[:, :, -n:],
                                                                                   values[:, :, -n:])), scale=scale)
        rows.append(got.transpose(1, 2).reshape(1, -1))
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [16, 64, 256])
def test_each_rows_attention_is_the_exact_one_to_float_precision(dtype, query_dtype, size):
    """Rows of 1 to 1,100 places (past the flash kernel's block of 512, across every remainder of 16 and 8), a
    window, a cache and a query in fp32 or bf16 (widened exactly): as near float64's attention of the same numbers
    as torch's own in fp32 is, to a small factor (its largest error times 4: the exponentials here are within 2
    ulp, and scores of ~20 carry ~2e-6 of rounding)."""
    places = [1, 7, 8, 9, 16, 17, 33, 100, 511, 1100]
    query, keys, values = cache(len(places), 3, max(places), size, dtype, seed=size)
    query = query.to(query_dtype)
    for window in (None, 12):
        got = native_attention.attend(query, keys, values, torch.tensor(places, dtype=torch.int32), window, 0.3)
        expected = exact(query, keys, values, places, window, 0.3)
        torchs = exact(query.float(), keys.float(), values.float(), places, window, 0.3, torch.float32)
        assert got.dtype == torch.float32 and got.shape == (len(places), 3 * size)
        error, torchs_error = (float((t.double() - expected).abs().max()) for t in (got, torchs))
        assert error <= 4 * torchs_error, (error, torchs_error)


def test_scores_far_below_the_largest_add_nothing_and_none_overflows():
    """Scores spanning thousands (a row whose largest score dwarfs the rest; exp_of's reach is [-87, 88]): the
    output is the largest place's value, with no NaN or infinity."""
    query, keys, values = cache(1, 2, 40, 64, torch.float32, seed=1)
    keys[0, :, 5] = query[0, :, 0] * 50  # a score of ~50 x |q|^2 x scale at place 5, far above the others
    got = native_attention.attend(query, keys, values, torch.tensor([40], dtype=torch.int32), None, 1.0)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.view(2, 64), values[0, :, 5], atol=1e-6)


def test_a_rows_bits_are_its_own_alone_beside_any_rows_and_at_any_number_of_threads():
    places = [5, 300, 17, 64, 1]
    query, keys, values = cache(len(places), 4, 300, 64, torch.bfloat16, seed=2)
    counts = torch.tensor(places, dtype=torch.int32)
    together = native_attention.attend(query, keys, values, counts, None, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(native_attention.attend(query, keys, values, counts, None, 0.125), together)
    finally:
        torch.set_num_threads(threads)
    for row, n in enumerate(places):  # alone: a cache of its own places only, no room, no other rows
        mine = [t[row:row + 1, :, -n:].contiguous() for t in (keys, values)]
        alone = native_attention.attend(query[row:row + 1], *mine, torch.tensor([n], dtype=torch.int32), None, 0.125)
        assert torch.equal(alone[0], together[row]), row


def test_a_row_of_no_places_is_zeros_and_a_wrong_call_is_refused_before_any_work():
    query, keys, values = cache(3, 2, 10, 16, torch.float32, seed=3)
    for _ in range(3):  # (the output's memory is not zeroed before: the kernel writes the zeros)
        got = native_attention.attend(query, keys, values, torch.tensor([4, 0, 10], dtype=torch.int32), None, 1.0)
        assert torch.equal(got[1], torch.zeros(32)) and got[0].abs().sum() > 0
        torch.randn(3, 32)
    for wrong in (11, -1):
        with pytest.raises(ValueError, match="within the cache.s 10"):
            native_attention.attend(query, keys, values, torch.tensor([4, wrong, 10], dtype=torch.int32), None, 1.0)
    with pytest.raises(ValueError, match="int32 places"):
        native_attention.attend(query, keys, values, torch.tensor([4, 1, 10]), None, 1.0)
    for wrong in (dict(values=values.contiguous()), dict(query=query.expand(3, 2, 2, 16)), dict(keys=keys[:2])):
        given = dict(query=query, keys=keys, values=values) | wrong
        with pytest.raises(ValueError, match="one layout"):
            native_attention.attend(**given, places=torch.tensor([4, 1, 10], dtype=torch.int32), window=None,
                                    scale=1.0)


def test_it_takes_what_it_computes_and_leaves_the_rest_to_torch(monkeypatch):
    query, keys, _ = cache(2, 2, 8, 64, torch.bfloat16, seed=4)
    assert native_attention.takes(query, keys)
    assert not native_attention.takes(query.half(), keys) and not native_attention.takes(query, keys.half())
    narrow, keys8, _ = cache(2, 2, 8, 8, torch.float32, seed=4)
    assert not native_attention.takes(narrow, keys8)  # a head size not a multiple of 16
    monkeypatch.setattr(native, "built", lambda: None)  # as a machine without gcc
    assert not native_attention.available() and not native_attention.takes(query, keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_a_steps_keys_and_values_are_written_as_torchs_copy_writes_them(dtype, query_dtype):
    """attend's `new`: each row's new key and value written at its last place first (as torch's copy converts them:
    to bf16 to nearest, ties to even), then attended over: the output of the cache torch wrote."""
    places = [7, 3, 10]
    query, keys, values = cache(3, 2, 10, 32, dtype, seed=5)
    generator = torch.Generator().manual_seed(6)
    qkv = (torch.randn(3, 1, 3, 2, 32, generator=generator) * 4).to(query_dtype)
    bits = qkv.view(-1).float().view(torch.int32)
    qkv.view(-1)[:12] = (bits[:12] & ~0xFFFF | 0x8000).view(torch.float32).to(query_dtype)  # ties, fp32's
    qkv[0, 0, 1, 0, 0] = float("nan")
    query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind()
    theirs = [t.clone() for t in (keys, values)]
    theirs[0][:, :, -1:] = key
    theirs[1][:, :, -1:] = value
    counts = torch.tensor(places, dtype=torch.int32)
    got = native_attention.attend(query, keys, values, counts, None, 0.2, new=(key, value))
    assert torch.equal(keys[1:], theirs[0][1:]) and torch.equal(values, theirs[1])
    assert torch.isnan(keys[0, 0, -1, 0]) and torch.equal(keys[0, 1:], theirs[0][0, 1:])
    expected = native_attention.attend(query[1:], theirs[0][1:], theirs[1][1:], counts[1:], None, 0.2)
    assert torch.equal(got[1:], expected)
    with pytest.raises(ValueError, match="new keys and values"):
        native_attention.attend(query, keys, values, counts, None, 0.2, new=(key.float().clone(), value))
