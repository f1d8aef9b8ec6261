"""The stepping decoder: a decoding view's prompts and steps (a token for each running row) of a GPT-2 or
GPT-Neo computed straight over the engine's cache, in place of transformers' forward.

At batch 1 a 355M step's matrix products take about half of the step; most of the rest was transformers'
forward around them: per layer, its mask building, module calls, cache bookkeeping and an eight-operation
GELU (HISTORY.md, "Decoding speed").  Here a step is the few operations GPT-2 is made of, each layer's modules
read once.  It runs only for a decoding view (an int8 or 16-bit copy decoding.py made, whose scores are
already within its form's score_error of the model's, not token for token): decoding="exact" and a model decoded
as held keep transformers' forward, token for token its generate().  A view's prompts are encoded here too
(causal attention over the prompt; a first token sooner than by the forward, RESULTS.md), so that a text's
prompt and steps are one arithmetic whichever rows it runs beside; a prompt scored whole (the server's echo)
is still the forward's.  Several parts go through one pass (`Step.together`): the running rows' step beside
joining rows' prompts, as continuous batching's chunked prefill does (vLLM, llama.cpp's server), so that a row
joining costs the others its tokens' share of the products, not a pass over the weights of its own.

| what          | how                                                                                        |
|---------------|--------------------------------------------------------------------------------------------|
| projections   | each module called (an int8 Linear, a 16-bit Conv1D...): their hooks run, as in the forward |
|               | (the parts' tokens side by side; a token its own where the form quantizes tokens alone);    |
|               | an unhooked module's forward called straight (an int8 Linear's kernel and a LayerNorm's     |
|               | aten op bound once: `called`), the block's modules looked up once (`Layer`)                 |
| attention     | a row's one new token (a step, a prompt of one) on our own kernel where the CPU has AVX512F |
|               | (native_attention.py: each row over its own places alone, whatever rows are beside it; a   |
|               | prefix row padded over its places gathered); else, and for longer prompts,                  |
|               | scaled_dot_product_attention over the cache, the rows' padding masked (no mask where no row |
|               | is padded), causal over a prompt, the family's scaling; GPT-Neo's local layers within      |
|               | window_size places (a step: the last ones).  There, where the projections compute each     |
|               | token alone (the form of seeded texts), a row whose text must repeat (Part.alone) attends  |
|               | as it does alone (row_attention.py: a call of its own, or one for rows of its own places,  |
|               | over the cache's zeros after them); other rows attend as the batch (a call a row costs a   |
|               | 16-row step a seventh more)                                                                 |
| GELU          | GPT-2's tanh approximation as one operation (F.gelu, approximate="tanh") in place of        |
|               | transformers' eight: the same function, rounded differently                                 |
| cache         | the engine's cache (kv_cache.py: written in place; a one-token row's keys and values by our |
|               | attention kernel, as torch's copy writes them); one in fewer bits than the activations (an  |
|               | int8 view's bf16 cache) attended in its dtype, the output back in the activations'          |
| blocks in one | a GPT-2 int8 or bf16 view on our kernels: a step of the running rows alone, one token each, |
| call          | goes through each block in one call of the same kernels (native_block.py; ~1.15x at batch 1 |
|               | and 8), the view's block norms gpt2_block.c's in every pass, so a row's bits are the same   |
|               | either way                                                                                  |
| not stepped   | other families, GPT-2 with cross-attention, and a model with hooks on the modules bypassed  |
|               | (the model, its blocks, attention, MLP, activation): transformers' forward, as before       |
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ..native import native_attention, native_block
from .row_attention import RowOwn, each_row_alone

TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation")


class Part(NamedTuple):
    """Rows given to one step: `ids` (rows, new tokens) at `positions` (rows, new), `mask` (rows, the cache's
    length with the new tokens) telling each row's tokens from its padding, written to `cache` (its layers made
    as they are written where it has none); `alone`: the rows whose attention is computed alone where the form
    computes each token alone (None: every row; module docstring)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    cache: Any
    alone: list[int] | None = None


