"""Fitting the training plan to a memory budget, before training starts.

train(max_memory="6GiB") (or, on a GPU, its free memory) picks the first plan
of a fixed ladder whose estimate fits, each rung cheaper in memory and no
faster than the one before.  Arguments the user gave explicitly are never
changed, and the effective batch (micro-batch x accumulation) always stays
what the user asked for.

The ladder, from the user's own plan:
  1. gradient checkpointing          (recompute each block in backward: ~1/3 more compute)
  2. mixed precision                 (bf16 where the device has it, else fp16 with loss scaling)
  3. chunked loss                    (the LM head's matmul twice)
  4. 8-bit AdamW                     (block-quantized states; skipped without torchao)
  5. smaller micro-batch, more accumulation (down to 1: the same gradients, less parallelism)
  6. LoRA, only with lora="auto"     (trains adapters instead of every weight)
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator

import torch

from .chunked_loss import default_chunk_tokens
from .estimate import MemoryEstimate, estimate_plan
from .memory import format_bytes
from .optimizers import eight_bit_available
from .plan import LoraSettings, TrainPlan, resolve_precision

logger = logging.getLogger("lowmem_aitextgen")

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Left free on a GPU when no max_memory is given: the CUDA context, allocator
# fragmentation, and what the estimate does not see.
GPU_MARGIN_FRACTION, GPU_MARGIN_MIN = 0.10, 512 * 2**20


def parse_bytes(max_memory: int | float | str) -> int:
    """6GiB, "6 GB", "500MiB" or a number of bytes."""
    if isinstance(max_memory, (int, float)) and not isinstance(max_memory, bool) and max_memory > 0:
        return int(max_memory)
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(max_memory))
    if not match or match[2].lower() not in UNITS or float(match[1]) <= 0:
        raise ValueError(f"max_memory={max_memory!r} is not an amount of memory; write e.g. max_memory='6GiB', "
                         "'7.5GB' or a number of bytes.")
    return int(float(match[1]) * UNITS[match[2].lower()])


def default_budget(accelerator: str) -> int | None:
    """A GPU's free memory less a margin; None on CPU (no fitting unless max_memory is given)."""
    if accelerator != "gpu" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free - max(GPU_MARGIN_MIN, GPU_MARGIN_FRACTION * total))


def smaller_micro_batch(plan: TrainPlan) -> TrainPlan | None:
    """The next smaller micro-batch that divides the effective batch, with accumulation to match."""
    effective = plan.effective_batch_size
    smaller = max((d for d in range(1, plan.micro_batch_size) if effective % d == 0), default=None)
    if smaller is None:
        return None
    return dataclasses.replace(plan, micro_batch_size=smaller, accumulation=effective // smaller)


def ladder(plan: TrainPlan, allow_lora: bool) -> Iterator[tuple[str, TrainPlan]]:
    """(what changed, plan) for each rung, cumulative, starting with the plan as given; the choices in
    plan.fixed (the user's) are never changed."""
    explicit = plan.fixed
    yield "the plan as given", plan
    if "gradient_checkpointing" not in explicit and not plan.gradient_checkpointing:
        plan = dataclasses.replace(plan, gradient_checkpointing=True)
        yield "gradient checkpointing", plan
    if not explicit & {"fp16", "precision"} and plan.half_dtype is None:
        plan = dataclasses.replace(plan, precision=resolve_precision(True, None, plan.accelerator))
        yield "mixed precision", plan
    if "chunked_loss" not in explicit and not plan.loss_chunk_tokens:
        plan = dataclasses.replace(plan, loss_chunk_tokens=default_chunk_tokens(plan.accelerator))
        yield "chunked loss", plan
    if "optimizer" not in explicit and plan.optimizer == "adamw" and eight_bit_available():
        plan = dataclasses.replace(plan, optimizer="adamw8bit")
        yield "8-bit AdamW", plan
    while (smaller := smaller_micro_batch(plan)) is not None:  # batch_size is part of the effective batch
        plan = smaller
        yield f"micro-batch {plan.micro_batch_size} x {plan.accumulation} accumulation", plan
    if allow_lora and plan.lora is None:
        plan = dataclasses.replace(plan, lora=LoraSettings())
        yield "LoRA", plan


def fit_plan(config: object, plan: TrainPlan, block_size: int, budget: int,
             allow_lora: bool) -> tuple[TrainPlan, MemoryEstimate]:
    """The first plan of the ladder whose estimate fits `budget` bytes, or a clear error."""
    for change, candidate in ladder(plan, allow_lora):
        estimate = estimate_plan(config, candidate, block_size)
        if estimate.total <= budget:
            logger.info(f"Memory budget {format_bytes(budget)}: chosen after {change}, "
                        f"estimated {format_bytes(estimate.total)}.\n{estimate}")
            return candidate, estimate
    fixed = ", ".join(sorted(plan.fixed)) or "none"
    hint = "" if allow_lora or plan.lora else " or allow lora='auto'"
    raise MemoryError(
        f"No plan fits max_memory={format_bytes(budget)}: the smallest one needs "
        f"{format_bytes(estimate.total)} (arguments you fixed: {fixed}).\n{estimate}\n"
        f"Raise max_memory, use a smaller block_size or model{hint}."
    )


def fit_to_budget(plan: TrainPlan, config: object, block_size: int) -> TrainPlan:
    """The plan fitted to train()'s max_memory (on a GPU without it, the free memory less a margin),
    with the budget recorded; unchanged where there is no budget."""
    max_memory = plan.args.get("max_memory")
    budget = parse_bytes(max_memory) if max_memory is not None else default_budget(plan.accelerator)
    if budget is None:
        return plan
    fitted, _ = fit_plan(config, plan, block_size, budget, allow_lora=plan.args.get("lora") == "auto")
    return dataclasses.replace(fitted, budget=budget)
