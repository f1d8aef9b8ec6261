"""The optimizers a plan can name, and exactly how much state each keeps.

| optimizer   | state per trained parameter                 | trade-off                                  |
|-------------|---------------------------------------------|--------------------------------------------|
| "adamw"     | two copies in the parameter's dtype (fp32)  | the reference; torch's fused kernel        |
| "adamw8bit" | two 8-bit copies + one fp32 scale per 256   | ~1/4 of AdamW's state; loss curves close;  |
|             | (tensors under 4096 values stay full size)  | needs torchao, compiles its step once; bf16|
|             |                                             | weights (precision="bf16-true") are updated|
|             |                                             | with stochastic rounding: no fp32 copy     |
| "adafactor" | factored second moment, no first moment     | a few MB of state; loss falls more slowly  |
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from ..hardware import INSTALL_TORCHAO, eight_bit_available

# torchao's AdamW8bit quantizes a state tensor in blocks of 256 values with one fp32 scale each and
# a 256-entry fp32 code book, and only tensors of at least 4096 values whose size is a multiple of
# the block (as bitsandbytes does).
EIGHT_BIT_BLOCK = 256
EIGHT_BIT_MIN_VALUES = 4096
EIGHT_BIT_CODE_BOOK_BYTES = 256 * 4

# torchao 0.18's single_param_adam, as _adamw8bit_compiled_once calls it
TORCHAO_UPDATE_ARGUMENTS = ("p", "grad", "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "lr", "beta1", "beta2",
                            "weight_decay", "eps", "IS_ADAMW", "BF16_STOCHASTIC_ROUND")

# the optimizers a plan can name (built here), and how plans, the planner and the card table name them
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")
OPTIMIZER_NAMES = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW", "adafactor": "Adafactor"}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: decaying biases and LayerNorm gains just hurts."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def check_optimizer_name(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}.")


def check_optimizer(optimizer: str) -> None:
    """A clear error before training for an unknown optimizer or a missing optional package."""
    check_optimizer_name(optimizer)
    if optimizer == "adamw8bit" and not eight_bit_available():
        raise ImportError(f"optimizer='adamw8bit' needs torchao: {INSTALL_TORCHAO}, or use optimizer='adamw'.")


def build_optimizer(model: nn.Module, weight_decay: float, learning_rate: float, adam_epsilon: float,
                    optimizer: str) -> torch.optim.Optimizer:
    """The named optimizer over the weights that train.

    AdamW uses the fused kernel (CPU and CUDA), which avoids foreach's full-size
    temporaries. The 8-bit AdamW is torchao's: unlike bitsandbytes' it runs on CPU
    as well as CUDA (its update is torch.compile'd, so the first step is slow).
    """
    return optimizer_over(parameter_groups(model, weight_decay), learning_rate, adam_epsilon, optimizer)


def optimizer_over(groups: list[dict], learning_rate: float, adam_epsilon: float,
                   optimizer: str) -> torch.optim.Optimizer:
    """The named optimizer over these parameter groups (build_optimizer's, or one tensor's: in_backward.py)."""
    check_optimizer(optimizer)
    if optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=learning_rate, eps=(1e-30, 1e-3), scale_parameter=False,
                         relative_step=False, warmup_init=False)
    if optimizer == "adamw8bit":
        # bf16 weights (no fp32 master copy) take each update rounded stochastically: unbiased, where rounding
        # to nearest would drop every update smaller than half a bf16 step (tests/test_optimizers.py)
        return _adamw8bit_compiled_once()(groups, lr=learning_rate, eps=adam_epsilon, block_size=EIGHT_BIT_BLOCK,
                                          bf16_stochastic_round=True)
    device_types = {p.device.type for group in groups for p in group["params"]}
    fused = device_types <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, lr=learning_rate, eps=adam_epsilon, fused=fused)


@functools.cache
def _adamw8bit_compiled_once() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit with its update compiled once.

    torchao 0.18 calls ``torch.compile(single_param_adam, ...)(...)`` inside its loop
    (pytorch/ao#2500), building a wrapper for every tensor at every step, which costs more than the
    update of a small tensor (`benchmarks/optimizer_step.py`; timings in benchmarks/RESULTS.md).  The
    step below is torchao's loop, the
    same calls in the same order, without its DTensor branch (no strategy here gives DTensor
    parameters); the states, their checkpoints and the update are torchao's own.  A torchao whose
    update takes other arguments gets its own AdamW8bit back.
    """
    from torchao.optim import AdamW8bit, adam

    single_param_adam = getattr(adam, "single_param_adam", None)
    if single_param_adam is None or tuple(inspect.signature(single_param_adam).parameters) != TORCHAO_UPDATE_ARGUMENTS:
        return AdamW8bit
    update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)  # compiles at its first call

    class AdamW8bitCompiledOnce(AdamW8bit):
        @torch.no_grad()
        def step(self, closure: Callable[[], float] | None = None) -> float | None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # one compiled graph per parameter shape: a model has few, so no cache limit (as torchao)
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    if not isinstance(group["lr"], torch.Tensor):
                        raise RuntimeError("optimizer='adamw8bit' needs each group's lr as a tensor; update it "
                                           "with param_groups[i]['lr'].fill_(new_lr).")
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p] or self._initial_state(p, group["amsgrad"])
                        state["step"] += 1
                        update(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                               state.get("max_exp_avg_sq"), group["lr"], group["betas"][0], group["betas"][1],
                               group["weight_decay"], group["eps"], self.is_adamw,
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

        def _initial_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
            state = self.state[p]
            state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(p, True),
                         exp_avg_sq=self._new_buffer(p, False))
            if amsgrad:
                state["max_exp_avg_sq"] = self._new_buffer(p, False)
            return state

    return AdamW8bitCompiledOnce


