"""What top_k, top_p, typical_p and min_p keep (cutoffs.py) against transformers' own warpers over GPT-2's whole
vocabulary, the cut by mass (native_top_k.mass_cuts) against a sorted row, and generate() with each cutoff against
a plain loop over the model's forward with transformers' warpers."""

import pytest
import torch
from transformers import (
    GPT2Config,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from conftest import realistic
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.generation import cutoffs, sampling
from lowmem_aitextgen.native import native, native_top_k

PAIRS = {"TopK": (cutoffs.TopK, TopKLogitsWarper), "TopP": (cutoffs.TopP, TopPLogitsWarper),
         "Typical": (cutoffs.Typical, TypicalLogitsWarper), "MinP": (cutoffs.MinP, MinPLogitsWarper)}
SETTINGS = {"TopK": [1, 50, 512, 513, 1024, 1025, 2049, 10_000, 40_000, 50_256, 50_257],
            "TopP": [0.1, 0.9, 0.99, 0.999, 0.99999], "Typical": [0.2, 0.9, 0.99, 0.999, 0.99999],
            "MinP": [0.0, 0.05, 0.5, 1.0]}

pytestmark = pytest.mark.edges  # transformers' own warpers, which cutoffs.py subclasses, at the oldest too


def rows(scale: float) -> torch.Tensor:
    """Three rows of GPT-2's 50,257 logits: barred tokens (-inf), one row in steps of a half (many equal values)."""
    made = torch.randn(3, 50257, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    made[:, 7::97] = -torch.inf
    made[1] = (made[1] * 2).round() / 2
    return made


def keys_of(name: str, row: torch.Tensor) -> torch.Tensor:
    """The order a mass is counted in (ascending): the likeliest first for TopP, the least surprising for
    Typical."""
    if name == "TopP":
        return -row
    normalized = row.log_softmax(-1)
    return ((-normalized) - (-(normalized * normalized.exp()).nansum())).abs()


# the edge's width: float32 sums of 50,257 probabilities in their sorted order stray from float64's by up to 1.2e-5 on
# these rows (their softmax normalized in that order too)
EDGE = 2e-5


@pytest.mark.parametrize("kernel", ["ours", "torch's"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_each_cut_keeps_what_transformers_warper_keeps(name, kernel, monkeypatch):
    """TopK and MinP: transformers' answer bit for bit.  TopP and Typical: the same tokens, but for those at the
    edge, where the probability before a token (in the warper's order) is within their sum's rounding of the mass
    (EDGE: float32 sums of 50,257 there, float64 here) or its tie straddles it (TopP keeps those its sort puts
    first, we all of them).  Without our kernels: transformers' own call."""
    if kernel == "torch's":
        monkeypatch.setattr(native, "built", lambda: None)
    elif native.built() is None:
        pytest.skip("our kernels need gcc on x86-64 Linux with AVX2")
    ours, theirs = PAIRS[name]
    for scale in (1.0, 3.0, 6.0, 12.0):
        logits = rows(scale)
        for setting in SETTINGS[name]:
            got, expected = ours(setting)(None, logits), theirs(setting)(None, logits)
            if name in ("TopK", "MinP") or kernel == "torch's":
                assert torch.equal(got, expected), (scale, setting)
                continue
            assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
            for r in range(3):
                apart = (torch.isfinite(got[r]) ^ torch.isfinite(expected[r])).nonzero()[:, 0]
                key, probability = keys_of(name, logits[r]), logits[r].softmax(-1).double()
                for token in apart.tolist():  # (a tie at the edge: theirs keeps those its sort puts first)
                    before = float(probability[key < key[token]].sum())
                    tied = float(probability[key == key[token]].sum())
                    assert before - EDGE < setting < before + tied + EDGE, (scale, setting, r, before)
                if len(apart) and r != 1:  # (row 1: ties) the tokens apart hold no more than the edge's width
                    held = probability[apart]
                    assert float(held.sum()) <= 2 * EDGE + float(held.max()), (scale, setting, r, len(apart))


def test_a_row_holding_nan_and_a_warper_keeping_more_are_transformers_own():
    logits = rows(3.0)
    logits[1, 500] = float("nan")
    for name, (ours, theirs) in PAIRS.items():
        setting = SETTINGS[name][1]
        torch.testing.assert_close(ours(setting)(None, logits), theirs(setting)(None, logits), rtol=0, atol=0,
                                   equal_nan=True)
        if name != "TopK":
            clean = rows(3.0)
            assert torch.equal(ours(setting, min_tokens_to_keep=4000)(None, clean),
                               theirs(setting, min_tokens_to_keep=4000)(None, clean))


def sorted_cut(keys: torch.Tensor, weights: torch.Tensor | None, mass: float) -> tuple[float, float]:
    """The cut by sorting: the key of the first item, in ascending order, whose cumulative weight (float64)
    reaches `mass` (the last where none does), and the key after it (+inf where none)."""
    order = keys.argsort(stable=True)
    ordered = keys[order]
    cumulative = (torch.ones_like(keys) if weights is None else weights)[order].double().cumsum(0)
    at = min(int((cumulative < mass).sum()), len(keys) - 1)
    return float(ordered[at]), float(ordered[at + 1]) if at + 1 < len(keys) else float("inf")


@pytest.mark.skipif(native.built() is None, reason="our kernels need gcc on x86-64 Linux with AVX2")
@pytest.mark.parametrize("n", [1, 7, 8, 9, 300, 50257])
def test_the_cut_by_mass_is_the_sorted_rows(n):
    """Keys spread, equal (one bucket) and holding -inf and +inf, with weights and counted, masses from none to
    past the total: the cut and the key after it are the sorted row's, each row alone or beside others."""
    generator = torch.Generator().manual_seed(n)
    spread = torch.randn(n, generator=generator) * 5
    infinite = spread.clone()
    infinite[::5], infinite[1::7] = torch.inf, -torch.inf
    stepped = (torch.randn(n, generator=generator) * 2).round()
    for keys in (spread, infinite, stepped, torch.full((n,), 2.5)):
        weights = torch.rand(n, generator=generator).softmax(0)
        for given in (None, weights):
            total = float(n if given is None else 1.0)
            masses = [0.0, total * 0.001, total * 0.37, total * 0.9, total * 0.9999, total, total * 2]
            batch = keys.expand(len(masses), n).contiguous()
            cuts, afters = native_top_k.mass_cuts(
                batch, None if given is None else given.expand(len(masses), n).contiguous(), masses)
            for m, mass in enumerate(masses):
                assert (float(cuts[m]), float(afters[m])) == sorted_cut(keys, given, mass), (mass, given is None)
    nan = spread.clone()
    nan[n // 2] = float("nan")
    assert native_top_k.mass_cuts(nan[None], None, [1.0]) is None


def plain_loop(model: torch.nn.Module, ids: torch.Tensor, new: int, seed: int, warpers: list) -> list[int]:
    """Tokens drawn by the model's own forward (the prompt, then a token a step over its cache, as transformers'
    generate() steps it), transformers' warpers over its scores, and the inverse CDF in the order of the ids by
    one uniform number of the text's stream a token."""
    generator = torch.Generator().manual_seed(sampling.row_seed(seed, ids.tolist(), 0))
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=True)
        for _ in range(new):
            scores = out.logits[0, -1:].float()
            scores[:, model.config.eos_token_id] = -torch.inf  # (min_new_tokens: end-of-text barred)
            for warper in warpers:
                scores = warper(None, scores)
            cumulative = scores.softmax(-1)[0].cumsum(0, dtype=torch.float64)
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            tokens.append(int(torch.searchsorted(cumulative, uniform * cumulative[-1], right=True)))
            out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


CALLS = [dict(top_k=40_000), dict(top_k=0, top_p=0.999), dict(top_k=10_000, top_p=0.95),
         dict(top_k=0, typical_p=0.9), dict(top_k=0, min_p=0.05), dict(top_k=50, min_p=0.02, typical_p=0.95)]


@pytest.mark.parametrize("call", CALLS, ids=lambda call: ",".join(f"{k}={v}" for k, v in call.items()))
def test_generate_with_each_cutoff_draws_what_a_plain_loop_over_the_forward_draws(call):
    """GPT-2's vocabulary, a model whose logits spread as a trained one's do: generate()'s seeded tokens are those
    of a plain loop over the model's forward with transformers' warpers, in transformers' order (temperature, top_k,
    top_p, min_p, typical_p)."""
    torch.manual_seed(0)
    ai = aitextgen(config=GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64))
    realistic(ai.model)
    with torch.no_grad():
        ai.model.transformer.ln_f.weight.mul_(25)  # (logits spread as a trained model's: 1,479 hold 0.9 at first)
    ids = ai.tokenizer("The meaning of a word", return_tensors="pt")["input_ids"][0]
    text = ai.generate(prompt="The meaning of a word", max_new_tokens=24, min_new_tokens=24, temperature=0.8, seed=4,
                       decoding="exact", return_as_list=True, lstrip=False, skip_special_tokens=False, **call)[0]
    warpers = [TemperatureLogitsWarper(0.8)] + ([TopKLogitsWarper(call["top_k"])] if call["top_k"] else [])
    warpers += [warper(call[name]) for name, warper in (("top_p", TopPLogitsWarper), ("min_p", MinPLogitsWarper),
                                                        ("typical_p", TypicalLogitsWarper)) if name in call]
    truth = plain_loop(ai.model.eval(), ids, 24, 4, warpers)
    assert text == ai.tokenizer.decode(ids.tolist() + truth)
    assert len(set(truth)) > 5


@pytest.mark.parametrize("kernel", ["ours", "torch's"])
def test_the_k_th_and_the_next_are_torchs_topk_values(kernel, monkeypatch):
    """kth_and_next, every way it finds them (our top-k kernel, a cut of counts, torch's kthvalue), on rows with
    barred tokens and many equal values: the values torch's topk(k + 1) gives at k and k + 1."""
    if kernel == "torch's":
        monkeypatch.setattr(native, "built", lambda: None)
    logits = rows(3.0)
    for k in (1, 50, 511, 512, 513, 5000, 40_000, 50_256):
        kth, after = cutoffs.kth_and_next(logits, k)
        expected = logits.topk(k + 1).values
        assert torch.equal(kth[:, 0], expected[:, k - 1]) and torch.equal(after[:, 0], expected[:, k]), k
