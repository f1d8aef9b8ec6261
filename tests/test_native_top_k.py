"""Sampling's top-k on our own kernel (native_top_k.py, top_k.c) against torch's topk and against each row's
own pick alone: the same values, the same set of ids wherever the k-th value is not tied past it, the same
draws."""

import pytest
import torch

from lowmem_aitextgen.generation.sampling import Row, RowSettings, next_tokens
from lowmem_aitextgen.native import native, native_top_k

built = pytest.mark.skipif(native.built() is None, reason="our kernels need gcc on x86-64 Linux with AVX2")


def logits(rows: int, n: int, seed: int) -> torch.Tensor:
    """Rows of logits as a model gives them, with what sampling adds: barred tokens (-inf), equal values, and a
    row of fewer possible tokens than k."""
    generator = torch.Generator().manual_seed(seed)
    made = torch.randn(rows, n, generator=generator) * 4
    made[:, 7::97] = -torch.inf
    made[0] = (made[0] * 2).round() / 2  # many equal values, the largest among them
    made[-1, 3:] = -torch.inf
    return made


@built
@pytest.mark.parametrize("n", [50257, 300, 9])
def test_the_k_largest_are_torchs_values_and_the_ids_of_them(n):
    """Every k from one to the whole row: torch's values exactly; ids distinct, each the id of its value; the
    same set of ids as torch's where the k-th value is not tied with the next (as sampling uses them); a row's
    result its own alone or beside others."""
    rows = logits(5, n, seed=n)
    for k in sorted({1, 5, 8, 51, 300, n} & set(range(1, n + 1))):
        values, ids = native_top_k.largest(rows, k)
        expected_values, expected_ids = rows.topk(k)
        assert torch.equal(values, expected_values), k
        assert torch.equal(rows.gather(1, ids), values) and all(len(set(r)) == k for r in ids.tolist())
        for row in range(5):
            untied = k == n or rows[row].topk(k + 1).values[k] != values[row, k - 1]
            if untied:
                assert set(ids[row].tolist()) == set(expected_ids[row].tolist()), (k, row)
            alone = native_top_k.largest(rows[row:row + 1], k)
            assert torch.equal(alone[0][0], values[row]) and torch.equal(alone[1][0], ids[row])


@built
def test_a_row_holding_nan_and_what_the_kernel_does_not_take_are_torchs_topk(monkeypatch):
    rows = logits(3, 1000, seed=1)
    rows[1, 500] = float("nan")  # torch's topk takes NaN as the largest
    for given in (rows, rows.double(), rows[:, ::2]):
        values, ids = native_top_k.largest(given, 4)
        expected = given.topk(4)
        torch.testing.assert_close(values, expected.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ids, expected.indices)
    monkeypatch.setattr(native, "built", lambda: None)  # as a machine without gcc
    assert torch.equal(native_top_k.largest(rows[::2], 4)[0], rows[::2].topk(4).values)


@pytest.mark.parametrize("kernel", ["ours", "torch's"])
def test_rows_adding_top_k_draw_what_each_draws_alone_though_their_logits_tie(kernel, monkeypatch):
    """Logits in steps of a quarter, temperatures that make more of them equal, a row's end-of-text barred: the
    rows picked together (top-k taken before the division) draw, step after step, what each draws alone (the
    whole row divided, then its top-k), and leave the scores given as they were; on our kernel and on torch's."""
    if kernel == "torch's":
        monkeypatch.setattr(native, "built", lambda: None)
    elif native.built() is None:
        pytest.skip("our kernels need gcc on x86-64 Linux with AVX2")
    settings = [RowSettings(max_new=50, temperature=t, seed=s, top_k=k, min_new=m)
                for s, (t, k, m) in enumerate([(0.3, 50, 0), (0.7, 50, 9), (1.3, 5, 0), (0.9, 50, 0), (0.1, 50, 0),
                                               (2.0, 1, 0)])]
    prompt = torch.tensor([1, 2, 3])
    together, alone = [Row(prompt, s) for s in settings], [Row(prompt, s) for s in settings]
    generator = torch.Generator().manual_seed(2)
    tied = 0
    for _ in range(30):
        scores = (torch.randn(len(settings), 2000, generator=generator) * 12).round() / 4
        tied += sum(int(row.topk(51).values[50] == row.topk(51).values[49]) for row in scores)
        given = scores.clone()
        picked = next_tokens(together, scores, (3, 5))
        assert torch.equal(scores, given)  # the caller's scores as they were (row 1's end-of-text barred in a copy)
        assert picked == [row.next_token(scores[i].clone(), (3, 5)) for i, row in enumerate(alone)]
        for rows in (together, alone):
            for row, token in zip(rows, picked):
                row.tokens.append(token)
    assert tied > 0 and len({token for row in together for token in row.tokens}) > 30


