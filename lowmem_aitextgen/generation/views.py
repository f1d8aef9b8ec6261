"""The views generate() decodes with: a copy of the model in a form's dtype, or its int8 view, each sharing no tensor
it changes with the model (forms.py says which form takes which; decoding.py plans and holds them).

int8 is every projection and the LM head with weights int8 per tensor (per-channel weights measured 30% slower a
projection at batch 1 on fbgemm's kernel) and activations quantized at run time.  On our own kernel (int8_kernels.py,
native_int8.py: where gcc builds it on a CPU with AVX512-VNNI) every view quantizes each token's activations alone
(TokenwiseInt8Linear), the quickest form there; on torch's, a view is torch's dynamic quantization (the rows of a
batch share a range, so a text decoded beside others may differ from the one decoded alone by rounding where two
tokens are near equally likely) unless a text must be the same in any batch (`tokenwise`: the server's seeded
requests).  torch's kernels are fbgemm's through torch.ao.quantization, which torch has deprecated: on a torch
without them (hardware.missing_int8_kernels) every projection is a TokenwiseInt8Linear on oneDNN's kernel (what
torchao's x86 int8 path lowers to; the same integer products), and without both the plan takes the next form,
naming what is missing.
GPT-2's projections are transformers' Conv1D, which torch's quantizer skips, so the view holds them as
nn.Linear.  Per-tensor activation scales lose the small channels where a few channels are tens of times
larger than the rest, as in the released GPT-2 (LLM.int8(),
SmoothQuant): the view first moves the scale of the inputs of the projections that read a layer norm into
their weights (SmoothQuant's migration, with the channel sizes read from the layer norm's weight and bias, no
calibration data), which leaves the fp32 function unchanged.  A form is chosen by default only where the
quality study (benchmarks/generate_quality.py, tests/test_decoding.py) measured it within QUALITY_BOUND of
fp32's held-out loss on a trained model and on the same model carrying such outliers.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import int8_kernels
from .int8_kernels import TokenwiseInt8Linear
from .packed16 import NativeBf16Linear, pack_projections

SMOOTHING = 0.5  # SmoothQuant's alpha: the share of an input channel's size moved into the weight
# the families whose int8 view is made and measured: in each block, a layer norm and the projections that read
# it (their input channels smoothed together); every other projection of a block is quantized as it is
SMOOTHED: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "gpt2": (("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
    "gpt_neo": (("ln_1", ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj")),
                ("ln_2", ("mlp.c_fc",))),
}


def held_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (a 4-bit base's packed ones aside)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def sixteen_bit_view(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` in `dtype`; on a CPU in bf16, its projections packed for our bf16 kernel, and its LM head
    too, or else for oneDNN's (packed16.py: 1.5-1.6x at 355M, ours 1.4-1.5x that)."""
    view = copy.deepcopy(model).to(dtype).eval()
    if dtype == torch.bfloat16 and next(view.parameters()).device.type == "cpu":
        replaced = pack_projections([(parent, name) for block in blocks_of(view) for parent in block.modules()
                                     for name, child in parent.named_children() if _is_projection(child)])
        if replaced and isinstance(replaced[0][1], NativeBf16Linear) and isinstance(view.lm_head, nn.Linear):
            replaced += pack_projections([(view, "lm_head")])  # (packed16.head_copied: ours reads it quicker)
        for projection, packed in replaced:
            carry_hooks(projection, packed)
    return view


