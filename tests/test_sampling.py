"""Rows decoded side by side (sampling.py): each the text it would be alone, with its own settings, stops and
stream; tiny GPT-2s on the CPU."""

import queue
import threading
import time

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.generation import decoding
from lowmem_aitextgen.generation.engine import Engine
from lowmem_aitextgen.generation.sampling import Row, RowSettings
from lowmem_aitextgen.serving.batching import Batcher, Job

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = "the rows' own sampling; what it calls of transformers' generate is test_generation's"


@pytest.fixture(scope="module")
def ai(tmp_path_factory, tokenizer_file):
    folder = tmp_path_factory.mktemp("sampling") / "model"
    torch.manual_seed(0)
    realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=96))).save_pretrained(folder)
    return aitextgen(model_folder=str(folder), tokenizer_file=tokenizer_file)


def decode_together(model, tokenizer, rows: list[Row]) -> None:
    """Every row decoded in one batch by the engine, from the start to the end of the longest."""
    engine = Engine(model, tokenizer, (tokenizer.eos_token_id,))
    engine.join(rows)
    engine.run()


SETTINGS = [RowSettings(max_new=20, temperature=1.0, seed=1),
            RowSettings(max_new=12, temperature=0.7, top_p=0.8, seed=2),
            RowSettings(max_new=25, temperature=1.2, top_k=20, repetition_penalty=1.3, seed=3),
            RowSettings(max_new=15, temperature=0, min_new=15)]
PROMPTS = ["def main", "x", "import os, sys and then", "class Foo(Bar):"]


def rows(ai, on_text=None) -> list[Row]:
    return [Row(ai.tokenizer(text=p, return_tensors="pt")["input_ids"][0], s, on_text)
            for p, s in zip(PROMPTS, SETTINGS)]


@pytest.mark.parametrize("form", ["exact", "int8, each token alone"])
def test_each_row_in_a_batch_is_the_row_decoded_alone(ai, form):
    model = ai.model if form == "exact" else decoding.decoding_model(ai.model, "int8", tokenwise=True)
    together = rows(ai)
    decode_together(model, ai.tokenizer, together)
    for i, row in enumerate(together):
        alone = rows(ai)[i]
        decode_together(model, ai.tokenizer, [alone])
        assert (row.tokens, row.text, row.finish) == (alone.tokens, alone.text, alone.finish), i
    assert [len(r.tokens) for r in together][3] == 15 and together[3].finish == "length"  # min_new: no early end
    assert all(len(r.tokens) <= s.max_new for r, s in zip(together, SETTINGS))


def test_a_stop_string_ends_the_text_before_it_and_no_piece_shows_any_of_it(ai):
    free = Row(ai.tokenizer(text="def", return_tensors="pt")["input_ids"][0], RowSettings(max_new=40, seed=9))
    decode_together(ai.model, ai.tokenizer, [free])
    assert len(free.text) > 10, free.text
    stop = free.text[6:9]
    pieces: list[str] = []
    stopped = Row(free.prompt, RowSettings(max_new=40, seed=9, stop=(stop,)), pieces.append)
    decode_together(ai.model, ai.tokenizer, [stopped])
    assert stopped.text == free.text[:free.text.find(stop)] == "".join(pieces) and stopped.finish == "stop"


def test_a_cancelled_row_stops_and_the_others_go_on(ai):
    batch = rows(ai)
    batch[2].on_text = lambda piece: batch[2].cancelled.set()  # its client leaves at its first piece
    decode_together(ai.model, ai.tokenizer, batch)
    assert batch[2].finish == "cancelled" and len(batch[2].tokens) <= 2
    assert batch[0].finish in ("length", "stop") and batch[0].tokens


