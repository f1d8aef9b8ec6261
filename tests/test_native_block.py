"""A GPT-2 block's step in one call of our kernels (native_block.py, gpt2_block.c), for an int8 view and a bf16 one:
the stepping decoder's calls one by one bit for bit (its logits and the cache it writes), the view's own forward to
its precision, its layer norm the exact one's, and what it does not take stepping as before."""

import pytest
import torch
from torch.nn import functional as F
from transformers import GPT2LMHeadModel, GPTNeoConfig, GPTNeoForCausalLM

from conftest import tiny_gpt2_config
from lowmem_aitextgen.generation import decoding, int8_kernels, kv_cache, packed16, stepping
from lowmem_aitextgen.generation.int8_kernels import FbgemmProduct, NativeProduct, TokenwiseInt8Linear
from lowmem_aitextgen.generation.kv_cache import new_cache
from lowmem_aitextgen.native import native, native_bf16, native_block

pytestmark = [pytest.mark.skipif(not native_block.available() or NativeProduct is not int8_kernels.product_kernel(),
                                 reason="a block's step needs our kernels: gcc, AVX512F and AVX512-VNNI"),
              pytest.mark.edges]  # (transformers' GPT-2 and GPT-Neo blocks and cache layers, at the oldest too)


def tiny_view(seed: int = 0, positions: int = 64, form: str = "int8", **config) -> torch.nn.Module:
    """A tiny GPT-2's seeded decoding view in `form` (int8 or bf16; random weights)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=300, n_layer=3, n_positions=positions, **config)).eval()
    return decoding.decoding_model(model, form, True).model


BF16 = pytest.mark.skipif(not native_bf16.available(), reason="a bf16 view's call needs AVX512-BF16")
FORMS = ["int8", pytest.param("bf16", marks=BF16)]


def stepped(step: stepping.Step, ids: torch.Tensor, mask: torch.Tensor, steps: int, dtype: torch.dtype | None
            ) -> tuple[list[torch.Tensor], object]:
    """Each pass's logits of a prompt (`ids`, padded on the left as `mask` says) and `steps` greedy steps after it, and
    the cache they wrote (its keys and values in `dtype`)."""
    cache, positions, logits = new_cache([], dtype), (mask.cumsum(1) - 1).clamp(min=0), []
    with torch.inference_mode():
        logits.append(step(ids, positions, mask, cache))
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            positions = positions[:, -1:] + 1
            logits.append(step(logits[-1].argmax(-1), positions, mask, cache))
    return logits, cache


PROMPTS = [(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 1, 1, 1]])),
           (torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11], [0, 0, 0, 12]]),
            torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]))]


@pytest.mark.parametrize("dtype, steps", [(torch.bfloat16, 6), (None, 6), (torch.bfloat16, kv_cache.ROOM + 10)])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["one row", "three rows, two padded"])
@pytest.mark.parametrize("form", FORMS)
def test_a_blocks_step_in_one_call_is_the_decoders_calls_one_by_one_bit_for_bit(monkeypatch, form, dtype, steps,
                                                                               prompt):
    """Steps through native_block.steps give the logits the same Step's calls give one by one, and write the same
    keys and values (a bf16 cache beside fp32 activations: converted as torch's copy converts them); past the
    cache's ROOM too, where its buffers move (the call writes into the new ones)."""
    view = tiny_view(positions=128, form=form)
    through, one_by_one = stepping.Step(view), stepping.Step(view)
    assert through.native_blocks is not None
    one_by_one.native_blocks = None  # (its layers keep the blocks' norms: those of the call)
    calls = []
    original = native_block.steps
    monkeypatch.setattr(native_block, "steps", lambda *args: calls.append(1) or original(*args))
    ours, our_cache = stepped(through, *prompt, steps, dtype)
    assert len(calls) == steps  # every step after the prompt
    theirs, their_cache = stepped(one_by_one, *prompt, steps, dtype)
    assert len(calls) == steps
    for got, expected in zip(ours, theirs):
        assert torch.equal(got, expected)
    for mine, others in zip(our_cache.layers, their_cache.layers):
        assert mine.keys.dtype == (dtype or through.native_blocks.dtype)
        assert torch.equal(mine.keys, others.keys) and torch.equal(mine.values, others.values)


@pytest.mark.parametrize("form, within", [("int8", 2e-3), pytest.param("bf16", 3e-2, marks=BF16)])
def test_its_steps_are_the_views_forward_to_its_precision(form, within):
    """Each step's logits, fed the same tokens, against the view's own forward over the whole text so far
    (transformers' attention and GELU, torch's layer norm): the same function, rounded differently (bf16: a few
    of its roundings apart)."""
    view = tiny_view(seed=1, form=form)
    step = stepping.Step(view)
    assert step.native_blocks is not None
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    logits, _ = stepped(step, ids, torch.ones_like(ids), 8, None)
    text = torch.cat([ids[0], torch.stack([got[0, -1].argmax() for got in logits[:-1]])])
    with torch.inference_mode():
        forward = view(input_ids=text[None]).logits[0]
    for place, got in zip(range(len(ids[0]) - 1, len(text)), logits):
        torch.testing.assert_close(got[0, -1].float(), forward[place].float(), rtol=0,
                                   atol=within * float(forward[place].abs().max()))


def test_its_norm_is_the_exact_layer_norm_to_float_precision_and_a_rows_own():
    """gpt2_block.c's layer norm against the norm computed in float64: within float precision (rows of a large
    mean and a small spread included), no further than torch's own; a row's bits the same alone."""
    norm = torch.nn.LayerNorm(1030)  # (not a multiple of the kernel's 16 lanes)
    torch.manual_seed(2)
    norm.weight.data.normal_(1, 0.2)
    norm.bias.data.normal_(0, 0.1)
    x = torch.randn(5, 1030)
    x[1] = x[1] * 1e-3 + 1000.0
    x[2] *= 1e4
    with torch.inference_mode():
        exact = F.layer_norm(x.double(), (1030,), norm.weight.double(), norm.bias.double(), norm.eps)
        ours, torchs = native_block.norm(norm)(x), norm(x)
        ours_error, torchs_error = ((t.double() - exact).abs().amax(1) for t in (ours, torchs))
        assert torch.all(ours_error <= torchs_error.clamp_min(1e-6))  # row 1: a float mean's own rounding
        assert torch.all(ours_error[[0, 2, 3, 4]] < 1e-5)
        for row in range(5):
            assert torch.equal(native_block.norm(norm)(x[row:row + 1]), ours[row:row + 1])
        assert torch.equal(native_block.norm(norm)(x.view(5, 1, 1030)), ours.view(5, 1, 1030))


def test_its_bf16_norm_is_the_exact_layer_norm_rounded_once_and_a_rows_own():
    """gpt2_block.c's layer norm of a bf16 view's norm (bf16 inputs, weights and outputs) against the norm of the
    same values computed in float64: within one bf16 rounding of it, no further than torch's bf16 norm; a row's
    bits the same alone."""
    norm = torch.nn.LayerNorm(1030)
    torch.manual_seed(3)
    norm.weight.data.normal_(1, 0.2)
    norm.bias.data.normal_(0, 0.1)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(5, 1030)
    x[1] = x[1] * 1e-1 + 100.0
    x[2] *= 1e4
    x = x.to(torch.bfloat16)
    with torch.inference_mode():
        exact = F.layer_norm(x.double(), (1030,), norm.weight.double(), norm.bias.double(), norm.eps)
        ours, torchs = native_block.norm(norm)(x), norm(x)
        assert ours.dtype == torch.bfloat16
        ours_error, torchs_error = ((t.double() - exact).abs() for t in (ours, torchs))
        assert torch.all(ours_error <= 2 ** -8 * exact.abs() + 1e-6)
        assert torch.all(ours_error.amax(1) <= torchs_error.amax(1))
        for row in range(5):
            assert torch.equal(native_block.norm(norm)(x[row:row + 1]), ours[row:row + 1])


@BF16
def test_a_bf16_views_fused_products_are_torchs_operations_on_the_product():
    """The bf16 kernel's GELU after the product is torch's tanh GELU of the rounded product to a bf16 rounding, and
    its residual added is torch's bf16 add of the two bit for bit."""
    torch.manual_seed(4)
    weight, bias = (torch.randn(200, 64) / 8).to(torch.bfloat16), torch.randn(200).to(torch.bfloat16)
    x, residual = torch.randn(7, 64).to(torch.bfloat16), (torch.randn(7, 200) * 4).to(torch.bfloat16)
    packed = native_bf16.pack(weight)
    product = native_bf16.linear(packed, x, bias)
    gelu = F.gelu(product.float(), approximate="tanh")
    ours = native_bf16.linear(packed, x, bias, gelu=True)
    assert torch.all((ours.float() - gelu).abs() <= 2 ** -8 * gelu.abs() + 1e-6)
    assert torch.equal(native_bf16.linear(packed, x, bias, residual=residual), residual + product)
    both = native_bf16.linear(packed, x, bias, gelu=True, residual=residual)
    assert torch.equal(both, residual + ours)


def test_what_it_does_not_take_steps_as_before(monkeypatch):
    """A hooked norm (its hook must run), a view whose products are fbgemm's, a bf16 view on oneDNN's products and
    GPT-Neo: no block step, and torch's layer norm."""
    view = tiny_view()
    seen = []
    handle = view.transformer.h[1].ln_2.register_forward_hook(lambda *args: seen.append(1))
    try:
        step = stepping.Step(view)
        assert step.native_blocks is None and stepping.module_of(step.layers[0].ln_1) is view.transformer.h[0].ln_1
        stepped(step, *PROMPTS[0], 2, None)
        assert len(seen) == 3  # the prompt and two steps
    finally:
        handle.remove()
    fbgemm = tiny_view()
    for block in fbgemm.transformer.h:
        for name in ("c_attn", "c_proj"):
            module = getattr(block.attn, name)
            module.product = FbgemmProduct(module.product.int8_weight()[0].float() * module.product.scale)
    assert stepping.Step(fbgemm).native_blocks is None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=300)).eval()
    monkeypatch.setattr(native_bf16, "available", lambda: False)  # (a bf16 view packed for oneDNN, or not packed)
    onednn = decoding.decoding_model(model, "bf16").model
    assert not isinstance(onednn.transformer.h[0].attn.c_attn, packed16.NativeBf16Linear)
    assert stepping.Step(onednn).native_blocks is None
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=300, max_position_embeddings=64, hidden_size=64, num_layers=2,
                                         num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8))
    neo_view = decoding.decoding_model(neo.eval(), "int8", True).model
    assert isinstance(neo_view.transformer.h[0].attn.attention.q_proj, TokenwiseInt8Linear)
    assert stepping.Step(neo_view).native_blocks is None


def test_a_wrong_place_is_refused_before_the_cache_is_counted():
    """Places beyond a layer's cache: refused by the call, naming them, and the step's places not counted."""
    view = tiny_view()
    step = stepping.Step(view)
    _, cache = stepped(step, *PROMPTS[0], 1, None)
    ends = [layer.slots.end for layer in cache.layers]
    x = torch.zeros(1, view.config.n_embd)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"places=\[99\]"):
        native_block.steps(step.native_blocks, x, cache.layers, torch.tensor([99], dtype=torch.int32))
    assert [layer.slots.end for layer in cache.layers] == ends
    assert native.built() is not None
