"""A compiled step that gives the eager step's bits (issue 54): the default seeded generate() of a 355M GPT-2
(random weights: speed only) against the same call with each one-token step of its int8 view one inductor graph,
batch 1 and 8, alternating round by round; the texts compared token for token.

    python benchmarks/compiled_step.py --rounds 3 --references --no-repack

The graph computes each projection as fbgemm does, from the same integers: each token's activations divided by
their size and rounded as fbgemm rounds them (int8_kernels.activations_uint8's arithmetic), the int8 weight's
integer sums by torch._int_mm, dequantized by the same float32 scale.  Integer sums are exact in any order, so
inductor may compute them with its C++ GEMM template (mode max-autotune, weights frozen: its int8 pattern hands
the product to the template's AMX or AVX-512 micro-kernels) and the output is still eager's, bit for bit.  What
inductor would round otherwise is left to aten's own kernels: the layer norms and GELU are not decomposed, so
the graph calls aten's (`--norms custom`: a custom op each instead, a Python call; `--norms inductor`: inductor's
fused code, not eager's bits, to show what they cost), and the attention over the engine's cache is a custom op
calling the stepping decoder's own (its cache writes, its rows attending alone).  Two roundings follow eager's
order only where eager's order is changed first: the template multiplies a product by the token's size, then the
bias is added, where TokenwiseInt8Linear's addcmul does both in one fused multiply-add; so every path but "ours,
default" runs TokenwiseInt8Linear with the bias added apart (`rounded_apart`), the compiled step's tokens are
compared with that eager form's, and its eager cost is a path of its own.  A one-row step runs as two rows (a
zero row beside it): in a one-row graph inductor's pattern folds the token's size into the product's scale,
which rounds differently.

A probe of a form not built: the graphs are compiled per number of rows at the first step of each (the time and
the memory after are printed, not hidden), prompts stay eager, GPT-2 only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lowmem_aitextgen import aitextgen, hardware, stepping  # noqa: E402
from lowmem_aitextgen.heap import release_freed_heap  # noqa: E402
from lowmem_aitextgen.int8_kernels import TOKEN_SCALE, TOKEN_ZERO, TokenwiseInt8Linear, activations_uint8  # noqa: E402

OPS = "lowmem_compiled_step"
_CALL = threading.local()  # the step a compiled graph's attention belongs to, while it runs
_LIBRARY: list[torch.library.Library] = []


def define_ops() -> None:
    """The custom ops of the graph, defined once: the attention, and (--norms custom) the layer norm and GELU."""
    if _LIBRARY:
        return
    library = torch.library.Library(OPS, "DEF")
    ops = {
        "attend(Tensor qkv, int layer) -> Tensor": (_attend, lambda qkv, layer: qkv.new_empty(qkv.shape[0],
                                                                                             qkv.shape[1] // 3)),
        "layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor": (
            lambda x, weight, bias, eps: F.layer_norm(x, (x.shape[-1],), weight, bias, eps),
            lambda x, weight, bias, eps: torch.empty_like(x)),
        "gelu_tanh(Tensor x) -> Tensor": (lambda x: F.gelu(x, approximate="tanh"), torch.empty_like),
    }
    for schema, (real, fake) in ops.items():
        library.define(schema)
        name = schema.split("(")[0]
        library.impl(name, real, "CPU")
        library.impl(name, fake, "Meta")
    _LIBRARY.append(library)


def _attend(qkv: torch.Tensor, layer: int) -> torch.Tensor:
    """The stepping decoder's attention of layer `layer` for the step running (its cache written), padding rows
    given zeros."""
    step, part, masks, rows = _CALL.now
    out = step._attend([qkv[:rows]], part, layer, step.windows[layer], masks, step.layers[layer].scale)
    return out if rows == qkv.shape[0] else torch.cat([out, out.new_zeros(qkv.shape[0] - rows, out.shape[1])])


class Weights:
    """A TokenwiseInt8Linear's int8 weight (in x out), the float32 scale of its sums (one a column, as inductor's
    int8 pattern takes it) and its bias, read out of fbgemm's packed weight."""

    def __init__(self, linear: torch.nn.Module) -> None:
        weight, _ = torch.ops.quantized.linear_unpack(linear.product.packed)
        combined = torch.tensor(TOKEN_SCALE, dtype=torch.float32) * torch.tensor(weight.q_scale(),
                                                                                 dtype=torch.float32)
        self.int8 = weight.int_repr().t()
        self.scales = combined.expand(weight.shape[0]).contiguous()
        self.bias = linear.bias


def product(weights: Weights, x: torch.Tensor) -> torch.Tensor:
    """TokenwiseInt8Linear's output, computed from the integers fbgemm computes (module docstring)."""
    size = x.abs().amax(-1, True).clamp_min(1e-12)
    centred = activations_uint8(x / size).to(torch.int8).sub_(TOKEN_ZERO)  # 1..127 less the zero point
    sums = torch._int_mm(centred, weights.int8)
    # written as inductor's int8 pattern reads it (the x scale, then the weight's), which it computes as fbgemm
    # does: the sums times the weight's scale, then times the size
    out = sums.float() * size * weights.scales
    return out if weights.bias is None else out + weights.bias