def test_the_batcher_decodes_continuously_a_short_request_joining_a_long_one_ends_first(ai):
    """Continuous batching: a request joins the running rows at the next step and is answered when its rows end,
    not when the longest in flight does; its text is the one it gets alone; the queue refuses past its limit."""
    eos = (ai.tokenizer.eos_token_id,)
    finished: list[str] = []
    done = threading.Semaphore(0)

    def job(prompt: str, new: int, name: str) -> Job:
        row = Row(ai.tokenizer(text=prompt, return_tensors="pt")["input_ids"][0],
                  RowSettings(max_new=new, min_new=new, seed=1), None)
        return Job([row], lambda error: (finished.append(name if error is None else repr(error)), done.release()))

    batcher = Batcher(lambda: Engine(decoding.decoding_model(ai.model, "int8", True), ai.tokenizer, eos),
                      max_rows=4, limit=2)
    long, short, third = job("def main", 80, "long"), job("x", 5, "short"), job("y", 5, "third")
    assert batcher.submit(long) and batcher.submit(short) and not batcher.submit(third)  # the queue holds 2
    batcher.cancel(short)  # gone before it joins: its place is free again
    assert batcher.submit(third)
    batcher.start()
    deadline = time.monotonic() + 30
    while batcher.running_rows < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    late = job("class Foo", 6, "late")
    assert batcher.submit(late)  # arrives while the long one decodes
    for _ in range(3):
        assert done.acquire(timeout=60)
    batcher.stop()
    assert finished.index("late") < finished.index("long") and "short" not in finished
    alone = Row(late.rows[0].prompt, late.rows[0].settings)
    decode_together(decoding.decoding_model(ai.model, "int8", True), ai.tokenizer, [alone])
    assert alone.tokens == late.rows[0].tokens  # joined mid-run, the text it gets alone


class LettingGo(Engine):
    """An engine with the fault the batcher must survive: a row of 50 tokens let go unfinished at its third."""

    def step(self) -> list[Row]:
        ended = super().step()
        if self.rows and self.rows[0].settings.max_new == 50 and len(self.rows[0].tokens) == 3:
            self._keep(list(range(1, len(self.rows))))
        return ended


def test_a_request_whose_rows_the_engine_let_go_unfinished_is_answered_with_an_error(ai):
    """Were the engine to let a row go without its end (the fault that kept a server stepping an empty engine for
    ever, its request never answered), the batcher answers that request with an error and goes on."""
    answers: queue.Queue = queue.Queue()

    def job(new: int) -> Job:
        prompt = ai.tokenizer(text="def main", return_tensors="pt")["input_ids"][0]
        return Job([Row(prompt, RowSettings(max_new=new, min_new=new, seed=1))], answers.put)

    batcher = Batcher(lambda: LettingGo(ai.model.eval(), ai.tokenizer, (ai.tokenizer.eos_token_id,)), 4, 4)
    batcher.start()
    try:
        assert batcher.submit(job(50))
        assert isinstance(answers.get(timeout=60), RuntimeError)
        later = job(5)
        assert batcher.submit(later)
        assert answers.get(timeout=60) is None and len(later.rows[0].tokens) == 5  # the next answered as ever
    finally:
        batcher.stop()


def test_a_draw_follows_the_probabilities_and_never_picks_an_impossible_token():
    from lowmem_aitextgen.generation.sampling import _draw

    probabilities = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4])
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([_draw(probabilities, generator) for _ in range(20_000)]), minlength=6)
    assert counts[1] == counts[4] == 0
    assert torch.allclose(counts / 20_000, probabilities, atol=0.015)


