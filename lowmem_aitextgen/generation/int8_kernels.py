"""The int8 matrix products a decoding view's projections call, and the Linear that calls them with each token's
activations quantized alone, so that a text is the same in any batch (the form of seeded calls and the server).

Three kernels take the same integers and compute their products exactly (int32 sums); product_kernel picks one:

| kernel | ops                                             | why                                                  |
|--------|-------------------------------------------------|------------------------------------------------------|
| native | our own (native_int8.py, int8_linear.c), built  | one pass over the weights for every row of a call,   |
|        | at first use by gcc; chosen on x86-64 CPUs with | and the quantization in the same call: on the Intel  |
|        | AVX512-VNNI                                     | Xeon with AMX a call 1.4x as quick as fbgemm's at    |
|        |                                                 | one row, 3x at 8; generate() 1.35x and 2x (HISTORY.md,|
|        |                                                 | twenty-first session)                                |
| fbgemm | torch.ops.quantized (torch.ao.quantization's,   | the fastest of torch's at a batch of one on every    |
|        | which torch 2.13 says it will remove)           | CPU measured (Intel Xeon with AMX: 2x oneDNN's a     |
|        |                                                 | call, 1.6x end to end, RESULTS.md)                   |
| oneDNN | torch.ops.onednn.qlinear_prepack and            | what torchao's x86 int8 path (pt2e with              |
|        | qlinear_pointwise                               | X86InductorQuantizer) lowers to, so kept while that  |
|        |                                                 | path is: int8 decoding outlives torch.ao's ops       |

oneDNN's operands are rounded here by plain operations as fbgemm rounds them (a weight times its scale's float
inverse; an activation by one fused multiply-add with the zero point, emulated in float64), the native kernel
rounds them the same way in C, and both dequantize their integer sums as fbgemm does, so the three give the same
bits (on oneDNN's AMX, AVX512-VNNI and AVX2 kernels, the native kernel's three paths and fbgemm's AVX512 and AVX2
ones): a projection's output is the same on any (a text's other operations may not be: our kernel's fused GELU,
native_block.py's layer norm), and their quality is the tokenwise form's measured one (forms.Form.quality).
In each, a row's output is its own alone or in any batch (tests/test_int8_kernels.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import hardware
from ..native import native, native_int8

TOKEN_SCALE, TOKEN_ZERO = 2 / 126, 64  # [-1, 1] onto 1..127: 7 bits, as torch's x86 dynamic form (reduce_range)
# the float32 inverse of the float32 scale, which fbgemm multiplies by
TOKEN_INVERSE = float(1 / torch.tensor(TOKEN_SCALE, dtype=torch.float32))


def weight_scale(weight: torch.Tensor) -> float:
    """A weight's int8 scale, per tensor (weights per channel measured 30% slower a projection at batch 1)."""
    return float(weight.abs().max().clamp(min=1e-8)) / 127


class EachTokenScaled:
    """A kernel of one fixed activation scale (TOKEN_SCALE) given each token divided by its largest size."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """TokenwiseInt8Linear's output: each token scaled into [-1, 1], its product, the size multiplied back."""
        # linalg.vector_norm(inf): 10x slower; arguments by position: torch parses keywords in ~0.2 us each
        size = x.abs().amax(-1, True).clamp_min_(1e-12)
        out = self(x / size).mul_(size)
        # the bias added after, a rounding each (not addcmul's one fused multiply-add): our kernel's bits
        # (int8_linear.c adds it so too), so a text is the same on either kernel
        return out if bias is None else out.add_(bias)


class FbgemmProduct(EachTokenScaled):
    """fbgemm's kernel that takes the activations' scale it is given
    (quantized.linear_with_input_q_dq_qweight_dq_output_fp32): it quantizes them and multiplies in one call."""

    name = "fbgemm"

    def __init__(self, weight: torch.Tensor) -> None:
        with warnings.catch_warnings():  # torch's notice that quantized tensors are deprecated: not the user's
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_tensor(weight.float(), weight_scale(weight), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        # the overload's C++ function: the op's packet checks its arguments in Python each call, and the overload
        # (a TorchBind op: the packed weight is a script object) looks for export's fake objects in them (0.8 ms
        # each a 355M step, RESULTS.md); none is ever given here
        overload = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
        self._op = getattr(overload, "_op", overload)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 product of `x` (each token within [-1, 1]) quantized with TOKEN_SCALE and the weight."""
        return self._op(x, TOKEN_SCALE, TOKEN_ZERO, self.packed)

    def int8_weight(self) -> tuple[torch.Tensor, float]:
        """The int8 weight (out x in) and its scale."""
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight.int_repr(), weight.q_scale()


class OneDNNProduct(EachTokenScaled):
    """oneDNN's int8 matrix product (u8 activations, s8 weights), its operands rounded as fbgemm's.  oneDNN is given
    scales of 1, so it returns each integer sum as a float (exact below 2^24, else rounded to nearest): the
    dequantizing multiply is done here, once, as fbgemm does it (by the float32 product of the two scales), because
    oneDNN's own order of the scales' multiplies depends on the shape and the rows of a call."""

    name = "oneDNN"

    def __init__(self, weight: torch.Tensor) -> None:
        scale = weight_scale(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(weight_int8(weight, scale), None)  # oneDNN's opaque layout
        self.ones = torch.ones(weight.shape[0])
        self.zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        self.scale = float(sums_scale(scale))
        overload = torch.ops.onednn.qlinear_pointwise.default
        self._op = getattr(overload, "_op", overload)  # the C++ function, as fbgemm's (arguments checked there)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 product of `x` (each token within [-1, 1]) quantized with TOKEN_SCALE and the weight."""
        sums = self._op(activations_uint8(x), 1.0, TOKEN_ZERO, self.packed, self.ones, self.zeros, None, 1.0, 0,
                        torch.float32, "none", [], "")
        return sums.mul_(self.scale)

    def __deepcopy__(self, memo: dict) -> OneDNNProduct:
        # oneDNN's packed weight cannot be copied (its storage is opaque); it is never written, so copies share it
        return self


class NativeProduct:
    """Our own kernel (native_int8.py): each token quantized alone, the product and its dequantization in one call,
    with fbgemm's bits (module docstring)."""

    name = "native"

    def __init__(self, weight: torch.Tensor) -> None:
        self.scale = weight_scale(weight)
        self.packed = native_int8.pack(weight_int8(weight, self.scale), float(sums_scale(self.scale)), TOKEN_ZERO)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, path: str | None = None,
               gelu: bool = False) -> torch.Tensor:
        """TokenwiseInt8Linear's output; `path`: one of native_int8.PATHS (default: the CPU's quickest); `gelu`:
        GPT-2's tanh GELU of it in the same call."""
        return native_int8.linear(self.packed, x, bias, TOKEN_INVERSE, TOKEN_ZERO, path, gelu)

    def int8_weight(self) -> tuple[torch.Tensor, float]:
        """The int8 weight (out x in) and its scale."""
        return self.packed.int8(), self.scale