def int8_view(model: nn.Module, tokenwise: bool = False) -> nn.Module:
    """The model with each projection of its blocks an int8 dynamically quantized Linear, the layer norms'
    outlier channels moved into the projections that read them first (smooth), the LM head quantized too.
    Held in fp32, the original's embeddings are shared (read-only here); held in 16 bits, every weight not
    quantized is copied to fp32 (the int8 kernels take fp32 activations), the 16-bit model untouched."""
    projections = {id(m.weight): m.weight for block in blocks_of(model) for m in block.modules() if _is_projection(m)}
    shared = {id(p): p for p in model.parameters()} if held_dtype(model) == torch.float32 else dict(projections)
    view = copy.deepcopy(model, memo=shared).eval()  # deepcopy shares them; the parts changed are replaced
    for module in view.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and id(parameter) not in shared and parameter.dtype != torch.float32:
                module._parameters[name] = nn.Parameter(parameter.detach().float(), requires_grad=False)
    for block in blocks_of(view):
        quantize_block(block, view.config, tokenwise)
    return with_int8_head(view, tokenwise)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks: its ModuleList of num_hidden_layers modules (GPT-2's and GPT-Neo's
    transformer.h)."""
    return next(m for m in model.modules()
                if isinstance(m, nn.ModuleList) and len(m) == model.config.num_hidden_layers)


def _blocks_name(model: nn.Module) -> str:
    blocks = blocks_of(model)
    return next(name for name, m in model.named_modules() if m is blocks)


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def int8_view_from(deferred: Any, tokenwise: bool = False) -> nn.Module | None:
    """The int8 view read straight from a saved folder (loading.DeferredModel), a block at a time: each block
    is quantized once its last tensor is read and its fp32 weights freed, so the fp32 model is never whole in
    memory (GPT-2 1558M: 6.2 GB of fp32 for 1.6 GB of int8).  None where the file cannot be read so."""
    from ..heap import release_freed_heap

    prefix = _blocks_name(deferred.skeleton) + "."
    left = Counter(_block_of(name, prefix) for name, _ in deferred.skeleton.named_parameters())

    def each(model: nn.Module, name: str, parameter: nn.Parameter) -> None:
        index = _block_of(name, prefix)
        left[index] -= 1
        if index is not None and not left[index]:
            quantize_block(blocks_of(model)[index], model.config, tokenwise)
            gc.collect(1)  # the float modules replaced may sit in young reference cycles: free them now
            release_freed_heap()

    view = deferred.read(torch.float32, each)
    return None if view is None else with_int8_head(view, tokenwise)


def _block_of(name: str, prefix: str) -> int | None:
    """The index of the block a parameter's name is in (`prefix`: the blocks' name and a dot), or None
    (embeddings, the final norm)."""
    return int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) else None


def quantize_block(block: nn.Module, config: Any, tokenwise: bool = False) -> None:
    """One block, in place: its projections as int8 Linears (new weights: the block's own are no longer held
    by it), those that read a layer norm smoothed with it first (SMOOTHED, for the model's family)."""
    for norm_name, names in SMOOTHED.get(config.model_type, ()):
        norm, linears = smooth(block.get_submodule(norm_name), [linear_of(block.get_submodule(n)) for n in names])
        block.set_submodule(norm_name, norm)
        for name, linear in zip(names, linears):
            block.set_submodule(name, int8_linear(linear, tokenwise))
    for name, module in list(block.named_modules()):
        if _is_projection(module):
            block.set_submodule(name, int8_linear(linear_of(module), tokenwise))


def with_int8_head(view: nn.Module, tokenwise: bool = False) -> nn.Module:
    """The LM head as an int8 Linear made from its (tied) weight; the embedding keeps the original."""
    weight = view.lm_head.weight
    if getattr(view.config, "tie_word_embeddings", True):  # read from a folder, only the embedding's is read
        weight = view.get_input_embeddings().weight
    view.lm_head = int8_linear(_new_linear(weight.detach().float(), None, view.lm_head), tokenwise)  # read only
    return view.eval()


def int8_linear(linear: nn.Linear, tokenwise: bool) -> nn.Module:
    """`linear` in int8: TokenwiseInt8Linear where a text must be the same in any batch (`tokenwise`: its
    attention then each row alone too), where the kernel is ours (the quickest, in any call) or where torch.ao's ops
    are missing (on oneDNN's kernel); else torch's dynamic quantized Linear (the activations' range that of the
    whole batch: the quickest of torch.ao's)."""
    kernel = int8_kernels.product_kernel()
    if tokenwise or kernel is not int8_kernels.FbgemmProduct:
        module = TokenwiseInt8Linear(linear, kernel, alone=tokenwise)
        carry_hooks(linear, module)
        return module
    holder = nn.Module()  # the quantizer swaps a module's children, not the module it is given
    holder.linear = linear
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice: not the user's business
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(holder, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return holder.linear


def linear_of(conv: nn.Module) -> nn.Linear:
    """transformers' Conv1D (x @ W + b, W as in x out) as a new nn.Linear (the weight a copy, changed by
    smooth)."""
    if isinstance(conv, nn.Linear):
        return _new_linear(conv.weight.detach().float().clone(), conv.bias, conv)
    return _new_linear(conv.weight.detach().float().t().contiguous(), conv.bias, conv)


HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
         "_forward_hooks_always_called")


def carry_hooks(module: nn.Module, to: nn.Module) -> None:
    """`module`'s forward hooks on `to`, its replacement in a view: a hook on the model's projection or LM head
    runs in the view too."""
    for hooks in HOOKS:
        getattr(to, hooks).update(getattr(module, hooks))


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Module) -> nn.Linear:
    """A Linear of `weight` and a copy of `bias`, with the forward hooks `like` has."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    carry_hooks(like, linear)
    return linear


def smooth(norm: nn.LayerNorm, linears: list[nn.Linear]) -> tuple[nn.LayerNorm, list[nn.Linear]]:
    """A new layer norm and Linears computing what they did, each input channel j divided by s_j at the norm
    and multiplied by s_j in every weight that reads it: s_j = size_j^a / max|W_j|^(1-a), size_j from the
    norm's |weight| + |bias| (its output's channel size, as normalized inputs are of one size), max|W_j| over
    all the Linears (GPT-Neo's query, key and value read one norm)."""
    bias = norm.bias.detach().float() if norm.bias is not None else torch.zeros_like(norm.weight, dtype=torch.float)
    size = (norm.weight.detach().float().abs() + bias.abs()).clamp(min=1e-5)
    weight_size = torch.stack([linear.weight.abs().amax(dim=0) for linear in linears]).amax(dim=0).clamp(min=1e-5)
    scale = (size.pow(SMOOTHING) / weight_size.pow(1 - SMOOTHING)).clamp(min=1e-5)
    new = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, device=norm.weight.device)
    with torch.no_grad():
        new.weight.copy_(norm.weight.float() / scale)
        new.bias.copy_(bias / scale)
        for linear in linears:
            linear.weight.mul_(scale)  # a copy of the original's weight (linear_of)
    new.requires_grad_(False)
    return new, linears


def carry_outliers(model: nn.Module, channels: list[int], scale: float) -> nn.Module:
    """`model` (GPT-2, changed in place) computing the same function with a few input channels of every
    projection that reads a layer norm `scale` times larger, as the released GPT-2's are: those channels of
    the norm's weight and bias times `scale`, the matching input rows of the projection divided by it
    (SmoothQuant's migration run backwards).  For the quality study: a per-tensor int8 form loses the small
    channels of such a model, where fp32's outputs are unchanged."""
    with torch.no_grad():
        for block in model.transformer.h:
            for norm, projection in ((block.ln_1, block.attn.c_attn), (block.ln_2, block.mlp.c_fc)):
                norm.weight[channels] *= scale
                norm.bias[channels] *= scale
                projection.weight[channels, :] /= scale  # Conv1D: (in, out)
    return model