def rounded_apart(self: TokenwiseInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """TokenwiseInt8Linear.forward with its bias added after the token's size is multiplied back, a rounding
    each: its addcmul rounds the two once, a fused multiply-add, which inductor's CPU code has no form of (it
    lowers addcmul to a multiply and an add), so a graph can give this form's bits and not addcmul's."""
    size = x.abs().amax(-1, True).clamp_min_(1e-12)
    out = self.product(x / size).mul_(size)
    return out if self.bias is None else out.add_(self.bias)


NORMS = {"how": "aten"}  # --norms: how the graph computes the layer norms and GELU (main's help)


def norm(module: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if NORMS["how"] == "custom":
        return torch.ops.lowmem_compiled_step.layer_norm(x, module.weight, module.bias, module.eps)
    return F.layer_norm(x, (x.shape[-1],), module.weight, module.bias, module.eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    if NORMS["how"] == "custom":
        return torch.ops.lowmem_compiled_step.gelu_tanh(x)
    return F.gelu(x, approximate="tanh")


def body(step: stepping.Step, weights: dict[int, Weights], x: torch.Tensor) -> torch.Tensor:
    """The logits of a one-token step from its tokens' embeddings (rows, width): GPT-2's blocks as the stepping
    decoder computes them; `weights`: each projection's, by the id of its module."""
    def projected(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return product(weights[id(module)], x)

    for index, block in enumerate(step.blocks):
        qkv = projected(block.attn.c_attn, norm(block.ln_1, x))
        x = x + projected(block.attn.c_proj, torch.ops.lowmem_compiled_step.attend(qkv, index))
        hidden = gelu(projected(block.mlp.c_fc, norm(block.ln_2, x)))
        x = x + projected(block.mlp.c_proj, hidden)
    return projected(step.model.lm_head, norm(step.transformer.ln_f, x))


def compiled(step: stepping.Step, rows: int) -> object:
    """`body` for `rows` rows as one inductor graph, its weights frozen, max-autotune."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    define_ops()
    example = torch.zeros(rows, step.transformer.wte.weight.shape[1])
    modules = [m for block in step.blocks for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc,
                                                     block.mlp.c_proj)] + [step.model.lm_head]
    weights = {id(m): Weights(m) for m in modules}
    graph = make_fx(lambda x: body(step, weights, x), tracing_mode="fake", _allow_non_fake_inputs=True)(example)
    # not decomposed, inductor calls aten's own kernels for them: eager's bits ("inductor": its fused code)
    kept = () if NORMS["how"] == "inductor" else (torch.ops.aten.native_layer_norm.default, torch.ops.aten.gelu.default)
    table = {op: f for op, f in select_decomp_table().items() if op not in kept}
    # the weights as traced are dropped once frozen into the graph (~340 MiB a graph at 355M, measured)
    options = {"freezing": True, "max_autotune": True, "freezing_discard_parameters": True}
    with templates_compiled_once():
        return compile_fx(graph, [example], config_patches=options, decompositions=table)


@contextlib.contextmanager
def templates_compiled_once() -> object:
    """inductor compiling each jinja string of its GEMM template once: it compiles them again for each projection
    rendered (2,157 compiles in a 355M step's graph, 48 s of a 130 s profiled compile), and a compiled jinja
    template renders the same for any arguments."""
    from torch._inductor.codegen.common import KernelTemplate

    once = staticmethod(functools.lru_cache(maxsize=None)(KernelTemplate._template_from_string))
    with mock.patch.object(KernelTemplate, "_template_from_string", once):
        yield


PROMPT = "The meaning of a word is what it names"  # every path's, the references' too
GRAPHS: dict[int, dict[int, object]] = {}


def resident_mib() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def together(original: object) -> object:
    """Step.together with each one-token step of one part run by its compiled graph (made at the first step of
    each number of rows)."""
    def run(step: stepping.Step, parts: list[stepping.Part]) -> list[torch.Tensor]:
        if len(parts) != 1 or parts[0].ids.shape[1] != 1:
            return original(step, parts)
        part = parts[0]
        rows = part.ids.shape[0]
        graphs = GRAPHS.setdefault(id(step.model), {})  # the engine makes a Step a call; the view stays
        height = max(rows, 2)  # module docstring: one row runs as two
        if height not in graphs:
            start = time.perf_counter()
            with torch.inference_mode():
                graphs[height] = compiled(step, height)
            peak = resident_mib()
            release_freed_heap()  # what compiling freed, given back: the graph's own memory is what stays
            print(json.dumps({"rows": height, "compile s": round(time.perf_counter() - start, 1),
                              "resident MiB once compiled": peak, "and after the freed heap is released":
                              resident_mib()}), flush=True)
        x = (step.embeddings(part.ids) + step.positions(part.positions)).reshape(rows, -1)
        if rows < height:
            x = torch.cat([x, x.new_zeros(height - rows, x.shape[1])])
        masks = (stepping.seen_places(part.mask.to(part.ids.device), 1, step.windows), step._rows_own(part))
        _CALL.now = (step, part, masks, rows)
        try:
            logits = graphs[height](x)
        finally:
            _CALL.now = None
        return [logits[:rows, None]]
    return run


def texts(ai: aitextgen, batch: int, new: int) -> list[str]:
    """The default seeded call's texts (the server's form: each token alone)."""
    return ai.generate(n=batch, prompt=PROMPT, max_new_tokens=new, min_new_tokens=new, return_as_list=True,
                       nonempty_output=False, seed=1)


def main() -> None:
    import generate_speed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--norms", choices=("aten", "custom", "inductor"), default="aten",
                        help="the layer norms and GELU: aten's kernels called from the graph (not decomposed: "
                        "eager's bits), custom ops calling them (eager's bits, a Python call each), or inductor's "
                        "own fused code (not eager's bits: what the others cost)")
    parser.add_argument("--references", action="store_true", help="transformers' fp32 generate() and llama.cpp's "
                        "Q8_0 in the same rounds (llamacpp_speed.py's build and converter)")
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp's --repack 0 (llamacpp_speed.py)")
    args = parser.parse_args()
    NORMS["how"] = args.norms
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    apart = mock.patch.object(TokenwiseInt8Linear, "forward", rounded_apart)
    with tempfile.TemporaryDirectory() as folder:
        generate_speed.saved_gpt2("355M", folder)
        objects = {name: aitextgen(model_folder=folder) for name in ("ours, default", "eager, bias added apart",
                                                                    "compiled step")}
        contexts = {"ours, default": contextlib.nullcontext, "eager, bias added apart": lambda: apart,
                    "compiled step": lambda: compiled_context(apart)}
        for name, ai in objects.items():
            texts(ai, 1, 1)
            print(json.dumps({"resident MiB, views made": resident_mib(), "of": name}), flush=True)
        paths = {name: ours_path(objects[name], contexts[name]) for name in objects}
        for batch in args.batches:  # the same tokens, and each number of rows compiled before it is timed
            with apart:
                expected = texts(objects["eager, bias added apart"], batch, 128)
            with compiled_context(apart):
                got = texts(objects["compiled step"], batch, 128)
            print(json.dumps({"batch": batch, "the same tokens as eager, bias added apart": got == expected}),
                  flush=True)
        if args.references:
            paths.update(references(folder, not args.no_repack))
        for batch in args.batches:
            samples: dict[str, list[dict]] = {name: [] for name in paths}
            for round_ in range(args.rounds):
                for name in sorted(paths, reverse=round_ % 2 == 1):
                    samples[name].append(paths[name](batch))
            for name, runs in samples.items():
                print(json.dumps({"size": "355M", "batch": batch, "path": name,
                                  **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}),
                      flush=True)


def compiled_context(apart: contextlib.AbstractContextManager) -> contextlib.ExitStack:
    """The compiled step's patches: its epilogue (rounded_apart) and Step.together."""
    stack = contextlib.ExitStack()
    stack.enter_context(apart)
    stack.enter_context(mock.patch.object(stepping.Step, "together", together(stepping.Step.together)))
    return stack


def ours_path(ai: aitextgen, context: Callable[[], contextlib.AbstractContextManager]
              ) -> Callable[[int], dict[str, float]]:
    """A timed seeded call of `ai` (llamacpp_speed.timed: 128 new tokens, the first token's time) under `context`."""
    import generate_speed
    import llamacpp_speed

    seeded = generate_speed.ours("auto", 1, PROMPT)

    def run(batch: int) -> dict[str, float]:
        with context():
            return llamacpp_speed.timed(lambda b, n: seeded(ai, None, b, n), batch)
    return run


def references(folder: str, repack: bool) -> dict[str, Callable[[int], dict[str, float]]]:
    """transformers' fp32 generate() (an object of its own) and llama.cpp's Q8_0 of the same folder."""
    import generate_speed
    import llamacpp_speed

    source, bin_dir = llamacpp_speed.llamacpp(os.path.expanduser("~/.cache/lowmem_aitextgen/llamacpp"))
    gguf = llamacpp_speed.converted(source, folder, "q8_0")
    threads, reference = torch.get_num_threads(), aitextgen(model_folder=folder)
    return {
        "transformers fp32": lambda batch: llamacpp_speed.timed(
            lambda b, n: generate_speed.transformers_fp32(reference, reference.model, b, n, PROMPT), batch),
        "llama.cpp Q8_0": lambda batch: (llamacpp_speed.llama_bench(bin_dir, gguf, threads, repack) if batch == 1
                                         else llamacpp_speed.llama_batched(bin_dir, gguf, threads, batch, repack)),
    }


if __name__ == "__main__":
    main()