def test_rows_picked_together_pick_what_each_picks_alone():
    """next_tokens's rows picked together (plain rows: greedy, temperatures, end-of-text barred before min_new; rows
    that only add top_k, of several k, greedy among them, one tied past its k-th logit at some steps) beside rows picked
    one by one (top-p) and a row done: each row's tokens are those Row.next_token picks for it alone, from the same
    scores and the same stream, step after step."""
    from lowmem_aitextgen.generation.sampling import next_tokens

    settings = [RowSettings(max_new=50, temperature=t, seed=k, min_new=m, top_k=top_k, top_p=top_p)
                for k, (t, m, top_k, top_p) in enumerate([(1.0, 0, 0, 1.0), (0.7, 5, 0, 1.0), (0.0, 3, 0, 1.0),
                                                          (1.3, 0, 0, 1.0), (0.9, 0, 40, 1.0), (1.0, 0, 0, 0.9),
                                                          (0.05, 0, 0, 1.0), (2.5, 8, 0, 1.0), (0.7, 4, 40, 1.0),
                                                          (1.0, 0, 5, 1.0), (0.0, 0, 40, 1.0), (1.3, 0, 1, 1.0),
                                                          (0.7, 0, 299, 1.0), (0.8, 0, 40, 0.9), (0.7, 0, 40, 1.0)])]
    prompt = torch.tensor([1, 2, 3])
    together, alone = [Row(prompt, s) for s in settings], [Row(prompt, s) for s in settings]
    together[3].finish = alone[3].finish = "length"  # a row done: no pick, its stream untouched
    assert [row.plain for row in together] == [True, True, True, True, False, False, True, True] + [False] * 7
    assert [row.only_top_k(300) for row in together] == [False] * 4 + [True, False, False, False] + [True] * 5 + \
        [False, True]
    scores_of = torch.Generator().manual_seed(0)
    for step in range(10):
        scores = torch.randn(len(settings), 300, generator=scores_of) * 4
        if step in (3, 4, 5, 6):  # row 9 (top_k 5): its 20 likeliest tied, every one kept (transformers' warper)
            scores[9, scores[9].argsort(descending=True)[:20]] = scores[9].max()
        picked = next_tokens(together, scores, (7, 9))
        expected = [None if row.done else row.next_token(scores[i].clone(), (7, 9)) for i, row in enumerate(alone)]
        assert picked == expected
        for made, row in zip((together, alone), (picked, expected)):
            for each, token in zip(made, row):
                if token is not None:
                    each.tokens.append(token)
    assert not any(token in (7, 9) for token in together[1].tokens[:5] + together[7].tokens[:8])


@pytest.mark.parametrize("rows", [2, 5, 16])
def test_a_rows_softmax_and_cumulative_sum_are_its_own_bits_beside_others(rows):
    """What next_tokens rests on: torch's softmax over the vocabulary and the float64 cumulative sum give a row
    the same bits alone and beside other rows (each row's own arithmetic), here and on each CPU kind CI runs."""
    scores = torch.randn(rows, 50257, generator=torch.Generator().manual_seed(rows)) * 6
    together = scores.softmax(-1).cumsum(-1, dtype=torch.float64)
    for i in range(rows):
        assert torch.equal(together[i], scores[i].softmax(-1).double().cumsum(0))


@pytest.mark.parametrize("rows", [2, 5, 16])
def test_a_rows_top_k_and_softmax_over_it_are_its_own_bits_beside_others(rows):
    """What next_tokens rests on for rows that only add top_k: torch's topk over the vocabulary gives a row the
    same values and ids alone and beside other rows, and a softmax over the kept the same bits (rows of 50, 51, 5)."""
    scores = torch.randn(rows, 50257, generator=torch.Generator().manual_seed(rows)) * 6
    for k in (50, 5, 1):
        values, ids = scores.topk(k + 1)
        together = values[:, :k].softmax(-1)
        for i in range(rows):
            alone_values, alone_ids = scores[i].topk(k + 1)
            assert torch.equal(values[i], alone_values) and torch.equal(ids[i], alone_ids)
            assert torch.equal(together[i], alone_values[:k].softmax(-1))


