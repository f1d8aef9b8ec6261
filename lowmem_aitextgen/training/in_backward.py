"""The optimizer step inside backward: each weight updated the moment its gradient is complete, and that
gradient freed at once, so a full fine-tune never holds a whole copy of the gradients (torchtune's
"optimizer in backward"; LOMO, arXiv 2306.09782).

| what changes from an ordinary step    | why                                 | what it costs                      |
|---------------------------------------|-------------------------------------|------------------------------------|
| no gradient copy of the model: one    | each tensor is stepped from its     | nothing a step computes; the       |
| tensor's gradient at a time           | post-accumulate-grad hook, then its | memory of every gradient but one   |
|                                       | gradient is dropped                 | (1558M in bf16: 3.1 GB less)       |
| no accumulation: the whole batch is   | a tensor is stepped at the end of   | activations of the whole batch     |
| one micro-batch                       | every backward                      | (the planner checkpoints for them) |
| clipping per tensor: each gradient    | the global norm needs every         | a tensor whose gradient is large   |
| scaled to at most max_grad_norm       | gradient before any step            | is damped on its own, not all      |
| alone (torch's clip_grads_with_norm_  |                                     | together (RESULTS.md: quality)     |
| rule, with that tensor's norm)        |                                     |                                    |
| a gradient that is not finite skips   | no step-wide skip is possible once  | the other tensors of that step are |
| its own tensor (counted)              | some tensors have stepped           | updated                            |
| through_fp32 (Adafactor on 16-bit     | rounded to nearest, an update below | the tensor's fp32 copy and gradient|
| weights): an fp32 copy of the one     | half a bf16 step would be lost      | while it steps, and the optimizer's|
| tensor steps, rounded back            |                                     | full-size temporaries              |
| stochastically                        |                                     |                                    |
| Adafactor on a large matrix, in       | transformers' step makes whole-size | three passes over the gradient     |
| slices of rows (adafactor_in_rows):   | fp32 copies, 14 bytes a value       | instead of one: on CPU faster (the |
| the same step, its factored           | (1558M's embedding: 1.1 GB beside   | slices stay in cache), on a GPU a  |
| statistics summed slice by slice      | 2.9 GiB of weights)                 | few ms a step (RESULTS.md)         |

Mixed precision with fp16's loss scaling cannot run here (the hooks would step with scaled gradients, and
GradScaler skips whole steps): plan.TrainPlan refuses the pair.  The state is one optimizer per tensor,
kept and restored as one ordinary state dict (resume is bit-equal).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.optimization import Adafactor

logger = logging.getLogger("lowmem_aitextgen")

# torch.nn.utils.clip_grads_with_norm_'s guard against dividing by a zero norm
CLIP_EPSILON = 1e-6
# The values of one slice of rows that adafactor_in_rows steps at a time: 8 MiB in fp32, which glibc serves
# from its heap under heap.HELD rather than mapping afresh for each slice.  A matrix with more is stepped in
# slices; their temporaries are at most SLICE_TEMPORARIES fp32 slices.
SLICE_VALUES = 2**21
SLICE_TEMPORARIES = 4


# Bytes per value of a tensor that its step inside backward makes beside its gradient (measured on a 50257 x
# 1600 bf16 tensor, benchmarks/in_backward_step.py): an fp32 copy as backward makes the gradient, and for
# Adafactor, stepped through fp32 (through_fp32), the fp32 weight and gradient and its own temporaries; a
# matrix it steps in slices of rows makes the fp32 copy and a few fp32 slices.
BACKWARD_FP32_COPY_BYTES = 4
IN_BACKWARD_STEP_BYTES = {"adamw": BACKWARD_FP32_COPY_BYTES, "adamw8bit": BACKWARD_FP32_COPY_BYTES, "adafactor": 14}


def in_slices(shape: torch.Size) -> bool:
    """Whether a tensor of `shape` is stepped by Adafactor in slices of rows (adafactor_in_rows)."""
    return len(shape) == 2 and shape.numel() > SLICE_VALUES


def step_bytes(param: torch.Tensor, optimizer: str) -> int:
    """One tensor's gradient and what its step inside backward makes beside it: what the estimate counts for a plan
    that steps inside backward."""
    if optimizer == "adafactor" and in_slices(param.shape):
        slices = SLICE_TEMPORARIES * SLICE_VALUES * 4
        return param.numel() * (param.element_size() + BACKWARD_FP32_COPY_BYTES) + slices
    return param.numel() * (param.element_size() + IN_BACKWARD_STEP_BYTES[optimizer])


def round_stochastically(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 to bf16, rounded up with the probability of the remainder (unbiased: an update smaller than half
    a bf16 step moves the weight on average, where rounding to nearest would drop it); other dtypes to
    nearest.  Random bits below bf16's 16 are added to the fp32 pattern, then cut off (torchao does the same
    for 8-bit AdamW)."""
    if dtype is not torch.bfloat16:
        return value.to(dtype)
    bits = value.view(torch.int32)
    noisy = bits + torch.randint_like(bits, 0, 1 << 16)
    return noisy.bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)


