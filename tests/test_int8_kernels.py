"""The int8 view's products (int8_kernels.py): fbgemm's and oneDNN's kernels fed the same integers, each row's
product its own alone or in any batch, against the exact integer product; our own kernel (native_int8.py) giving
fbgemm's bits on every path this CPU runs; which kernel computes here, and what is used where ours is not built."""

import copy
import functools
import logging
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lowmem_aitextgen import hardware
from lowmem_aitextgen.generation import int8_kernels
from lowmem_aitextgen.generation.int8_kernels import FbgemmProduct, NativeProduct, OneDNNProduct, TokenwiseInt8Linear
from lowmem_aitextgen.native import native, native_attention, native_int8, native_top_k

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


def test_ours_where_built_and_the_cpu_has_vnni_else_fbgemms_else_onednns_else_none(monkeypatch):
    flags = native.cpu_flags()
    ours = native.built() is not None and {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
    assert int8_kernels.product_kernel() is (NativeProduct if ours else FbgemmProduct)
    monkeypatch.setattr(native, "built", lambda: None)  # as a machine without gcc
    assert int8_kernels.product_kernel() is FbgemmProduct  # this torch has both (test_decoding fails otherwise)
    monkeypatch.setattr(hardware, "INT8_OPS", (*hardware.INT8_OPS, "_gone"))  # as a torch that dropped one
    assert hardware.missing_int8_kernels() == ["torch.ops.quantized._gone"] and hardware.cpu().int8_kernels
    assert int8_kernels.product_kernel() is OneDNNProduct
    monkeypatch.setattr(hardware, "ONEDNN_INT8_OPS", (*hardware.ONEDNN_INT8_OPS, "_gone"))
    assert hardware.missing_onednn_int8_kernels() == ["torch.ops.onednn._gone"] and not hardware.cpu().int8_kernels
    with pytest.raises(RuntimeError, match="lacks torch.ops.quantized._gone and torch.ops.onednn._gone"):
        int8_kernels.product_kernel()


def test_our_kernel_is_built_here_and_runs_the_paths_the_cpu_has():
    """Built where gcc is (every machine CI runs: inductor needs it too); its paths are those the CPU's flags name,
    AMX where Linux also grants its tiles."""
    flags = native.cpu_flags()
    assert native.built() is not None, "gcc is here, yet the kernel was not built: see the INFO line"
    paths = native_int8.cpu_paths()
    assert paths[0] == "avx2" and ("vnni" in paths) == ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags)
    assert ("amx" in paths) <= ({"amx_tile", "amx_int8"} <= flags)
    assert native_int8.path_for(1) == ("vnni" if "vnni" in paths else "avx2")
    assert native_int8.path_for(16) == ("amx" if "amx" in paths else "vnni" if "vnni" in paths else "avx2")