def warped(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' own TopK then TopP warpers over the whole vocabulary (1-D logits)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits = logits[None]
    if top_k:
        logits = TopKLogitsWarper(top_k)(None, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(None, logits)
    return logits[0]


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (1, 1.0), (40, 0.9), (1000, 0.5), (0, 0.9), (0, 0.5), (0, 0.99)])
def test_top_k_and_top_p_keep_among_the_likeliest_what_transformers_warpers_keep(top_k, top_p):
    """likeliest_kept against transformers' warpers over GPT-2's whole vocabulary, logits peaked and flatter:
    the same tokens, but for the one at top_p's edge where the two sums of probabilities round apart; None only
    where top_p needs more than the candidates (the row is cut whole then: cutoffs.py)."""
    from lowmem_aitextgen.generation.sampling import CANDIDATES, likeliest_kept

    generator = torch.Generator().manual_seed(top_k)
    for scale in (3.0, 6.0, 12.0):
        logits = torch.randn(50257, generator=generator) * scale
        kept = likeliest_kept(logits, top_k, top_p)
        truth = warped(logits, top_k, top_p)
        if kept is None:
            assert not top_k and int(torch.isfinite(truth).sum()) > CANDIDATES - 2
            continue
        values, ids = kept
        assert torch.equal(values, logits[ids]) and bool((values[:-1] >= values[1:]).all())
        apart = set(ids.tolist()) ^ set(torch.isfinite(truth).nonzero()[:, 0].tolist())
        probabilities = (logits if not top_k else truth).softmax(0).double()
        for token in apart:  # at the edge: the likelier tokens' mass within rounding of top_p
            assert abs(float(probabilities[probabilities > probabilities[token]].sum()) - top_p) < 1e-6, token
        assert len(apart) <= 1


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (50, 0.8), (0, 0.5), (0, 0.9), (3000, 1.0), (3000, 0.9)])
def test_a_rows_draw_picks_what_the_whole_vocabulary_draw_picks(top_k, top_p):
    """The same stream's uniform numbers pick the same tokens, among the likeliest kept (likeliest_kept) or over the
    row cut whole (a top_p the candidates do not hold, a top_k past the kernel's: cutoffs.py), as over the whole
    vocabulary with transformers' warpers (the inverse CDF in the order of the ids)."""
    from lowmem_aitextgen.generation.sampling import _draw

    logits = torch.randn(50257, generator=torch.Generator().manual_seed(5)) * 4  # top_p 0.9: 358 tokens kept
    row, theirs = Row(torch.tensor([1]), RowSettings(max_new=10**6, top_k=top_k, top_p=top_p, seed=7)), \
        torch.Generator().manual_seed(7)
    probabilities = warped(logits, top_k, top_p).softmax(-1)
    picks = [row.next_token(logits, ()) for _ in range(300)]
    assert picks == [_draw(probabilities, theirs) for _ in range(300)]
    assert len(set(picks)) > 5


def test_every_token_tied_with_the_k_th_stays_as_transformers_keeps_it():
    """A tie at the k-th place keeps every tied token (TopK removes only those below the k-th logit): ten equal
    logits and top_k=3, each of the ten drawn."""
    logits = torch.full((1000,), -5.0)
    logits[100:110] = 4.0
    row = Row(torch.tensor([1]), RowSettings(max_new=1, top_k=3, seed=0))
    assert {row.next_token(logits, ()) for _ in range(400)} == set(range(100, 110))


@pytest.mark.parametrize("top_k", [1024, 1025, 2049, 10_000, 40_000, 50_256])
def test_a_top_k_near_the_vocabularys_size_draws_what_transformers_warper_keeps(top_k):
    """Past our kernel's k (native_top_k.KERNEL_MAX_K: 1,024) the k-th largest is found by a cut: the draw is the one
    over the whole vocabulary with transformers' TopK warper, uniform number by uniform number, alone and beside a
    row of another k; a tie at the k-th keeps every tied token."""
    from lowmem_aitextgen.generation.sampling import _draw, next_tokens

    logits = torch.randn(50257, generator=torch.Generator().manual_seed(top_k)) * 4
    probabilities = warped(logits, top_k, 1.0).softmax(-1)
    theirs = torch.Generator().manual_seed(3)
    alone = Row(torch.tensor([1]), RowSettings(max_new=50, top_k=top_k, seed=3))
    together = [Row(torch.tensor([1]), RowSettings(max_new=50, top_k=k, seed=3)) for k in (top_k, 50)]
    picks = []
    for _ in range(30):
        pick = alone.next_token(logits, ())
        assert pick == _draw(probabilities, theirs) == next_tokens(together, torch.stack([logits] * 2), ())[0]
        picks.append(pick)
    assert len(set(picks)) > 5
    tied = logits.clone()
    order = tied.argsort(descending=True)
    tied[order[top_k - 3:top_k + 3]] = float(tied[order[top_k - 3]])  # the k-th tied with those after it
    row = Row(torch.tensor([1]), RowSettings(max_new=1, top_k=top_k, seed=0))
    kept = torch.isfinite(warped(tied, top_k, 1.0)).nonzero()[:, 0]
    assert len(kept) == min(top_k + 3, 50257) and all(row.next_token(tied, ()) in set(kept.tolist()) for _ in range(50))
