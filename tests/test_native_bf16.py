"""Our bf16 Linear (native_bf16.py, bf16_linear.c) against the exact product, a row's bits its own alone, beside any
rows and at any number of threads, and what it refuses."""

import pytest
import torch

from lowmem_aitextgen.native import native_bf16

pytestmark = pytest.mark.skipif(not native_bf16.available(), reason="our bf16 kernel needs gcc and AVX512-BF16")


@pytest.mark.parametrize("shape", [(96, 64), (300, 48), (70, 1000), (1031, 256), (5, 2)])  # N off the panels
@pytest.mark.parametrize("bias", [True, False])
def test_each_row_is_the_exact_product_to_bf16s_rounding_and_its_own(shape, bias):
    """Within a bf16 rounding of the exact product (fp32 sums of exact bf16 products), every row the same bits
    alone as beside 1 to 19 others (past the 8 rows a pass serves) and on 1 to 3 threads."""
    n, k = shape
    generator = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    add = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    x = (torch.randn(19, k, generator=generator) * 3).to(torch.bfloat16)
    x[1] = 0.0
    packed = native_bf16.pack(weight)
    got = native_bf16.linear(packed, x, add)
    exact = x.double() @ weight.double().t() + (0 if add is None else add.double())
    assert got.dtype == torch.bfloat16 and got.shape == (19, n)
    size = exact.abs().amax(1, keepdim=True).clamp_min(1e-3)
    assert torch.all((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * size)
    for rows in (1, 7, 8, 9, 16):
        assert torch.equal(native_bf16.linear(packed, x[:rows], add), got[:rows]), rows
    alone = torch.cat([native_bf16.linear(packed, x[i:i + 1], add) for i in range(19)])
    assert torch.equal(alone, got)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(native_bf16.linear(packed, x, add), got)
    finally:
        torch.set_num_threads(threads)


def test_it_takes_any_leading_shape_and_no_rows_and_refuses_an_odd_width():
    weight = torch.randn(40, 64).to(torch.bfloat16)
    packed = native_bf16.pack(weight)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert torch.equal(native_bf16.linear(packed, x, None), native_bf16.linear(packed, x.reshape(6, 64), None)
                       .view(2, 3, 40))
    assert native_bf16.linear(packed, x[:0], None).shape == (0, 3, 40)
    assert torch.equal(native_bf16.linear(packed, x.float(), None), native_bf16.linear(packed, x, None))
    with pytest.raises(ValueError, match="63 inputs: an even number"):
        native_bf16.pack(torch.randn(40, 63).to(torch.bfloat16))
    for wrong in (torch.zeros(40), torch.zeros(39, dtype=torch.bfloat16)):  # read as bf16, it would be garbage
        with pytest.raises(ValueError, match="bias="):
            native_bf16.linear(packed, x, wrong)