def optimizer_state_bytes(params: list[nn.Parameter], optimizer: str) -> int:
    """Exactly what the optimizer allocates for these parameters."""
    if optimizer == "adafactor":  # transformers' Adafactor, factored, no first moment
        return sum(((p.shape[-1] + p.shape[-2]) if p.ndim >= 2 else p.numel()) * 4 + 4 for p in params)  # + RMS
    if optimizer == "adamw8bit":
        return sum(_eight_bit_state_bytes(p) for p in params)
    # torch's fused AdamW: exp_avg, exp_avg_sq in the parameter's dtype, and a float32 step tensor
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def _eight_bit_state_bytes(param: nn.Parameter) -> int:
    """Two states (codes + block scales + code book, or full-size zeros) and a float32 step."""
    n = param.numel()
    if n >= EIGHT_BIT_MIN_VALUES and n % EIGHT_BIT_BLOCK == 0:
        per_state = n + (n // EIGHT_BIT_BLOCK) * 4 + EIGHT_BIT_CODE_BOOK_BYTES
    else:
        per_state = n * param.element_size()
    return 2 * per_state + 4


# Optimizer-state tensor subclasses a checkpoint may rebuild; nothing else is imported from a file.
PORTABLE_STATE_CLASSES = frozenset({"torchao.optim.subclass_8bit.OptimState8bit"})
SUBCLASS_KEY = "tensor_subclass"


def portable_optimizer_states(states: list[dict]) -> list[dict]:
    """The optimizers' state dicts with tensor subclasses (torchao's 8-bit states) stored as
    their plain inner tensors: Lightning loads checkpoints with torch.load(weights_only=True)
    and a callable map_location, which cannot rebuild a wrapper subclass (torch 2.13).
    New dicts: an optimizer's state dict shares its per-parameter dicts with the optimizer.  (A sharded
    run's ranks but 0 have an empty one: rank 0 alone writes the checkpoint, sharding.py.)"""
    return [{**state, "state": {index: {key: _flatten(value) for key, value in per_param.items()}
                                for index, per_param in state["state"].items()}} if state else state
            for state in states]


def restore_optimizer_states(states: list[dict]) -> list[dict]:
    """The inverse of portable_optimizer_states, for classes in PORTABLE_STATE_CLASSES only."""
    return [{**state, "state": {index: {key: _unflatten(value) for key, value in per_param.items()}
                                for index, per_param in state["state"].items()}}
            for state in states]


def _flatten(value: object) -> object:
    if not hasattr(value, "__tensor_flatten__"):
        return value
    names, context = value.__tensor_flatten__()
    return {SUBCLASS_KEY: f"{type(value).__module__}.{type(value).__qualname__}",
            "inner": {name: getattr(value, name) for name in names}, "context": context,
            "size": tuple(value.size()), "stride": tuple(value.stride())}


def _unflatten(value: object) -> object:
    if not (isinstance(value, dict) and SUBCLASS_KEY in value):
        return value
    name = value[SUBCLASS_KEY]
    if name not in PORTABLE_STATE_CLASSES:
        raise ValueError(f"The checkpoint's optimizer state holds a {name}, which lowmem_aitextgen does not "
                         "load; resume=False starts afresh.")
    module, _, cls = name.rpartition(".")
    subclass = getattr(importlib.import_module(module), cls)
    return subclass.__tensor_unflatten__(value["inner"], value["context"], torch.Size(value["size"]),
                                         value["stride"])
