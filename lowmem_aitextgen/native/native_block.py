"""A step's GPT-2 blocks for one new token a row in one call of our own kernels (gpt2_block.c, built by native.py),
for an int8 view or a bf16 view on them: the stepping decoder's blocks, when a step is only the running rows' one
token each.

Why: at batch 1 a 355M step's products are ~10 ms of ~15, and most of the rest was Python around a block's dozen
calls, each slowed 2-3x by the caches the weights' stream empties (HISTORY.md, twenty-fourth session).  Here a
block's step is one call of the kernels the stepping decoder calls one by one (int8_linear.c or bf16_linear.c,
one_token_attention.c, which writes the step's keys and values into the cache itself): the same bits; and the
blocks one after the other in the same call (each layer's cache's addresses from kv_cache.Slots.addresses, made once
a buffer), none of the Python between them (~0.1 ms of a 355M token, HISTORY.md, twenty-sixth session).  Its layer
norm is gpt2_block.c's, and the stepping decoder calls that one (`norm`) for such a view's block norms in every
other step too (a prompt, a step beside a joining prompt), so that a row's text is its own whichever way its steps
go.  A bf16 view's residual stream stays in bf16, each operation rounded as torch's bf16 one (its GELU the
kernel's, packed16.NativeBf16Linear.then_tanh_gelu, in every pass too).

| takes                                               | else                                                     |
|-----------------------------------------------------|----------------------------------------------------------|
| a GPT-2 int8 view on our kernel: every projection a | stepping.Step's calls one by one, torch's layer norm     |
| TokenwiseInt8Linear on NativeProduct, the norms     |                                                          |
| plain fp32 LayerNorms; or a bf16 view on ours:      |                                                          |
| every projection a NativeBf16Linear, the norms      |                                                          |
| plain bf16 LayerNorms; GPT-2's tanh GELU, nothing   |                                                          |
| hooked (stepping.Step checks), our attention here   |                                                          |
| a step of one token a row, each row's places the    | stepping.Step's calls one by one, this file's norm      |
| cache's last (no prefix row gathered), activations  |                                                          |
| in the blocks' dtype, every layer's cache a         |                                                          |
| kv_cache.Slots                                      |                                                          |
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..generation.int8_kernels import TOKEN_INVERSE, TOKEN_ZERO, NativeProduct, TokenwiseInt8Linear
from ..generation.packed16 import NativeBf16Linear
from . import native, native_attention, native_int8
from .native import FLOAT, INT, POINTER

# gpt2_block.c's exports, as lowmem_kernels.h declares them (native.bound declares them on the library)
SIGNATURES = {
    "lowmem_layer_norm": (None, [POINTER, INT, INT, INT, POINTER, POINTER, FLOAT, POINTER, INT]),
    "lowmem_gpt2_blocks_step": (INT, [POINTER, INT, POINTER, INT, POINTER, POINTER, INT, POINTER, POINTER, POINTER,
                                      POINTER, INT, INT]),
    "lowmem_layout": (INT, [POINTER, INT]),
}


class _Product(ctypes.Structure):
    """lowmem_kernels.h's lowmem_product: an int8 projection as int8_linear.c takes it (its layout checked against
    the C's: lowmem_layout)."""

    _fields_ = [("weights", ctypes.c_void_p), ("zero_sums", ctypes.c_void_p), ("n", ctypes.c_int),
                ("k", ctypes.c_int), ("kp", ctypes.c_int), ("scale", ctypes.c_float), ("bias", ctypes.c_void_p)]


class _Block(ctypes.Structure):
    """lowmem_kernels.h's lowmem_gpt2_block: a block's parts, read once (its layout checked against the C's)."""

    _fields_ = [("norm1_weight", ctypes.c_void_p), ("norm1_bias", ctypes.c_void_p), ("norm2_weight", ctypes.c_void_p),
                ("norm2_bias", ctypes.c_void_p), ("norm1_eps", ctypes.c_float), ("norm2_eps", ctypes.c_float),
                ("qkv", _Product), ("out", _Product), ("fc", _Product), ("proj", _Product), ("heads", ctypes.c_int),
                ("hs", ctypes.c_int), ("scale", ctypes.c_float), ("inverse", ctypes.c_float),
                ("zero", ctypes.c_float), ("bf16", ctypes.c_int)]


@dataclass(frozen=True)
class BlockStep:
    """One block as gpt2_block.c's call takes it; `modules`: what its pointers point into, held while it is."""

    parts: _Block
    modules: tuple[nn.Module, ...]
    scratch: int  # floats a row: the norm's output or attention's, the query-key-value, the MLP's inner width


class Blocks:
    """A model's blocks as the step's one call takes them (`steps`): each BlockStep, and the array of their parts'
    addresses, made once; `dtype`: their residual stream's (float32: an int8 view's; bfloat16: a bf16 view's)."""

    def __init__(self, made: list[BlockStep]) -> None:
        self.steps = tuple(made)
        self.parts = (ctypes.c_void_p * len(made))(*[ctypes.addressof(step.parts) for step in made])
        self.scratch = made[0].scratch
        self.dtype = torch.bfloat16 if made[0].parts.bf16 else torch.float32


def available() -> bool:
    """Whether the call runs here: our kernels built, our attention kernel on this CPU."""
    return native.built() is not None and native_attention.available()