class Step:
    """A step of a GPT-2 or GPT-Neo (their LM-head models, or a decoding view of one): the logits of one new token
    a row.  The families differ in their attention: GPT-2's query, key and value come from one projection and
    are scaled by the layer's `scaling`; GPT-Neo's from three, unscaled, and its local layers see only the last
    `window_size` places of the cache (as transformers' mask counts them: padding is on the left, so a row's
    window holds the same tokens as alone)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.transformer = model, model.transformer
        self.blocks = list(model.transformer.h)
        self.neo = model.config.model_type == "gpt_neo"
        attention = self.blocks[0].attn.attention if self.neo else self.blocks[0].attn
        self.heads, self.head_size = attention.num_heads, attention.head_dim
        self.windows = [model.config.window_size if self.neo and block.attn.attention_type == "local" else None
                        for block in self.blocks]
        first = attention.q_proj if self.neo else attention.c_attn
        self.rows_alone = bool(getattr(first, "each_token_alone", False))  # module docstring: attention
        self.native_blocks = self._native_blocks()
        self.layers = [self._layer(block) for block in self.blocks]
        self.embeddings, self.positions = called(self.transformer.wte), called(self.transformer.wpe)
        self.final_norm, self.head = called(self.transformer.ln_f), called(model.lm_head)

    def _layer(self, block: nn.Module) -> Layer:
        if self.neo:
            attention = block.attn.attention
            qkv, out, scale = [attention.q_proj, attention.k_proj, attention.v_proj], attention.out_proj, 1.0
        else:
            qkv, out, scale = [block.attn.c_attn], block.attn.c_proj, gpt2_scaling(block.attn)
        tanh = type(block.mlp.act).__name__ in TANH_GELUS
        fc, act = called(block.mlp.c_fc), _tanh_gelu if tanh else block.mlp.act
        # c_fc's call gives the GELU too where its kernel computes both, unless c_fc is hooked (then called as
        # itself: a hook must see c_fc's own output)
        then_gelu = getattr(block.mlp.c_fc, "then_tanh_gelu", None)
        both = then_gelu() if tanh and then_gelu is not None and fc is not block.mlp.c_fc else None
        if both is not None:
            fc, act = both, _as_is
            both.stepping_module = block.mlp.c_fc
        norm = called if self.native_blocks is None else native_block.norm  # (its bits either way a step goes)
        return Layer(norm(block.ln_1), [called(p) for p in qkv], called(out), scale, norm(block.ln_2), fc, act,
                     called(block.mlp.c_proj))

    def _native_blocks(self) -> native_block.Blocks | None:
        """Each block's one-token step in one call of our kernels, where this model takes it (native_block.py),
        nothing of it hooked; else None."""
        if self.neo or not native_block.available():
            return None
        modules = [m for b in self.blocks for m in (b.ln_1, b.ln_2, b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc,
                                                     b.mlp.c_proj)]
        if _hooked_globally() or any(_hooked(m) or "forward" in m.__dict__ for m in modules):
            return None
        made = [native_block.block_step(b, gpt2_scaling(b.attn), self.heads, self.head_size,
                                        type(b.mlp.act).__name__ in TANH_GELUS) for b in self.blocks]
        if any(step is None for step in made) or len({step.parts.bf16 for step in made}) > 1:  # (one dtype a call)
            return None
        return native_block.Blocks(made)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any,
                 alone: list[int] | None = None) -> torch.Tensor:
        """The logits (rows, 1, vocabulary) of each row's last token of `ids` (Part's fields)."""
        return self.together([Part(ids, positions, mask, cache, alone)])[0]

    def together(self, parts: list[Part]) -> list[torch.Tensor]:
        """Each part's logits (rows, 1, vocabulary) of each row's last token, the parts in one pass over the
        weights: their tokens side by side through every projection (a part's tokens are computed as they would
        be alone wherever a projection computes each token alone), attention within each part over its own
        cache (the running rows' step beside new rows' prompts: continuous batching's chunked prefill)."""
        bounds = _bounds([part.ids.numel() for part in parts])
        x = _flat([self.embeddings(p.ids) + self.positions(p.positions) for p in parts])
        natives = own_places(parts[0], {}) if self._in_native_blocks(parts, x) else None
        if natives is not None and not natives.gathered:  # (only the places: none of _masks' other masks)
            return [self.head(self.final_norm(native_block.steps(self.native_blocks, x, parts[0].cache.layers,
                                                                 natives.places)))[:, None]]
        seen = [self._masks(part) for part in parts]
        for index, (layer, window) in enumerate(zip(self.layers, self.windows)):
            h = layer.ln_1(x)
            projected = [projection(h) for projection in layer.qkv]
            outs = [self._attend(projected if len(parts) == 1 else [t[start:end] for t in projected], part, index,
                                 window, masks, layer.scale) for part, (start, end), masks in zip(parts, bounds, seen)]
            x = x + layer.out(_flat(outs))
            x = x + layer.proj(layer.act(layer.fc(layer.ln_2(x))))
        if len(parts) > 1 or parts[0].ids.shape[1] > 1:  # only each row's last token's logits are made
            x = x[torch.cat([torch.arange(start, end, p.ids.shape[1]) + p.ids.shape[1] - 1
                             for p, (start, end) in zip(parts, bounds)]).to(x.device)]
        logits = self.head(self.final_norm(x))
        return [logits[start:end, None] for start, end in _bounds([p.ids.shape[0] for p in parts])]

    def _in_native_blocks(self, parts: list[Part], x: torch.Tensor) -> bool:
        """Whether this pass may go through native_block.steps: a step of the running rows alone, one token each,
        every layer's cache our slots (native_block.py); the caller checks that each row's places are the cache's
        last (own_places)."""
        if self.native_blocks is None or len(parts) > 1 or parts[0].ids.shape[1] != 1 \
                or x.dtype != self.native_blocks.dtype:
            return False
        layers = parts[0].cache.layers
        return len(layers) == len(self.blocks) \
            and all(getattr(layer, "slots", None) is not None and layer.slots.rows == x.shape[0] for layer in layers) \
            and layers[0].slots.both.dtype in native_attention.DTYPES  # (the rest of `takes` held when made)

    def _masks(self, part: Part) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], dict[int, RowOwn],
                                          OwnPlaces | None]:
        """What `part`'s attention reads at every layer of a step (_attend's `masks`): seen_places's for the batch,
        _rows_own's for the rows attending alone, own_places's for our kernel's one-token rows."""
        owns = self._rows_own(part)
        return seen_places(part.mask.to(part.ids.device), part.ids.shape[1], self.windows), owns, own_places(part, owns)

    def _rows_own(self, part: Part) -> dict[int, RowOwn]:
        """The rows attending alone (none where the form does not compute each token alone), each with its own
        tokens among the part's new ones, its own places (the last ones: padding is on the left) and what its
        tokens see of them, as seen_places gives them for the row alone."""
        if not self.rows_alone or part.alone == []:
            return {}
        rows = range(part.ids.shape[0]) if part.alone is None else part.alone
        mask, new = part.mask.to(part.ids.device)[list(rows)], part.ids.shape[1]
        if bool(mask.all()):  # no row padded (every step of one text): each row's own places are all of them
            seen = (None, None) if new == 1 else seen_places(torch.ones_like(mask[:1]), new, self.windows)
            return dict.fromkeys(rows, RowOwn(new, mask.shape[1], *seen, None))
        trailing = mask.flip(1).cumprod(1).sum(1).tolist()  # a prefix row's padding lies after its virtual places
        owns = {}
        for index, row, places, tokens, last in zip(rows, mask, mask.sum(1).tolist(), mask[:, -new:].sum(1).tolist(),
                                                     trailing):
            seen = (None, None) if tokens == 1 else seen_places(torch.ones_like(row[None, -places:]), tokens,
                                                                self.windows)
            owns[index] = RowOwn(tokens, places, *seen, None if last == places else row.nonzero()[:, 0])
        return owns

    def _attend(self, projected: list[torch.Tensor], part: Part, index: int, window: int | None,
                masks: tuple[tuple[torch.Tensor | None, torch.Tensor | None], dict[int, RowOwn], OwnPlaces | None],
                scale: float) -> torch.Tensor:
        """A part's attention output (its tokens, width) from its tokens' projections (GPT-Neo's three, GPT-2's
        one), its keys and values written to its cache's layer `index`; `masks`: the part's _masks."""
        rows, new = part.ids.shape
        if len(projected) == 1:  # GPT-2's one projection: (tokens, 3 x width)
            qkv = projected[0].view(rows, new, 3, self.heads, self.head_size).permute(2, 0, 3, 1, 4)
            query, key, value = qkv.unbind()  # one call (unpacking the tensor itself makes three)
        else:
            query, key, value = (t.view(rows, new, self.heads, self.head_size).transpose(1, 2) for t in projected)
        (seen, local), owns, natives = masks
        layer = part.cache.layers[index] if index < len(part.cache.layers) else None
        if natives is not None and new == 1 and getattr(layer, "slots", None) is not None \
                and native_attention.takes(query, layer.slots.buffers[0]):  # the kernel appends the keys itself
            return layer.written(1, functools.partial(_natively, query, natives=natives, window=window, scale=scale,
                                                      new=(key, value)))
        keys, values = part.cache.update(key, value, index)
        if natives is not None and not native_attention.takes(query, keys):
            natives = None
        if natives is not None and new == 1:
            return _natively(query, keys, values, natives, window, scale)
        slots = getattr(part.cache.layers[index], "slots", None) if owns else None
        after = None if slots is None else slots.views  # row_attention.py: the zeros after, one-token rows read
        out = self._on_torch(query, keys, values, (seen, local), owns, window, scale, after)
        out = out.transpose(1, 2).reshape(rows * new, -1).to(query.dtype)
        if natives is not None:  # a prompt of one token beside longer ones: as it attends alone, on our kernel
            out.view(rows, new, -1)[natives.rows, -1] = _natively(query[:, :, -1:], keys, values, natives, window,
                                                                  scale)[natives.rows]
        return out

    @staticmethod
    def _on_torch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  masks: tuple[torch.Tensor | None, torch.Tensor | None], owns: dict[int, RowOwn], window: int | None,
                  scale: float, after: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """_attend's attention (rows, heads, new, head size) on torch's kernel, in the cache's dtype: `masks`
        seen_places's for the batch, the rows `owns` names each as alone (row_attention.py)."""
        query = query.to(keys.dtype)  # (a cache in bf16 beside fp32 activations: attended in bf16, kv_cache.py)
        if len(owns) == query.shape[0]:
            return each_row_alone(query, keys, values, list(owns.values()), window, scale, after)
        (seen, local), seen_keys, seen_values = masks, keys, values
        if window is not None and query.shape[2] == 1:  # one token: its window is the last places (padding is left)
            seen_keys, seen_values = keys[:, :, -window:], values[:, :, -window:]
            seen = None if seen is None else seen[..., -window:]
        elif window is not None:
            seen = local
        # (two matrix products and a softmax written out measured no faster, at 1 or 16 rows: RESULTS.md)
        out = F.scaled_dot_product_attention(query, seen_keys, seen_values, attn_mask=seen, scale=scale)
        for row, own in owns.items():  # some rows alone, beside others attending as the batch
            out[row:row + 1] = each_row_alone(query[row:row + 1], keys[row:row + 1], values[row:row + 1], [own],
                                              window, scale, after and functools.partial(_row_of, after, row))
        return out