@pytest.mark.edges  # (transformers' TopK warper, at the oldest too)
@pytest.mark.parametrize("kernel", ["ours", "torch's"])
def test_a_rows_top_k_draw_picks_what_transformers_warpers_and_a_whole_vocabulary_draw_pick(kernel, monkeypatch):
    """A row adding top_k (its end-of-text barred while short of min_new) draws, uniform number by uniform number of
    its stream, the token transformers' temperature and TopK warper and a softmax over GPT-2's whole vocabulary give
    the inverse CDF in the order of the ids; on our kernel (one call) and on torch's."""
    from transformers import TopKLogitsWarper

    from lowmem_aitextgen.generation.sampling import _draw

    if kernel == "torch's":
        monkeypatch.setattr(native, "built", lambda: None)
    elif native.built() is None:
        pytest.skip("our kernels need gcc on x86-64 Linux with AVX2")
    answered = []
    draws = native_top_k.draws
    monkeypatch.setattr(native_top_k, "draws", lambda *args: answered.append(draws(*args)) or answered[-1])
    scores = torch.randn(50257, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, k, min_new in [(0.7, 50, 0), (1.3, 5, 400), (1.0, 1, 0)]:
        row = Row(torch.tensor([1]), RowSettings(max_new=500, temperature=temperature, top_k=k, min_new=min_new,
                                                 seed=k))
        logits = scores.clone()
        if min_new:
            logits[[int(scores.argmax())]] = -torch.inf  # the likeliest token its end-of-text here
        truth = TopKLogitsWarper(k)(None, (logits / temperature)[None])[0].softmax(-1)
        theirs = torch.Generator().manual_seed(k)
        eos = (int(scores.argmax()),)
        picks = [row.next_token(scores, eos) for _ in range(300)]
        assert picks == [_draw(truth, theirs) for _ in range(300)]
        assert len(set(picks)) == min(k, 300) or len(set(picks)) > 20
    assert all(answer is None for answer in answered) if kernel == "torch's" else all(answered)


@built
def test_a_row_holding_nan_beside_others_leaves_their_draws_their_own():
    """A row our kernel refuses (NaN) is drawn on torch's with its own uniform number; the rows beside it draw on
    ours what they draw alone."""
    settings = [RowSettings(max_new=5, temperature=0.8, top_k=20, seed=s) for s in range(3)]
    scores = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 3
    scores[1, 17] = float("nan")
    together = next_tokens([Row(torch.tensor([1]), s) for s in settings], scores, ())
    alone = [Row(torch.tensor([1]), s).next_token(scores[i], ()) for i, s in enumerate(settings)]
    assert together == alone


def test_greedy_rows_beside_rows_adding_top_k_never_pick_a_barred_end_of_text():
    """Greedy rows (temperature 0) keep generate()'s default top_k: while short of min_new their end-of-text, the
    likeliest token here, is barred together as alone."""
    scores = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    scores[:, 7] = 50.0  # end-of-text the likeliest
    settings = [RowSettings(max_new=5, temperature=t, top_k=50, min_new=m, seed=0) for t, m in
                [(0, 3), (0.8, 3), (0, 0)]]
    together = next_tokens([Row(torch.tensor([1]), s) for s in settings], scores, (7,))
    alone = [Row(torch.tensor([1]), s).next_token(scores[i], (7,)) for i, s in enumerate(settings)]
    assert together == alone and together[0] != 7 and together[1] != 7 and together[2] == 7