def block_step(block: nn.Module, scale: float, heads: int, head_size: int, tanh: bool) -> BlockStep | None:
    """`block` (a GPT-2 block of an int8 or bf16 view) as one call, or None where it is not made of what the call
    computes (module docstring); `scale`: its attention scores' factor; `tanh`: whether its activation is GPT-2's
    tanh GELU; hooks are the caller's to have looked for."""
    norms = (block.ln_1, block.ln_2)
    projections = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
    dtype = torch.bfloat16 if all(isinstance(p, NativeBf16Linear) for p in projections) else torch.float32
    if not tanh or not all(_plain_norm(norm, dtype) for norm in norms) or not all(_ours(p, dtype) for p in projections) \
            or head_size % 16 or head_size > native_attention.MOST_HEAD:
        return None
    qkv, out, fc, proj = (_product(p) for p in projections)
    if qkv.n != 3 * qkv.k or out.k != qkv.k or fc.k != qkv.k or proj.k != fc.n or proj.n != qkv.k \
            or heads * head_size != qkv.k:
        return None
    parts = _Block(block.ln_1.weight.data_ptr(), block.ln_1.bias.data_ptr(), block.ln_2.weight.data_ptr(),
                   block.ln_2.bias.data_ptr(), block.ln_1.eps, block.ln_2.eps, qkv, out, fc, proj, heads, head_size,
                   scale, TOKEN_INVERSE, float(TOKEN_ZERO), int(dtype == torch.bfloat16))
    return BlockStep(parts, (*norms, *projections), qkv.k + qkv.n + fc.n)


def steps(blocks: Blocks, x: torch.Tensor, layers: list[Any], places: torch.Tensor) -> torch.Tensor:
    """`x` (rows, width; the blocks' dtype, each row's one new token) through every block, in place, in one call:
    each layer's keys and values written to its cache layer (`layers`: kv_cache's slot layers, the rows' own) and
    attended over each row's last `places` (int32, one a row)."""
    if not torch.is_inference_mode_enabled():  # the caches' buffers are written only in inference mode
        with torch.inference_mode():
            return steps(blocks, x, layers, places)
    rows, count = x.shape[0], len(blocks.steps)
    if len(layers) != count:
        raise ValueError(f"native_block.steps: {len(layers)} cache layers for {count} blocks: one a block is needed")
    scratch = torch.empty(rows * blocks.scratch)
    path, threads = native_int8.PATHS.index(native_int8.path_for(rows)), torch.get_num_threads()
    keys, values = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
    strides, widths = (ctypes.c_long * (3 * count))(), (ctypes.c_int * count)()
    for i, layer in enumerate(layers):
        held = layer.room(1)
        key_address, value_address, held_strides, size = held.addresses()
        at = held.start * held_strides[2] * size
        keys[i], values[i] = key_address + at, value_address + at
        strides[3 * i:3 * i + 3] = held_strides
        widths[i] = held.end + 1 - held.start
    bf16 = int(layers[0].slots.both.dtype == torch.bfloat16)  # (one dtype for all: the engine's cache_dtype)
    done = native.bound(SIGNATURES).lowmem_gpt2_blocks_step(blocks.parts, count, x.data_ptr(), rows, keys, values, bf16, strides,
                                                  widths, places.data_ptr(), scratch.data_ptr(), path, threads)
    if done == -2:
        raise ValueError(f"native_block.steps: places={places.tolist()}: each row's must be within the cache's "
                         f"{min(widths)}")
    if done:
        raise MemoryError("lowmem_aitextgen's kernels could not allocate their scratch memory (a block's step)")
    for layer in layers:
        layer.wrote(1)
    return x


def norm(module: nn.LayerNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt2_block.c's layer norm of `module` (inputs in its weight's dtype: fp32 or bf16), as the block step computes
    it (module docstring)."""
    call = functools.partial(_norm, module.weight, module.bias, module.eps)
    call.stepping_module = module  # (stepping.module_of: the module a call computes)
    return call


def _norm(weight: torch.Tensor, bias: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    rows = x if x.dtype == weight.dtype and x.is_contiguous() else x.to(weight.dtype).contiguous()
    out = torch.empty_like(rows)
    native.bound(SIGNATURES).lowmem_layer_norm(rows.data_ptr(), int(weight.dtype == torch.bfloat16),
                                     rows.numel() // weight.numel(), weight.numel(), weight.data_ptr(),
                                     bias.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def _plain_norm(module: nn.Module, dtype: torch.dtype) -> bool:
    return type(module) is nn.LayerNorm and module.weight is not None and module.bias is not None \
        and all(t.dtype == dtype and t.is_contiguous() and t.is_cpu for t in (module.weight, module.bias)) \
        and tuple(module.normalized_shape) == (module.weight.numel(),)


def _ours(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether `module` is a projection on our kernel for a residual stream in `dtype` (int8_linear.c's for fp32,
    bf16_linear.c's for bf16), its bias in that dtype."""
    if dtype == torch.bfloat16:
        kernel = isinstance(module, NativeBf16Linear)
    else:
        kernel = isinstance(module, TokenwiseInt8Linear) and isinstance(module.product, NativeProduct)
    return kernel and (module.bias is None or (module.bias.dtype == dtype and module.bias.is_contiguous()))


def _product(module: TokenwiseInt8Linear | NativeBf16Linear) -> _Product:
    bias = None if module.bias is None else module.bias.data_ptr()
    if isinstance(module, NativeBf16Linear):
        packed = module.packed
        return _Product(packed.weights.data_ptr(), None, packed.n, packed.k, packed.k, 0.0, bias)
    packed = module.product.packed
    return _Product(packed.weights.data_ptr(), packed.zero_sums.data_ptr(), packed.n, packed.k, packed.kp,
                    packed.scale, bias)