class OwnPlaces(NamedTuple):
    """The rows of a part that attend on our kernel (native_attention.attend), as it takes them: `rows`; `places`
    (one a row of the part), each one's own places where they are the cache's last (else 0); `gathered`, the
    places of the others (a prefix row's padding lies between its virtual places and its tokens)."""

    rows: list[int]
    places: torch.Tensor
    gathered: dict[int, torch.Tensor]


def own_places(part: Part, owns: dict[int, RowOwn]) -> OwnPlaces | None:
    """The rows of `part` whose one new token attends on our kernel, where it runs here: every row of a one-token
    part; in a longer part, the rows `owns` names (attending alone) whose prompt is one token, so that such a row
    attends as in a part of its own.  None where no row does."""
    if not part.ids.is_cpu or not native_attention.available():
        return None
    if part.ids.shape[1] == 1:
        mask = part.mask.to(part.ids.device).bool()
        if bool(mask.all()):  # no row padded: every row's places are the cache's last
            return OwnPlaces(list(range(part.ids.shape[0])), torch.full((mask.shape[0],), mask.shape[1],
                                                                         dtype=torch.int32), {})
        places, trailing = mask.sum(1), mask.flip(1).cumprod(1).sum(1)
        suffix = places == trailing
        gathered = {} if bool(suffix.all()) else {row: mask[row].nonzero()[:, 0]
                                                  for row in (~suffix).nonzero()[:, 0].tolist()}
        return OwnPlaces(list(range(part.ids.shape[0])), places.where(suffix, 0).to(torch.int32), gathered)
    ones = {row: own for row, own in owns.items() if own.tokens == 1}
    if not ones:
        return None
    places = torch.zeros(part.ids.shape[0], dtype=torch.int32)
    for row, own in ones.items():
        places[row] = own.places if own.index is None else 0
    return OwnPlaces(list(ones), places, {row: own.index for row, own in ones.items() if own.index is not None})