def written_out(module: TokenwiseInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """int8_linear.c's order of operations in torch's: each row's size, its bytes as fbgemm rounds them, the exact
    integer sums, then each multiply and the bias rounded alone."""
    size = x.abs().amax(-1, True).clamp_min(1e-12)
    activations = int8_kernels.activations_uint8(x / size).double() - int8_kernels.TOKEN_ZERO
    weight, scale = module.product.int8_weight()
    sums = (activations @ weight.double().t()).float()  # integers below 2^24 here: exact
    out = sums * int8_kernels.sums_scale(scale) * size
    return out if module.bias is None else out + module.bias


@pytest.mark.parametrize("shape", [(96, 64), (300, 48), (70, 1000), (1031, 256)])  # K and N off the kernel's blocks
@pytest.mark.parametrize("bias", [True, False])
def test_our_kernel_gives_fbgemms_bits_on_every_path_alone_and_in_any_batch(shape, bias):
    plain = linear(shape[1], shape[0], bias)
    module, on_fbgemm = TokenwiseInt8Linear(plain, NativeProduct), TokenwiseInt8Linear(plain, FbgemmProduct)
    torch.manual_seed(4)
    x = (torch.randn(40, shape[1]) * 3).clamp(-5, 5)
    x[0, : min(shape[1], 200)] = near_ties(min(shape[1], 200)) * 5  # near-ties once divided by the row's size (5)
    x[0, 0] = 5.0
    x[1] = 0.0  # a row of zeros: its size the floor, its output the bias
    x[2] *= 1e4
    with torch.inference_mode():
        expected = on_fbgemm(x)
        assert torch.equal(written_out(module, x), expected)
        for path in native_int8.cpu_paths():
            alone = torch.cat([module.product.linear(x[i:i + 1], module.bias, path) for i in range(len(x))])
            assert torch.equal(alone, expected), (path, float((alone - expected).abs().max()))
            for rows in (2, 3, 7, 8, 9, 16, 17, 40):  # past each path's rows a pass (2, 8, 16)
                assert torch.equal(module.product.linear(x[:rows], module.bias, path), expected[:rows]), (path, rows)


def test_our_kernel_gives_the_same_bits_on_any_number_of_threads():
    module = TokenwiseInt8Linear(linear(256, 1000), NativeProduct)
    x = torch.randn(9, 256)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(module(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_our_kernel_refuses_a_path_the_cpu_lacks_rather_than_run_it(monkeypatch):
    module = TokenwiseInt8Linear(linear(), NativeProduct)
    monkeypatch.setattr(native_int8, "cpu_paths", lambda: ("avx2",))  # as an AVX2-only CPU
    with pytest.raises(ValueError, match="path='vnni': this CPU runs avx2"):
        module.product.linear(torch.randn(2, 64), None, "vnni")
    assert native_int8.path_for(8) == "avx2"


def test_our_packed_weight_gives_back_its_integers():
    weight = torch.randint(-127, 128, (1031, 70), dtype=torch.int8)
    packed = native_int8.pack(weight, 0.5, int8_kernels.TOKEN_ZERO)
    assert packed.kp == 128 and packed.weights.shape == (33, 32, 32, 4)
    assert torch.equal(packed.int8(), weight)
    assert torch.equal(packed.zero_sums, weight.int().sum(1) * int8_kernels.TOKEN_ZERO)


def test_our_kernel_is_built_once_a_machine_into_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native._library_file()
    assert first.parent == tmp_path / "lowmem_aitextgen" / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert native._library_file() == first and first.stat().st_mtime_ns == stamp  # not built again
    assert os.listdir(first.parent) == [first.name]  # nothing partial left beside it
    loaded = native._loaded(first)  # one library: the int8 Linear, the one-token attention, the top-k
    assert loaded.lowmem_int8_linear and loaded.lowmem_one_token_attention and loaded.lowmem_top_k


@pytest.mark.parametrize("how", ["no gcc", "a failing build"])
def test_where_our_kernel_cannot_be_built_torchs_computes_and_says_why(tmp_path, monkeypatch, caplog, how):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if how == "no gcc":
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
    else:
        broken = tmp_path / "int8_linear.c"
        broken.write_text("this is not C\n")
        monkeypatch.setattr(native, "SOURCES", (broken,))
    monkeypatch.setattr(native, "built", functools.cache(native.built.__wrapped__))  # not this process's
    monkeypatch.setattr(native_int8, "cpu_paths", functools.cache(native_int8.cpu_paths.__wrapped__))
    with caplog.at_level(logging.INFO, logger="lowmem_aitextgen"):
        assert native.built() is None
    said = "no gcc on the PATH" if how == "no gcc" else "building it failed (SubprocessError: "
    assert said in caplog.text and "int8 products, attention and top-k on torch's kernels" in caplog.text
    assert int8_kernels.product_kernel() is FbgemmProduct
    assert not list((tmp_path / "lowmem_aitextgen" / "kernels").glob("*.so"))
    module = TokenwiseInt8Linear(linear())
    assert isinstance(module.product, FbgemmProduct) and module(torch.randn(2, 64)).shape == (2, 96)
    logits = torch.randn(3, 100)  # the attention and the top-k on torch's too
    assert not native_attention.available() and torch.equal(native_top_k.largest(logits, 5)[0], logits.topk(5)[0])


def test_our_kernel_with_gpt2s_gelu_is_torchs_gelu_of_its_output_to_float_precision():
    """then_tanh_gelu: the Linear and the tanh GELU in one call, within 2e-7 of the output's size of torch's GELU
    of the Linear's output (outputs from -60 to 60: both tails, where tanh is 1 to float precision, and zero),
    a row's bits its own alone or in any batch, on every path."""
    plain = linear(256, 1000)
    plain.weight.data *= 40  # outputs of tens
    module = TokenwiseInt8Linear(plain, NativeProduct)
    torch.manual_seed(5)
    x = torch.randn(17, 256)
    x[1] = 0.0
    with torch.inference_mode():
        out = module(x)
        expected = F.gelu(out, approximate="tanh")
        assert float(out.min()) < -30 and float(out.max()) > 30
        for path in native_int8.cpu_paths():
            got = module.product.linear(x, module.bias, path, gelu=True)
            assert torch.all((got - expected).abs() <= 2e-7 * out.abs().clamp_min(1)), path
            assert torch.equal(module.then_tanh_gelu()(x[:1]), got[:1])
            assert torch.equal(module.product.linear(x[:9], module.bias, path, gelu=True), got[:9]), path
    assert TokenwiseInt8Linear(plain, FbgemmProduct).then_tanh_gelu() is None


def test_our_kernel_adds_a_residual_with_torchs_bits():
    """native_int8.linear's `residual`: the bits of torch's add of it and the output, on every path, at any rows;
    one not of the output's shape or not fp32 refused."""
    module = TokenwiseInt8Linear(linear(256, 1000), NativeProduct)
    torch.manual_seed(7)
    x, residual = torch.randn(17, 256), torch.randn(17, 1000) * 3
    with torch.inference_mode():
        for path in native_int8.cpu_paths():
            expected = residual + module.product.linear(x, module.bias, path)
            for rows in (1, 9, 17):
                got = native_int8.linear(module.product.packed, x[:rows], module.bias, int8_kernels.TOKEN_INVERSE,
                                         int8_kernels.TOKEN_ZERO, path, residual=residual[:rows])
                assert torch.equal(got, expected[:rows]), (path, rows)
        for wrong in (residual[:3], residual.double(), residual.t().contiguous().t()):
            with pytest.raises(ValueError, match="residual="):
                native_int8.linear(module.product.packed, x, module.bias, int8_kernels.TOKEN_INVERSE,
                                   int8_kernels.TOKEN_ZERO, residual=wrong)


def test_our_kernel_takes_no_rows_and_any_leading_shape():
    module = TokenwiseInt8Linear(linear(), NativeProduct)
    x = torch.randn(2, 3, 64)  # (rows, tokens, width), as transformers' forward gives it
    assert module(x[:0]).shape == (0, 3, 96)
    assert torch.equal(module(x), module(x.reshape(6, 64)).view(2, 3, 96))