def sums_scale(scale: float) -> torch.Tensor:
    """The float32 factor fbgemm dequantizes a product's integer sums by, for a weight at `scale`: the float32
    TOKEN_SCALE times the float32 weight scale (OneDNNProduct's)."""
    return torch.tensor(TOKEN_SCALE, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)


def weight_int8(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """`weight` in int8 at `scale` as torch's quantize_per_tensor rounds it: times the float32 inverse of the float32
    scale, to nearest even."""
    inverse = float(1 / torch.tensor(scale, dtype=torch.float32))
    return (weight.detach().float() * inverse).round_().clamp_(-128, 127).to(torch.int8)


def activations_uint8(x: torch.Tensor) -> torch.Tensor:
    """`x` (within [-1, 1]) as fbgemm quantizes it: round(x * TOKEN_INVERSE + TOKEN_ZERO), the multiply-add rounded
    once to float32 (its fused multiply-add; exact in float64, then rounded), ties to even."""
    return x.double().mul_(TOKEN_INVERSE).add_(TOKEN_ZERO).float().round_().clamp_(0, 255).to(torch.uint8)


def product_kernel() -> type:
    """The kernel int8 products are computed with here: ours where it is built and the CPU has AVX512-VNNI (where
    it measured quicker than fbgemm's at every batch), else this torch's (native_int8.py: its AVX2 path is slower
    than fbgemm's past one row)."""
    if native.built() is not None and "vnni" in native_int8.cpu_paths():
        return NativeProduct
    return torch_kernel()


def torch_kernel() -> type:
    """The kernel this torch computes int8 products with: fbgemm's where torch.ao's ops are here, else oneDNN's."""
    if not hardware.missing_int8_kernels():
        return FbgemmProduct
    if not hardware.missing_onednn_int8_kernels():
        return OneDNNProduct
    raise RuntimeError(f"this torch lacks {', '.join(hardware.missing_int8_kernels())} and "
                       f"{', '.join(hardware.missing_onednn_int8_kernels())}: no int8 product can be computed here")


class TokenwiseInt8Linear(nn.Module):
    """A Linear in int8 whose output for a token does not depend on the other tokens of the batch.

    torch's dynamic quantized Linear quantizes its input with the range of the whole input tensor, so a text's
    tokens were rounded differently beside other texts than alone.  Here each token's activations are divided by
    their largest size, so each spans [-1, 1], and quantized with one fixed scale (TOKEN_SCALE) by a kernel that
    takes the scale it is given (module docstring): the integer product is exact, and the token's size is
    multiplied back.  7 bits, as torch's dynamic form on x86: an 8-bit activation times an int8 weight, summed in
    pairs, can pass the 16 bits an AVX2 CPU without VNNI sums them in.  On torch's kernels it costs a few
    elementwise operations a call (RESULTS.md): the form of a seeded or greedy call and of the server, where a text
    must be the same in any batch; on ours (NativeProduct) they are in its call, and it is every int8 view's form
    (views.int8_linear).  Weights int8 per tensor, as torch's are; `kernel`: NativeProduct, FbgemmProduct or
    OneDNNProduct (default: product_kernel's); `alone`: whether the stepping decoder's attention computes each of
    its rows alone too (a text the same in any batch), read by stepping.Step."""

    def __init__(self, linear: nn.Linear, kernel: type | None = None, alone: bool = True) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.product: Any = (kernel or product_kernel())(weight)
        self.each_token_alone = alone
        # fp32, as the product's output it is added to (the native kernel reads it as floats)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.linear(x, self.bias)

    def stepping_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward, its kernel and bias bound (stepping.called: the stepping decoder's ~100 calls a token)."""
        return functools.partial(self.product.linear, bias=self.bias)

    def then_tanh_gelu(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """This Linear and GPT-2's tanh GELU after it as one call, where the kernel computes both (ours: aten's
        GELU takes ~8 us a row of 4,096 here, ~4% of an 8-row 355M step; HISTORY.md, twenty-first session); else
        None."""
        if not isinstance(self.product, NativeProduct):
            return None
        return functools.partial(self.product.linear, bias=self.bias, gelu=True)