def _natively(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, natives: OwnPlaces,
              window: int | None, scale: float, new: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """One-token rows' attention output (rows, width) in the query's dtype, on our kernel (native_attention.py):
    the rows whose places are the cache's last in one call, each other row over its own places gathered, as it
    attends alone; `new`: the rows' keys and values, which that call writes at the cache's last place first."""
    out = native_attention.attend(query, keys, values, natives.places, window, scale, new)
    for row, index in natives.gathered.items():
        held = [t[row:row + 1, :, index] for t in (keys, values)]
        places = torch.tensor([len(index)], dtype=torch.int32)
        out[row] = native_attention.attend(query[row:row + 1], *held, places, window, scale)[0]
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _row_of(views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], row: int, after: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row` of the keys and values `views(after)` gives."""
    return tuple(t[row:row + 1] for t in views(after))


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of consecutive stretches of `sizes`."""
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends)]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` (..., width) as one (all their tokens, width), copied only where there are several."""
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def seen_places(mask: torch.Tensor, new: int, windows: list[int | None]) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
    """What each of the `new` last places of each row may attend to, as scaled_dot_product_attention takes it
    (rows, 1, new, places; None: everything), for the global layers and (several tokens) the local ones: the
    row's own places (`mask`), up to the query's own (causal), within the local layers' window.  A padding
    place attends to itself alone, so that no query sees nothing (a softmax over nothing is NaN)."""
    own = mask[:, None, None].bool()
    if new == 1:
        return (None if bool(own.all()) else own), None
    places = torch.arange(mask.shape[1], device=mask.device)
    query = places[-new:, None]
    itself = places == query
    attends = (own & (places <= query)) | itself
    window = next((w for w in windows if w is not None), None)
    return attends, None if window is None else (attends & (places > query - window)) | itself


def gpt2_scaling(attention: nn.Module) -> float:
    """The factor of a GPT-2 attention layer's scores: its `scaling` (transformers 5.x's later versions), else
    what they compute it from (1/sqrt(head size) where scale_attn_weights, over layer_idx + 1 where
    scale_attn_by_inverse_layer_idx), which transformers 5.0 computes in its attention functions instead."""
    if hasattr(attention, "scaling"):
        return attention.scaling
    scale = attention.head_dim ** -0.5 if attention.scale_attn_weights else 1.0
    return scale / (attention.layer_idx + 1) if attention.scale_attn_by_inverse_layer_idx else scale


def _as_is(x: torch.Tensor) -> torch.Tensor:
    """The activation of a layer whose c_fc computes it in the same call (int8_kernels.then_tanh_gelu)."""
    return x


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's activation (the tanh approximation) as one operation, in place of transformers' eight."""
    return F.gelu(x, approximate="tanh")


