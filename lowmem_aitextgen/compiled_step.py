"""The compiled step: each one-token step of a seeded int8 view (TokenwiseInt8Linear on fbgemm's kernel) as one
inductor graph whose tokens are the eager step's, bit for bit, where a call runs enough steps to pay its compile.

How the graph keeps eager's bits: each projection is computed from the integers fbgemm computes (the token's
activations divided by their size and rounded as fbgemm rounds them, `torch._int_mm` of the same int8 weight,
the same float32 scale).  Integer sums are exact in any order, so inductor may hand them to its C++ GEMM
template (mode max-autotune with that template its only choice, weights frozen: its int8 pattern reads
`sums * size * scales`; oneDNN's kernel, the other choice, orders the scales' multiplies by shape) and the output
is unchanged; what inductor would round otherwise is left to aten's own kernels (the layer norms and GELU are not
decomposed), and the attention over the engine's cache is a custom op calling the stepping decoder's own.  A
graph is made for one number of rows (its `height`); fewer rows run beside zero rows, and a one-row step as two
(in a one-row graph inductor folds the token's size into the product's scale, which rounds differently).  The
first call checks the graph against the eager step on scratch rows and drops it where a single bit differs
(another CPU's kernels, another torch): a text is the same compiled or not.

| what            | measured (Intel Xeon with AMX, 2 cores; RESULTS.md, sixteenth and seventeenth sessions)       |
|-----------------|-----------------------------------------------------------------------------------------------|
| saves           | 355M: 0.99-1.20x the eager step at batch 1 (two runs), 1.24-1.30x at batch 8 (3.6-3.8x        |
|                 | transformers' fp32), ~1.17x an unseeded call's eager step (torch's dynamic int8) at batch 8;  |
|                 | 1558M: 1.04x at batch 1, 1.29x at batch 8 (4.4x transformers' fp32)                           |
| costs           | 48-56 s of compiling a graph at 355M, ~73-83 s at 1558M, every process (inductor's cache does |
|                 | not serve it); its packed weights, ~1.3x the view's int8 weights, while the view lives; ~5x   |
|                 | them at the compile's peak                                                                    |
| pays (`pays`)   | a call running PAYS_AFTER steps at its number of rows: generate_to_file or generate() of many |
|                 | texts; never a short call, a stream, or the server (rows vary; a compile would stall it)      |
| not compiled    | other forms (torch's dynamic int8, 16 bits), oneDNN's kernel, our own kernel (its eager step |
|                 | 1.05x the compiled one at 355M, batch 1 and 8: RESULTS.md, twenty-first session; so where    |
|                 | it is built, never), hooked modules, non-tanh GELU, a CPU without AMX (MEASURED_ISAS: the     |
|                 | gain unmeasured there), a missing C++ compiler or any failure to compile: the eager step,     |
|                 | said once a view                                                                              |
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

from .heap import release_freed_heap
from .int8_kernels import TOKEN_ZERO, FbgemmProduct, NativeProduct, TokenwiseInt8Linear, activations_uint8, sums_scale
from .kv_cache import new_cache
from .stepping import Part, Step, _tanh_gelu, module_of

logger = logging.getLogger("lowmem_aitextgen")

# steps at one number of rows after which a graph's compile pays (355M: 48-56 s; a step 0-6.5 ms quicker at one row
# in two runs, 9.7 ms at eight than an unseeded call's eager step; 1558M: ~73-83 s, 3.5 ms at one row and 42 ms at
# eight than the seeded eager step: it pays there after ~21,000 and ~2,000 steps, so the counts hold at one row and
# are cautious at several; end to end at 355M, generate_to_file of 200 texts of 256 tokens, 6,400 steps of eight,
# took 296 s against 334 s never compiled, its compile included)
PAYS_AFTER = {"one or two rows": 20000, "more": 6000}
MEASURED_ISAS = ("VecAMX",)  # inductor's code for the CPUs whose gain is measured (RESULTS.md)
PEAK = 5.2  # the compile's peak over the view's int8 weights (kept after: ~1.3x, within it; RESULTS.md)
OPS = "lowmem_aitextgen"
_CALL = threading.local()  # the step a graph's attention belongs to, while it runs
_LIBRARY: list[torch.library.Library] = []
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, tuple[int, Any]] = weakref.WeakKeyDictionary()  # a view's one graph


def pays(height: int, steps: int) -> bool:
    """Whether a call running about `steps` steps at `height` rows pays a graph's compile (module docstring)."""
    return steps >= PAYS_AFTER["one or two rows" if height <= 2 else "more"]


def steps_of(texts: int, at_once: int, length: int) -> int:
    """The steps a call of `texts` texts of `length` tokens runs, `at_once` at a time (at most)."""
    return math.ceil(texts / max(1, at_once)) * length


