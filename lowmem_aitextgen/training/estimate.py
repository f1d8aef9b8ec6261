"""How much memory a training plan needs, known before training starts.

Weights, gradients and optimizer states are counted exactly from the model as
the plan prepares it.  Activations are measured, not guessed from a formula:
a probe model of the same width with one and with two blocks runs one
training forward at three short lengths with the plan applied (precision,
checkpointing, LoRA, chunked loss), and saved_tensors_hooks count every byte
autograd keeps.  Block bytes (two blocks minus one) and the rest are then
fitted as c + a*T + b*T^2 per sequence from three lengths (b is the
attention matrix, zero with fused attention) and scaled to the real depth, length and batch; the probes'
vocabulary is small, the loss's bytes extended linearly to the real one (PROBE_VOCABS).  The probe
runs on CPU; for device="cuda" it runs without attention dropout, because CUDA's fused
SDPA applies that dropout inside the kernel (keeping no T x T mask or probabilities)
while CPU's SDPA falls back to its unfused path whenever dropout is on.

Transients of backward are estimated, not measured: the block being
recomputed under checkpointing, the gradients of one block's activations, and
one chunk's logits with their gradient.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from transformers import AutoConfig

from ..arguments import check_block_size, check_estimate
from ..hardware import format_bytes
from . import four_bit, in_backward
from .adapter_settings import SHORT_FORMS, AdapterSettings
from .checkpointing import transformer_blocks
from .chunked_loss import body_and_head, chunked_lm_loss, final_hidden
from .counting import unique_tensor_bytes
from .optimizers import check_optimizer_name, optimizer_state_bytes
from .plan import PRECISIONS, TrainPlan, default_chunk_tokens
from .step_time import shape
from .techniques import apply_memory_plan

# OpenAI's four GPT-2 checkpoints (the hub's gpt2 ... gpt2-xl); all have 50,257 tokens and 1,024 positions.
GPT2_SIZES = {
    "124M": dict(n_layer=12, n_embd=768, n_head=12),
    "355M": dict(n_layer=24, n_embd=1024, n_head=16),
    "774M": dict(n_layer=36, n_embd=1280, n_head=20),
    "1558M": dict(n_layer=48, n_embd=1600, n_head=25),
}
PROBE_LENGTHS = (16, 32, 64)  # tokens per probe sequence; within the context (probe_lengths)
# Vocabularies the probes run with.  The body saves nothing that depends on the vocabulary and the loss
# saves bytes linear in it (a chunk's logits, their log-sum-exp), so two small ones give the real one's
# exactly; the LM head's matmul at GPT-2's 50,257 words was most of an estimate's time (minutes at
# width 1600 where bf16 is emulated).
PROBE_VOCABS = (256, 512)


def probe_lengths(config: object, reserved: int = 0) -> tuple[int, int, int]:
    """Three lengths for the probes, no longer than the model's context less the positions an adapter's
    virtual tokens take (a quarter, half and all of a short one): a position beyond it does not exist."""
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    context = context - reserved if context else context
    if context is None or context >= PROBE_LENGTHS[-1]:
        return PROBE_LENGTHS
    if context < 4:
        raise ValueError(f"A model with a context of {context} tokens is too short to estimate.")
    return context // 4, context // 2, context


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step needs at its peak, by what holds them."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int  # saved for backward by the blocks and embeddings
    logits_loss: int  # saved for backward by the LM head and the loss
    overhead: int  # backward's transients: recomputed block, activation gradients, a chunk's logits
    plan: dict = field(default_factory=dict)
    block_activations: int = 0  # one block's activations at this micro-batch (in overhead; for the CPU heap)
    host: int = 0  # an offloading plan's weights, gradients and optimizer states in host memory (not in total)
    trained_parameters: int = 0  # the parameters the optimizer updates (step_time.py's count)

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_states + self.activations
                + self.logits_loss + self.overhead)

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer states": self.optimizer_states,
                "activations": self.activations, "logits/loss": self.logits_loss, "overhead": self.overhead}

    def __str__(self) -> str:
        width = max(len(name) for name in self.parts())
        plan = ", ".join(f"{k}={v}" for k, v in self.plan.items())
        rows = [f"Memory estimate ({plan})"]
        rows += [f"  {name:<{width}}  {format_bytes(value):>10}" for name, value in self.parts().items()]
        rows.append(f"  {'total':<{width}}  {format_bytes(self.total):>10}")
        if self.host:
            rows.append(f"  {'host memory':<{width}}  {format_bytes(self.host):>10}  (fp32 weights, gradients and "
                        "AdamW states, offloaded)")
        return "\n".join(rows)


def model_config(model: nn.Module | object | str) -> object:
    """The config of a model, a config itself, or a GPT-2 size name."""
    from transformers import GPT2Config

    if isinstance(model, str):
        if model not in GPT2_SIZES:
            raise ValueError(f"model={model!r} is not a GPT-2 size; use one of {', '.join(GPT2_SIZES)}, "
                             "a config or a model.")
        return GPT2Config(**GPT2_SIZES[model])
    return getattr(model, "config", model)


def _with_layers(config: object, n_layer: int) -> object:
    config = copy.deepcopy(config)
    for name in ("n_layer", "num_hidden_layers"):
        if hasattr(config, name):
            setattr(config, name, n_layer)
    return config


def _as_probed_for(config: object, device: str) -> object:
    """The config the probes run: for CUDA, without attention dropout (see the module docstring)."""
    if device != "cuda" or getattr(config, "_attn_implementation", None) == "eager":
        return config
    config = copy.deepcopy(config)
    for name in ("attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config


def _n_layer(config: object) -> int:
    return getattr(config, "n_layer", None) or config.num_hidden_layers


@contextlib.contextmanager
def _counting(model: nn.Module, totals: dict[str, int], part: Callable[[], str]) -> Iterator[None]:
    """Add the bytes of every tensor autograd saves to totals[part()], except the model's weights
    (counted once, as weights; some ops save them as views, e.g. a transposed LM head).

    The hook keeps a detached tensor: the tensor it is given still has its grad_fn, and an op's
    saved output kept as it is would hold its own graph node, a cycle through C++ that no gc
    breaks; the probes never run backward, so each probe model would stay in memory for good."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            totals[part()] = totals.get(part(), 0) + tensor.numel() * tensor.element_size()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _autocast(plan: TrainPlan) -> contextlib.AbstractContextManager:
    if plan.precision.endswith("-mixed"):
        return torch.autocast("cpu", dtype=plan.half_dtype)
    return contextlib.nullcontext()