class StepInBackward(torch.optim.Optimizer):
    """One optimizer per trained tensor, stepped from that tensor's gradient hook.  Its own param_groups
    hold the learning rate a scheduler sets; step() only runs Lightning's closure (forward and backward, in
    which every tensor steps)."""

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 learning_rate: float, max_grad_norm: float = 0.0, through_fp32: bool = False) -> None:
        """through_fp32: 16-bit weights are stepped as an fp32 copy of the one tensor (the optimizer computes
        and keeps its state in fp32) and rounded back stochastically, for an optimizer that rounds to
        nearest (Adafactor, AdamW); 8-bit AdamW rounds stochastically itself."""
        super().__init__(groups, {"lr": learning_rate})
        self.max_grad_norm = max_grad_norm
        self.skipped_tensors = 0  # gradients that were not finite, each left its tensor as it was
        self.inner: list[torch.optim.Optimizer] = []
        self._hooks = []
        for index, group in enumerate(self.param_groups):
            # the learning rate is the inner optimizer's own default (a tensor for torchao), set at each step
            options = {key: value for key, value in group.items() if key not in ("params", "lr", "initial_lr")}
            for param in group["params"]:
                stepped = param
                if through_fp32 and param.dtype != torch.float32:  # its storage is set only while it steps
                    stepped = nn.Parameter(torch.empty(0, dtype=torch.float32, device=param.device))
                optimizer = make([{**options, "params": [stepped]}])
                self.inner.append(optimizer)
                # the group by its index: load_state_dict replaces the group dicts a scheduler then sets
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    functools.partial(self._step_tensor, index, optimizer)))

    @torch.no_grad()
    def _step_tensor(self, group: int, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
        grad = param.grad
        if not torch.isfinite(torch.stack(torch.aminmax(grad))).all():  # no mask the size of the gradient
            self.skipped_tensors += 1
            if self.skipped_tensors == 1:
                logger.warning("A gradient was not finite; its tensor was not updated this step (updates inside "
                               "backward skip a tensor, not the whole step).")
        else:
            if self.max_grad_norm:
                norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
                grad.mul_(torch.clamp(self.max_grad_norm / (norm + CLIP_EPSILON), max=1.0).to(grad.dtype))
            inner = optimizer.param_groups[0]
            lr = self.param_groups[group]["lr"]
            if isinstance(inner["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps lr as a tensor
                inner["lr"].fill_(lr)
            else:
                inner["lr"] = lr
            stepped = inner["params"][0]
            if stepped is param:
                optimizer.step()
            elif steps_in_rows(optimizer, param):
                adafactor_in_rows(optimizer, stepped, param, grad)
            else:
                stepped.data, stepped.grad = param.detach().float(), grad.float()
                param.grad = grad = None  # the 16-bit gradient's memory back before the step's temporaries
                optimizer.step()
                param.copy_(round_stochastically(stepped.data, param.dtype))
                stepped.data, stepped.grad = torch.empty(0, device=param.device), None
        param.grad = None

    @property
    def stepping(self) -> str:
        """The class of the optimizer each tensor is stepped with."""
        return type(self.inner[0]).__name__ if self.inner else ""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs the closure: its backward steps every tensor."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def state_dict(self) -> dict[str, Any]:
        """An ordinary optimizer's state dict: the groups, and each tensor's state under its index."""
        state = super().state_dict()
        inner = (optimizer.state_dict()["state"] for optimizer in self.inner)
        state["state"] = {index: own[0] for index, own in enumerate(inner) if own}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "state": {}})
        for index, optimizer in enumerate(self.inner):
            own = optimizer.state_dict()
            optimizer.load_state_dict({**own, "state": {0: state_dict["state"][index]}
                                       if index in state_dict["state"] else {}})

    def remove_hooks(self) -> None:
        """The model without the hooks (after training: a later backward must not step it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def steps_in_rows(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether `param`'s step through fp32 runs in slices of rows: a matrix of more than SLICE_VALUES values
    under the Adafactor optimizers.optimizer_over builds (no first moment, the learning rate as given)."""
    if not isinstance(optimizer, Adafactor) or not in_slices(param.shape):
        return False
    group = optimizer.param_groups[0]
    return group["beta1"] is None and not (group["relative_step"] or group["scale_parameter"] or group["warmup_init"])


@torch.no_grad()
def adafactor_in_rows(optimizer: Adafactor, stepped: nn.Parameter, param: torch.Tensor, grad: torch.Tensor,
                      slice_values: int = SLICE_VALUES) -> None:
    """transformers' Adafactor step of a matrix (factored second moment, no first moment), computed in fp32 a
    slice of rows at a time and rounded back into `param` stochastically: no fp32 copy of the whole weight,
    gradient or update.  Its statistics are sums over rows and columns, so three passes give the same step:
    the squared gradient's means, the update's RMS (for clipping), the update itself.  The state is the one
    transformers keeps, under `stepped`."""
    group, state = optimizer.param_groups[0], optimizer.state[stepped]
    rows, cols = param.shape
    if not state:
        state.update(step=0, RMS=0, exp_avg_sq_row=torch.zeros(rows, device=param.device),
                     exp_avg_sq_col=torch.zeros(cols, device=param.device))
    height = max(1, slice_values // cols)
    slices = [slice(start, start + height) for start in range(0, rows, height)]
    row_means, col_sum = torch.empty(rows, device=param.device), torch.zeros(cols, device=param.device)
    weight_squares = torch.zeros((), device=param.device)
    for rows_here in slices:
        squared = grad[rows_here].to(torch.float32, copy=True).square_().add_(group["eps"][0])  # grad stays
        row_means[rows_here] = squared.mean(dim=-1)
        col_sum += squared.sum(dim=0)
        weight_squares += param[rows_here].float().square().sum()
    state["step"] += 1
    state["RMS"] = weight_squares.sqrt() / param.numel() ** 0.5
    lr, beta2t = group["lr"], 1.0 - state["step"] ** group["decay_rate"]
    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
    row.mul_(beta2t).add_(row_means, alpha=1.0 - beta2t)
    col.mul_(beta2t).add_(col_sum / rows, alpha=1.0 - beta2t)
    row_factor = (row / row.mean()).rsqrt_().unsqueeze(-1)
    col_factor = col.unsqueeze(0).rsqrt()

    def unclipped(rows_here: slice) -> torch.Tensor:  # made twice, for its RMS and to apply: never whole
        return (row_factor[rows_here] * col_factor).mul_(grad[rows_here].float())

    update_squares = sum(unclipped(rows_here).square_().sum() for rows_here in slices)
    clip = ((update_squares.sqrt() / param.numel() ** 0.5) / group["clip_threshold"]).clamp_(min=1.0)
    for rows_here in slices:
        update = unclipped(rows_here).div_(clip).mul_(lr)
        weight = param[rows_here].float()
        if group["weight_decay"] != 0:
            weight.add_(weight, alpha=-group["weight_decay"] * lr)
        param[rows_here].copy_(round_stochastically(weight.sub_(update), param.dtype))
