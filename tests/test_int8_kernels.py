"""The int8 view's products (int8_kernels.py): fbgemm's and oneDNN's kernels fed the same integers, each row's
product its own alone or in any batch, against the exact integer product; which kernel this torch computes with."""

import copy

import pytest
import torch
from torch import nn

from lowmem_aitextgen import hardware, int8_kernels
from lowmem_aitextgen.int8_kernels import FbgemmProduct, OneDNNProduct, TokenwiseInt8Linear

KERNELS = [FbgemmProduct, OneDNNProduct]
SHAPES = [(96, 64), (64, 256), (300, 48)]  # (out, in): a projection, a wider input, a head-like output


def near_ties(count: int) -> torch.Tensor:
    """Activations within [-1, 1] a few float steps from where x * TOKEN_INVERSE + TOKEN_ZERO is half-way between two
    integers, where two roundings part."""
    halves = (torch.arange(-63, 63, dtype=torch.float32) + 0.5) / int8_kernels.TOKEN_INVERSE
    around = [halves]
    for _ in range(3):
        around += [torch.nextafter(around[-1], torch.full_like(halves, 2.0)),
                   torch.nextafter(around[-1], torch.full_like(halves, -2.0))]
    values = torch.cat(around).clamp(-1, 1)
    return values[torch.randperm(len(values))][:count]


def scaled(rows: int, width: int) -> torch.Tensor:
    """Activations as the Linear gives a kernel: each token divided by its largest size, near-ties among them."""
    x = torch.randn(rows, width)
    x = x / x.abs().amax(-1, True)
    x[0, : min(width, 200)] = near_ties(min(width, 200))
    return x


def test_onednns_operands_are_the_integers_fbgemm_multiplies():
    """The activations and weights oneDNN's kernel is given, rounded by plain operations, are those torch's fbgemm
    quantizer makes, near-ties included: the two kernels multiply the same integers (so oneDNN's quality is the
    tokenwise form's measured one)."""
    torch.manual_seed(0)
    x = torch.cat([near_ties(10_000), torch.rand(100_000) * 2 - 1])
    fbgemms = torch.quantize_per_tensor(x, int8_kernels.TOKEN_SCALE, int8_kernels.TOKEN_ZERO, torch.quint8)
    assert torch.equal(int8_kernels.activations_uint8(x), fbgemms.int_repr())
    weight = torch.randn(512, 256) * 0.02
    scale = int8_kernels.weight_scale(weight)
    expected = torch.quantize_per_tensor(weight, scale, 0, torch.qint8).int_repr()
    assert torch.equal(int8_kernels.weight_int8(weight, scale), expected)


def exact_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The product the kernels compute, in float64 from the integers: (activations - zero) @ weights^T times the
    two scales."""
    activations = int8_kernels.activations_uint8(x).double() - int8_kernels.TOKEN_ZERO
    scale = int8_kernels.weight_scale(weight)
    integers = torch.quantize_per_tensor(weight, scale, 0, torch.qint8).int_repr().double()
    return activations @ integers.t() * (int8_kernels.TOKEN_SCALE * scale)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES)
def test_each_kernel_computes_a_rows_product_alone_as_in_any_batch_and_exactly(kernel, shape):
    torch.manual_seed(1)
    weight = torch.randn(*shape) * 0.05
    product = kernel(weight)
    x = scaled(40, shape[1])
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for rows in (1, 2, 3, 7, 16, 17, 33, 40):
        assert torch.equal(product(x[:rows]), alone[:rows]), (kernel.name, shape, rows)
    truth = exact_product(x, weight)
    assert alone.dtype == torch.float32 and alone.shape == truth.shape
    assert torch.allclose(alone.double(), truth, rtol=1e-6, atol=1e-7), float((alone.double() - truth).abs().max())


@pytest.mark.parametrize("shape", [*SHAPES, (1024, 256)])
def test_the_two_kernels_give_the_same_bits(shape):
    """The same integers, their sums dequantized as fbgemm does: a text is the same on either kernel."""
    torch.manual_seed(2)
    weight = torch.randn(*shape) * 0.05
    x = scaled(17, shape[1])
    fbgemm, onednn = FbgemmProduct(weight)(x), OneDNNProduct(weight)(x)
    assert torch.equal(onednn, fbgemm), float((onednn - fbgemm).abs().max())


def linear(inputs: int = 64, outputs: int = 96, bias: bool = True) -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("bias", [True, False])
def test_the_tokenwise_linear_on_either_kernel_is_the_linear_within_int8s_rounding(kernel, bias):
    plain = linear(bias=bias)
    module = TokenwiseInt8Linear(plain, kernel)
    assert isinstance(module.product, kernel)
    x = torch.randn(2, 5, 64)  # (rows, tokens, width), as transformers' forward gives it
    with torch.inference_mode():
        got, expected = module(x), plain(x)
        alone = module(x[1:, 2:3])
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < 0.02 * float(expected.abs().max())
    assert torch.equal(alone, got[1:, 2:3])  # a token alone as beside the others


def test_a_copy_of_a_view_on_onednns_kernel_computes_as_the_original():
    """oneDNN's packed weight cannot be copied (opaque storage); a copied view shares it (never written)."""
    module = TokenwiseInt8Linear(linear(), OneDNNProduct)
    twin = copy.deepcopy(module)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(twin(x), module(x))


def test_fbgemms_kernel_where_torch_aos_ops_are_here_else_onednns_else_none(monkeypatch):
    assert int8_kernels.product_kernel() is FbgemmProduct  # this torch has both (test_decoding fails otherwise)
    monkeypatch.setattr(hardware, "INT8_OPS", (*hardware.INT8_OPS, "_gone"))  # as a torch that dropped one
    assert hardware.missing_int8_kernels() == ["torch.ops.quantized._gone"] and hardware.cpu().int8_kernels
    assert int8_kernels.product_kernel() is OneDNNProduct
    monkeypatch.setattr(hardware, "ONEDNN_INT8_OPS", (*hardware.ONEDNN_INT8_OPS, "_gone"))
    assert hardware.missing_onednn_int8_kernels() == ["torch.ops.onednn._gone"] and not hardware.cpu().int8_kernels
    with pytest.raises(RuntimeError, match="lacks torch.ops.quantized._gone and torch.ops.onednn._gone"):
        int8_kernels.product_kernel()