def saved_bytes(model: nn.Module, input_ids: torch.Tensor, plan: TrainPlan) -> dict[str, int]:
    """Bytes autograd saves in one training forward, split into "body" and "loss"."""
    parts = body_and_head(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} does not expose its body and LM head; it cannot be probed.")
    body, head = parts
    totals: dict[str, int] = {}
    current = ["body"]
    with _counting(model, totals, lambda: current[0]), _autocast(plan):
        hidden, labels = final_hidden(model, body, input_ids)
        current[0] = "loss"
        if plan.loss_chunk_tokens:
            chunked_lm_loss(hidden, head, labels, plan.loss_chunk_tokens)
        else:
            logits = head(hidden).float()
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return totals


def _probe(config: object, n_layer: int, plan: TrainPlan, lengths: tuple[int, ...]) -> dict[int, dict[str, int]]:
    """Saved bytes of a probe model with n_layer blocks, at each probe length.

    What autograd saves depends on shapes and dtypes, not values: the weights are zeros instead of a
    random initialisation, which would be most of an estimate's time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_with_layers(config, n_layer))
    model = model.to_empty(device="cpu")
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.detach().zero_()
    model.tie_weights()
    if plan.precision.endswith("-true") and plan.half_dtype is not None:
        model = model.to(plan.half_dtype)
    if plan.checkpointed_blocks:  # a checkpointing probe checkpoints each of its blocks
        plan = replace(plan, n_layer=n_layer, checkpointed_blocks=n_layer)
    model, _ = apply_memory_plan(model, plan)
    with _ZeroMatmuls():
        return {t: saved_bytes(model, torch.randint(model.config.vocab_size, (1, t)), plan) for t in lengths}


class _ZeroMatmuls(TorchDispatchMode):
    """The probes' matrix products made as zeros of the shape, strides and dtype the real ones have (their meta
    kernels say which).  What autograd saves depends on those, not on values (the weights are zeros too),
    and a 16-bit matmul where the CPU only emulates it was most of an estimate's time: 38 s for 355M's
    bf16 probes on an AVX2 CPU (benchmarks/RESULTS.md).  Autocast and autograd sit above this mode, so the
    dtypes and saved tensors are theirs."""

    MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                         torch.ops.aten.baddbmm.default})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.MATMULS:
            return func(*args, **kwargs)
        meta = func(*tree_map(lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, args), **kwargs)
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype).zero_()


def _fit_quadratic(values: tuple[int, ...], lengths: tuple[int, ...]) -> Callable[[int], float]:
    """f(T) = c + a*T + b*T^2 through the measured points (b: attention matrices, zero when fused)."""
    coefficients = np.polyfit(lengths, values, deg=2)
    return lambda t: float(np.polyval(coefficients, t))


@functools.lru_cache(maxsize=256)
def _per_block_and_rest(config_json: str, plan: TrainPlan) -> tuple[Callable, Callable, Callable]:
    """Saved bytes per sequence as functions of its length: one block, everything else in the
    body (embeddings, final norm, the first block's difference), and the loss.
    Cached: a planner asks for the same probes with other batch sizes and optimizers."""
    config = AutoConfig.for_model(**json.loads(config_json))
    lengths = probe_lengths(config, plan.adapter.positions_taken if plan.adapter is not None else 0)
    vocab = config.vocab_size
    small, larger = (_with_vocab(config, v) for v in PROBE_VOCABS) if vocab > PROBE_VOCABS[1] else (config, None)
    one, two = (_probe(small, n, plan, lengths) for n in (1, 2))
    block = _fit_quadratic(tuple(two[t]["body"] - one[t]["body"] for t in lengths), lengths)
    rest = _fit_quadratic(tuple(2 * one[t]["body"] - two[t]["body"] for t in lengths), lengths)
    loss_bytes = [one[t]["loss"] for t in lengths]
    if larger is not None:  # the loss keeps bytes linear in the vocabulary: a line through two, extended
        wider = _probe(larger, 1, plan, lengths)
        per_word = [(wider[t]["loss"] - one[t]["loss"]) / (PROBE_VOCABS[1] - PROBE_VOCABS[0]) for t in lengths]
        loss_bytes = [b + (vocab - PROBE_VOCABS[0]) * w for b, w in zip(loss_bytes, per_word)]
    return block, rest, _fit_quadratic(tuple(loss_bytes), lengths)


def _with_vocab(config: object, vocab_size: int) -> object:
    config = copy.deepcopy(config)
    config.vocab_size = vocab_size
    return config


def memory_plan(precision: str, gradient_checkpointing: bool | int, lora: AdapterSettings | None, batch_size: int,
                optimizer: str, chunked_loss: bool, device: str = "cpu", n_layer: int = 0) -> TrainPlan:
    """A TrainPlan with just the memory decisions (the schedule does not change memory) for a model of
    n_layer blocks; gradient_checkpointing: True (every block), False, or how many blocks."""
    if gradient_checkpointing is True and not n_layer:
        raise ValueError("gradient_checkpointing=True checkpoints every block: give the model's n_layer.")
    blocks = n_layer if gradient_checkpointing is True else int(gradient_checkpointing)
    return TrainPlan(
        accelerator="gpu" if device in ("gpu", "cuda") else "cpu", precision=precision, n_layer=n_layer,
        checkpointed_blocks=blocks, adapter=lora, micro_batch_size=batch_size,
        loss_chunk_tokens=default_chunk_tokens(device) if chunked_loss else None, optimizer=optimizer,
    )


def probe_plan(plan: TrainPlan) -> TrainPlan:
    """What the probes depend on, and nothing else (so that probes are shared between plans).  Frozen
    layers are left out: a one-block probe cannot freeze "the first N" blocks (frozen blocks save less
    for backward, so the estimate stays on the safe side)."""
    return TrainPlan(accelerator=plan.accelerator, precision=plan.precision, adapter=plan.adapter,
                     upcast_bf16_weights=plan.upcast_bf16_weights, loss_chunk_tokens=plan.loss_chunk_tokens)


def state_plan(plan: TrainPlan) -> TrainPlan:
    """What the parameter state (weights, gradients, optimizer states) depends on, and nothing else."""
    return TrainPlan(precision=plan.precision, adapter=plan.adapter,
                     upcast_bf16_weights=plan.upcast_bf16_weights, freeze_layers=plan.freeze_layers,
                     num_layers_freeze=plan.num_layers_freeze, optimizer=plan.optimizer,
                     step_in_backward=plan.step_in_backward, four_bit_base=plan.four_bit_base)


@torch.random.fork_rng(devices=[])  # LoRA's initialisation and the probes' inputs draw from the CPU generator
def estimate_memory(
    model: nn.Module | object | str,
    block_size: int = 1024,
    batch_size: int = 1,
    precision: str = "32-true",
    gradient_checkpointing: bool | int = False,
    lora: bool | AdapterSettings = False,
    optimizer: str = "adamw",
    chunked_loss: bool = True,
    device: str = "cpu",
    shards: int = 1,
    adapter: Any = None,
    offload: bool = False,
) -> MemoryEstimate:
    """Peak memory of one training step, by part (weights, gradients, optimizer states, activations, the loss,
    the rest).  Nothing is downloaded and no full-size activation is made.  The caller's random state is left
    as it was: train() estimates before it trains, and that must not change the run's seed or its data order.

    Args:
        model: a model, a config, or a GPT-2 size name ("124M", "355M", "774M", "1558M").
        block_size: tokens per sequence (default 1024).
        batch_size: sequences per micro-batch (default 1).
        precision: a Lightning precision string (default "32-true").
        gradient_checkpointing: True (every block), False, or a number of blocks.
        lora: True for lora=True's adapter (or an AdapterSettings).
        optimizer: "adamw" (default), "adamw8bit" or "adafactor".
        chunked_loss: the loss a chunk of tokens at a time (default True).
        device: "cpu" (default) or "cuda".
        shards: the processes of strategy="fsdp"; the estimate is then one process's.
        adapter: "prefix" or a peft config (train()'s adapter= and peft_config=).
        offload: the weights, gradients and AdamW states in host memory while a GPU computes (the planner's
            offload tier, strategy="fsdp_cpu_offload"), counted in `host`.
    """
    check_estimate(block_size, batch_size, chunked_loss)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)}.")
    check_optimizer_name(optimizer)  # an estimate needs no torchao installed
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'.")
    if not (isinstance(shards, int) and shards >= 1):
        raise ValueError(f"shards={shards!r} must be the number of processes the model is sharded across, e.g. 2.")
    if offload and device != "cuda":
        raise ValueError(f"offload=True keeps the weights in host memory while a GPU computes; with device={device!r} "
                         "they are there already. Use device='cuda', or leave offload out.")
    if (shards > 1 or offload) and optimizer == "adamw8bit":
        raise ValueError("optimizer='adamw8bit' cannot train a sharded or offloaded model (train() refuses it with "
                         "strategy='fsdp'); use optimizer='adamw'.")
    if isinstance(adapter, str) and adapter not in SHORT_FORMS:
        raise ValueError(f"adapter={adapter!r} is not one of {', '.join(map(repr, SHORT_FORMS))}; pass a peft config "
                         "for any other method.")
    if lora is not False and adapter is not None:
        raise ValueError(f"lora={lora!r} and adapter={adapter!r} each choose the adapter; pass only one of them.")
    config = model_config(model)
    check_block_size(block_size, config)
    blocks = _n_layer(config)
    if not (gradient_checkpointing in (True, False) or (isinstance(gradient_checkpointing, int)
                                                          and 0 <= gradient_checkpointing <= blocks)):
        raise ValueError(f"gradient_checkpointing={gradient_checkpointing!r} must be True, False or a number of "
                         f"blocks from 0 to the model's {blocks}.")
    settings = lora if isinstance(lora, AdapterSettings) else AdapterSettings.lora() if lora else None
    if adapter is not None:
        settings = AdapterSettings.short_form(adapter) if isinstance(adapter, str) else \
            AdapterSettings.of(adapter, getattr(config, "model_type", None))
    plan = memory_plan(precision, gradient_checkpointing, settings, batch_size, optimizer, chunked_loss, device,
                       n_layer=blocks)
    return estimate_plan(config, replace(plan, shards=shards, offload=bool(offload)), block_size)


@functools.lru_cache(maxsize=256)
def _state_bytes(config_json: str, plan: TrainPlan) -> tuple[int, int, int, int, int, int]:
    """Weights, gradients and optimizer states, exactly, the largest block's weights, the parameters that
    train and the values of the largest 4-bit matrix, from a model on the meta device (nothing is allocated).
    Cached: a planner weighs many plans with the same parameter state."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(config)
    full.tie_weights()  # transformers 5.0 leaves a meta-device model untied
    if plan.precision.endswith("-true") and plan.half_dtype is not None:
        full = full.to(plan.half_dtype)
    full, _ = apply_memory_plan(full, replace(plan, four_bit_base=False))  # NF4 quantizes no meta tensor
    params = list({id(p): p for p in full.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    quantized = [m.weight for m in four_bit.quantizable_layers(full)] if plan.four_bit_base else []
    four_bits = sum(p.numel() * p.element_size() - four_bit.nf4_bytes(p.numel()) for p in quantized)
    block = max((unique_tensor_bytes(b.parameters()) for b in transformer_blocks(full)), default=0)
    gradients = unique_tensor_bytes(trainable)
    if plan.step_in_backward:  # one tensor's gradient at a time, and what its step makes beside it
        gradients = max((in_backward.step_bytes(p, plan.optimizer) for p in trainable), default=0)
    return (unique_tensor_bytes(params) - four_bits, gradients, optimizer_state_bytes(trainable, plan.optimizer),
            block, sum(p.numel() for p in trainable), max((p.numel() for p in quantized), default=0))


def config_jsons(config: object, accelerator: str) -> tuple[str, str]:
    """The keys estimate_plan caches by: the config as JSON, and as the probes run it on `accelerator`."""
    device = "cuda" if accelerator == "gpu" else "cpu"
    return config.to_json_string(), _as_probed_for(config, device).to_json_string()


def _gathered_whole(plan: TrainPlan, weights: int, gradients: int, block_weights: int, n_layer: int) -> int:
    """What a sharded process holds whole beside its shards (sharding.py): the embeddings and head (every
    weight outside the blocks) from the forward to their backward, and the blocks' weights two at a time (the
    one computing, the next gathered ahead) and a block's gradient; with gathered_for "micro-batch" every
    block's weights, and with "step" also every whole gradient, accumulated over the step."""
    block_gradient = block_weights if gradients else 0
    if plan.gathered_for == "block":
        return weights - n_layer * block_weights + 2 * block_weights + block_gradient
    return weights + (gradients if plan.gathered_for == "step" else block_gradient)


@torch.random.fork_rng(devices=[])
def estimate_plan(config: object, plan: TrainPlan, block_size: int,
                  jsons: tuple[str, str] | None = None) -> MemoryEstimate:
    """Peak memory of one training step of `plan` for a model of `config` at `block_size` tokens; `jsons`:
    config_jsons(config, plan.accelerator), where the caller weighs many plans of one config (making
    them was most of a planner's time)."""
    full_json, config_json = jsons or config_jsons(config, plan.accelerator)
    weights, gradients, optimizer_states, block_weights, trained, dequantized = _state_bytes(full_json,
                                                                                              state_plan(plan))
    whole = host = 0  # a sharded plan's weights gathered whole while they compute (sharding.py)
    if plan.sharded:
        whole = _gathered_whole(plan, weights, gradients, block_weights, _n_layer(config))
        weights, gradients, optimizer_states = (-(-part // plan.shards)
                                                for part in (weights, gradients, optimizer_states))
    if plan.offload:  # the shards live in host memory; the device holds only what is gathered whole
        host, weights, gradients, optimizer_states = weights + gradients + optimizer_states, 0, 0, 0
    device = "cuda" if plan.accelerator == "gpu" else "cpu"
    probed = probe_plan(plan)
    block, rest, loss = _per_block_and_rest(config_json, probed)
    n_layer, tokens, batch_size = _n_layer(config), block_size, plan.micro_batch_size
    kept = plan.checkpointed_blocks  # the first `kept` blocks keep only their inputs
    activations, recompute = n_layer * block(tokens) + rest(tokens), 0.0
    if kept:  # backward recomputes one checkpointed block at a time
        kept_block, kept_rest, _ = _per_block_and_rest(config_json, replace(probed, n_layer=1, checkpointed_blocks=1))
        activations = kept * kept_block(tokens) + (n_layer - kept) * block(tokens) + kept_rest(tokens)
        recompute = block(tokens)
    chunk = min(plan.loss_chunk_tokens or tokens, tokens) * (batch_size if not plan.loss_chunk_tokens else 1)
    logits_transient = chunk * config.vocab_size * 4 * 2  # fp32 logits of one chunk and their gradient
    if plan.bf16_weights_computed_in_fp32:  # the LM head's fp32 copy while the loss is made (storage16.py)
        logits_transient += config.vocab_size * shape(config)[1] * 4
    # a 4-bit matrix dequantized for its matmul: its bf16 values, then (under fp32 math) their fp32 copy
    logits_transient += dequantized * (2 + (4 if plan.bf16_weights_computed_in_fp32 else 0))
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer_states=optimizer_states,
        activations=max(0, int(batch_size * activations)),
        logits_loss=max(0, int(batch_size * loss(tokens))),
        overhead=int(batch_size * (recompute + block(tokens)) + logits_transient) + whole,
        block_activations=max(0, int(batch_size * block(tokens))),
        host=host,
        trained_parameters=trained,
        plan={"block_size": block_size, "batch_size": batch_size, "precision": plan.precision,
              "gradient_checkpointing": kept if 0 < kept < n_layer else bool(kept),
              "lora": plan.trains_lora, "optimizer": plan.optimizer,
              **({"step_in_backward": True} if plan.step_in_backward else {}),
              **({"adapter": plan.adapter.settings} if plan.adapter is not None else {}),
              **({"upcast_bf16_weights": True} if plan.bf16_weights_computed_in_fp32 else {}),
              **({"four_bit_base": True} if plan.four_bit_base else {}),
              "chunked_loss": plan.loss_chunk_tokens is not None, "device": device,
              **({"shards": plan.shards, "gathered_for": plan.gathered_for} if plan.shards > 1 else {}),
              **({"offload": True} if plan.offload else {})},
    )