def not_compilable(step: Step) -> str | None:
    """Why `step`'s one-token steps cannot be compiled with eager's bits (None: they can)."""
    projections = _projections(step)
    modules = list(map(module_of, projections))
    if any(isinstance(getattr(m, "product", None), NativeProduct) for m in modules):
        return "its products are on our own kernel, whose eager step measured quicker than the compiled one"
    if not all(isinstance(m, TokenwiseInt8Linear) and m.each_token_alone and isinstance(m.product, FbgemmProduct)
               for m in modules):
        return "only a seeded int8 view on fbgemm's kernel is compiled"
    norms = [n for layer in step.layers for n in (layer.ln_1, layer.ln_2)] + [step.final_norm]
    if any(module_of(c) is c for c in (*projections, *norms)):  # stepping.called: a hooked module is its own call
        return "a module it would bypass has hooks"
    if any(layer.act is not _tanh_gelu for layer in step.layers):
        return "only GPT-2's tanh GELU is compiled"
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:  # a torch without inductor (or one that moved it)
        return "this torch has no inductor to compile with"
    isa = type(pick_vec_isa()).__name__
    return None if isa in MEASURED_ISAS else f"its gain is measured only where inductor's code is {MEASURED_ISAS} " \
        f"(here {isa})"


def _projections(step: Step) -> list[Any]:
    """Every projection a step calls (stepping.called's), the LM head last."""
    return [p for layer in step.layers for p in (*layer.qkv, layer.out, layer.fc, layer.proj)] + [step.head]


class CompiledStep(Step):
    """A Step whose one-token steps of up to `height` rows run as one graph (module docstring); everything else
    (prompts, several parts, more rows, a graph dropped) the eager step's."""

    def __init__(self, model: nn.Module, height: int, cache_dtype: torch.dtype | None = None) -> None:
        super().__init__(model)
        self.height, self.cache_dtype = height, cache_dtype

    def together(self, parts: list[Part]) -> list[torch.Tensor]:
        part = parts[0]
        if len(parts) != 1 or part.ids.shape[1] != 1 or part.ids.shape[0] > self.height:
            return super().together(parts)
        graph = self._graph()
        return super().together(parts) if graph is None else [self._run(graph, part)]

    def _graph(self) -> Any:
        """The view's graph for this height, compiled and checked at its first use (None: eager, said why)."""
        held = _GRAPHS.get(self.model)
        if held is not None and held[0] == self.height:
            return held[1]
        _GRAPHS.pop(self.model, None)  # one graph a view: its memory is counted once (DecodingMemory)
        graph, start = None, time.perf_counter()
        logger.info(f"Compiling the decoding step for {self.height} rows (a 355M model's: about a minute).")
        try:
            graph = self._checked(compiled_graph(self, self.height))
            logger.info(f"Compiled it in {time.perf_counter() - start:.0f} s.")
        except Exception as error:  # a C++ compiler missing, inductor's internals changed: the eager step
            said = (str(error).strip().splitlines() or [""])[0]
            logger.warning(f"Decoding with the eager step: compiling it failed ({type(error).__name__}: {said}).")
        finally:
            release_freed_heap()  # what compiling freed, given back: the graph's own memory is what stays
        _GRAPHS[self.model] = (self.height, graph)
        return graph

    def _checked(self, graph: Any) -> Any:
        """`graph`, where its logits for scratch rows are the eager step's to the bit; else None, said why."""
        rows = self.height
        ids = torch.arange(rows)[:, None] * 7 % self.transformer.wte.weight.shape[0]
        part = Part(ids, torch.arange(rows)[:, None], torch.ones(rows, 1, dtype=torch.long),
                    new_cache([], self.cache_dtype))
        expected = super().together([part])[0]
        if torch.equal(self._run(graph, part._replace(cache=new_cache([], self.cache_dtype))), expected):
            return graph
        logger.warning("Decoding with the eager step: the compiled step's logits differ from it on this machine.")
        return None

    def _run(self, graph: Any, part: Part) -> torch.Tensor:
        """The logits (rows, 1, vocabulary) of `part`'s one-token step by `graph`, zero rows beside it to height."""
        rows = part.ids.shape[0]
        x = (self.embeddings(part.ids) + self.positions(part.positions)).reshape(rows, -1)
        if rows < self.height:
            x = torch.cat([x, x.new_zeros(self.height - rows, x.shape[1])])
        _CALL.now = (self, part, self._masks(part), rows)
        try:
            logits = graph(x)
        finally:
            _CALL.now = None
        return logits[:rows, None]


def compiled_stepper(step: Step | None, rows: int, cache_dtype: torch.dtype | None = None) -> Step | None:
    """`step` compiled for up to `rows` rows where it can be (else `step` itself, said why once a view); its
    graph checked over a cache in `cache_dtype`, the engine's (None: the activations')."""
    if step is None or rows < 1:
        return step
    height = max(2, rows)  # module docstring: one row runs as two
    if _GRAPHS.get(step.model) == (height, None):  # not compilable, or dropped: said already
        return step
    why = not_compilable(step)
    if why is None:
        return CompiledStep(step.model, height, cache_dtype)
    logger.info(f"Decoding with the eager step: {why}.")
    _GRAPHS[step.model] = (height, None)
    return step