class Layer(NamedTuple):
    """A block's parts as a step calls them (`called`), read once when the Step is made: GPT-Neo's three query, key
    and value projections or GPT-2's one (`qkv`), the attention's output projection (`out`) and score factor
    (`scale`), the MLP's projections and activation."""

    ln_1: Callable[[torch.Tensor], torch.Tensor]
    qkv: list[Callable[[torch.Tensor], torch.Tensor]]
    out: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    ln_2: Callable[[torch.Tensor], torch.Tensor]
    fc: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    proj: Callable[[torch.Tensor], torch.Tensor]


def called(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a step calls `module`: where no hook is on it or on every module, its forward, or what computes the
    same with fewer Python calls (a module's `stepping_call`; a LayerNorm's aten op, its forward's arguments read
    once; not where the module was given a forward of its own); else the module, so that its hooks run as in the
    forward.  (torch's __call__ only looks for hooks, ~3 us a call, and a forward reads its parameters through
    Module.__getattr__, ~1 us each: ~150 calls a step.)  Hooks are looked for when the Step is made (as stepper()
    looks for them on the modules it bypasses): the engine makes its Step from a view made after the model's hooks
    were carried onto it."""
    if _hooked(module) or _hooked_globally():
        return module
    if "forward" in module.__dict__:  # a forward of its own (storage16.compute_in_fp32's): that one
        return module.forward
    if hasattr(module, "stepping_call"):
        call = module.stepping_call()
    elif type(module) is nn.LayerNorm:
        shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
        call = lambda x: torch.layer_norm(x, shape, weight, bias, eps)  # noqa: E731 (it takes an attribute)
    else:
        return module.forward
    call.stepping_module = module
    return call


def module_of(call: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """The module `called` gave `call` for (a hooked module is its own call)."""
    module = getattr(call, "stepping_module", None)
    return getattr(call, "__self__", call) if module is None else module


def stepper(model: nn.Module) -> Step | None:
    """The stepping decoder for `model`, or None where transformers' forward steps it (module docstring)."""
    config = model.config
    if getattr(config, "model_type", None) not in ("gpt2", "gpt_neo") or getattr(config, "add_cross_attention", False) \
            or not hasattr(model, "lm_head"):
        return None
    blocks = list(model.transformer.h)
    bypassed = [model, model.transformer, *blocks, *(m for b in blocks for m in (b.attn, b.mlp, b.mlp.act))]
    if config.model_type == "gpt_neo":
        bypassed += [b.attn.attention for b in blocks]
    if any(_hooked(m) for m in bypassed):
        return None
    return Step(model)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _hooked_globally() -> bool:
    """A hook registered for every module (torch.nn.modules.module.register_module_forward_hook and its kin)."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