class Weights:
    """A TokenwiseInt8Linear's int8 weight (in x out), the float32 scale of its sums (one a column, as inductor's
    int8 pattern takes it) and its bias, read out of its kernel's packed weight."""

    def __init__(self, linear: TokenwiseInt8Linear) -> None:
        weight, scale = linear.product.int8_weight()
        self.int8 = weight.t()
        self.scales = sums_scale(scale).expand(weight.shape[0]).contiguous()
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


def body(step: Step, weights: dict[int, Weights], x: torch.Tensor) -> torch.Tensor:
    """The logits of a one-token step from its tokens' embeddings (rows, width), as the stepping decoder computes
    them (GPT-2's one query-key-value projection or GPT-Neo's three); `weights`: each projection's, by module id."""
    def projected(called: Any, x: torch.Tensor) -> torch.Tensor:
        return product(weights[id(module_of(called))], x)

    def norm(called: Any, x: torch.Tensor) -> torch.Tensor:
        module = module_of(called)
        return F.layer_norm(x, (x.shape[-1],), module.weight, module.bias, module.eps)

    for index, layer in enumerate(step.layers):
        h = norm(layer.ln_1, x)
        qkv = torch.cat([projected(p, h) for p in layer.qkv], 1) if len(layer.qkv) > 1 else projected(layer.qkv[0], h)
        x = x + projected(layer.out, getattr(torch.ops, OPS).attend(qkv, index))
        x = x + projected(layer.proj, F.gelu(projected(layer.fc, norm(layer.ln_2, x)), approximate="tanh"))
    return projected(step.head, norm(step.final_norm, x))


def _attend(qkv: torch.Tensor, layer: int) -> torch.Tensor:
    """The stepping decoder's attention of layer `layer` for the step running (its cache written), zeros for
    the rows beside it."""
    step, part, masks, rows = _CALL.now
    projected = [qkv[:rows]] if len(step.layers[layer].qkv) == 1 else list(qkv[:rows].chunk(3, 1))
    out = step._attend(projected, part, layer, step.windows[layer], masks, step.layers[layer].scale)
    return out if rows == qkv.shape[0] else torch.cat([out, out.new_zeros(qkv.shape[0] - rows, out.shape[1])])


def _define_ops() -> None:
    """The graph's attention as a custom op, defined once a process (the graph calls it; inductor cannot trace
    the engine's cache)."""
    if _LIBRARY:
        return
    library = torch.library.Library(OPS, "DEF")
    library.define("attend(Tensor qkv, int layer) -> Tensor")
    library.impl("attend", _attend, "CPU")
    library.impl("attend", lambda qkv, layer: qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3), "Meta")
    _LIBRARY.append(library)


def compiled_graph(step: Step, rows: int) -> Any:
    """`body` for `rows` rows as one inductor graph, its weights frozen, max-autotune."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    _define_ops()
    weights = {id(module_of(p)): Weights(module_of(p)) for p in _projections(step)}
    example = torch.zeros(rows, step.transformer.wte.weight.shape[1])
    with torch.inference_mode():
        graph = make_fx(lambda x: body(step, weights, x), tracing_mode="fake", _allow_non_fake_inputs=True)(example)
        # not decomposed, inductor calls aten's own kernels for them: eager's bits
        kept = (torch.ops.aten.native_layer_norm.default, torch.ops.aten.gelu.default)
        table = {op: f for op, f in select_decomp_table().items() if op not in kept}
        _aten_kernels_for(kept)
        # the weights as traced are dropped once frozen into the graph (~340 MiB a graph at 355M, measured)
        options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
                   "freezing_discard_parameters": True}
        with _templates_compiled_once():
            return compile_fx(graph, [example], config_patches=options, decompositions=table)


def _aten_kernels_for(ops: tuple[Any, ...]) -> None:
    """inductor's lowering of each of `ops` to aten's own kernel, registered as its implicit fallback for an op
    left undecomposed registers it (the same layout rule; it stays for the process either way).  Left to the
    implicit fallback, inductor raises wherever the environment sets CI (GitHub Actions and GitLab set it): a check
    meant for PyTorch's own CI, that an op with a decomposition is not left undecomposed."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for op in ops:
        if op not in lowering.lowerings:
            layout = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=layout, warn=False, override_decomp=True)


@contextlib.contextmanager
def _templates_compiled_once() -> Iterator[None]:
    """inductor compiling each jinja string of its GEMM template once: it compiles them again for each projection
    rendered (2,157 compiles in a 355M step's graph, 48 s of a 130 s profiled compile), and a compiled jinja
    template renders the same for any arguments.  Where inductor has no such method, its own way (slower)."""
    from torch._inductor.codegen.common import KernelTemplate

    method = getattr(KernelTemplate, "_template_from_string", None)
    if method is None:
        yield
        return
    with mock.patch.object(KernelTemplate, "_template_from_string", staticmethod(functools.lru_cache(None)(method))):
        yield
