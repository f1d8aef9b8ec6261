"""Choosing the plan: the fastest whose memory estimate fits the budget.

The budget is train(max_memory=...) where given; else what hardware.py reads of the device, less a
margin, never below zero.  On a GPU: the card's free memory, what this process's caching allocator holds
unused and what the model's weights already hold there, less what the CUDA libraries load on first use
and a fraction for fragmentation (never a fraction of the card's total: on a shared card that is more
than is free).  On CPU: what this process may grow to (its resident size plus MemAvailable, at most a
cgroup's limit), less a margin for other programs.  On a GPU it bounds the training's tensors
(torch.cuda.max_memory_allocated, what the estimate counts); on CPU it bounds the process's resident
size, predicted as the libraries plus the estimate with the allocator's slack.  Mixed precision is a
choice only where the device computes it natively (plan.mixed_precision).

The planner weighs every combination of the choices the user left open, ranks those whose estimate
fits by expected step time (step_time.py) and takes the fastest; the effective batch (micro-batch x
accumulation) and every argument given are kept.  What it may change, and the trade-off:

| choice                          | faster                          | less memory                          |
|---------------------------------|---------------------------------|--------------------------------------|
| checkpointed blocks (k of n)    | none: no recompute              | all: ~1/3 more compute               |
| micro-batch (a divisor of the   | larger: fuller matmuls, fewer   | 1: one sequence's activations at a   |
| effective batch)                | steps of overhead               | time                                 |
| precision (unless fp16/precision| bf16 or fp16 where the device   | bf16/fp16 (half the activations),    |
| was given)                      | has it natively, else fp32      | only where native                    |
| chunked loss (if turned off)    | either: the same work           | on                                   |
| LoRA's frozen base in fp32      | fp32                            | bf16, upcast per layer (storage16.py)|
| plans (unless fp16/precision    |                                 |                                      |
| was given)                      |                                 |                                      |
| what a sharded process holds    | the step's weights and          | a block's weights while it computes  |
| gathered (strategy="fsdp")      | gradients: fewest collectives   |                                      |
| CPU heap (heap.py,              | glibc left alone                | held in a block, released at every   |
| heap_callbacks.py)              |                                 | block: no allocator slack, the       |
|                                 |                                 | activations faulted in every block   |
Only when no such plan fits, in turn: 8-bit AdamW (torchao installed; a quarter of AdamW's state,
slower steps), then weights and gradients in bf16 with no fp32 copy (precision="bf16-true", or computed in fp32 by
storage16.py where that is faster, as on a CPU without native bf16; 8-bit AdamW rounds each update
stochastically), then the same updated inside backward (in_backward.py: no gradient copy; no accumulation
and clipping per tensor, so never where optimizer= or gradient_accumulation_steps= was given), then with
Adafactor inside backward (a few MB of state, each tensor stepped through fp32), then offloading (a GPU),
then, for an adapter, its frozen base in 4 bits (four_bit.py: NF4, each matmul dequantizes its weight;
never where base_bits= was given), then LoRA with lora="auto" (adapters instead of every weight), then
that LoRA on a 4-bit base.  The 16-bit tiers need torchao (the 8bit
extra), whose 8-bit AdamW comes first.
pin_micro_batch=True keeps the micro-batch and accumulation exactly as given.

Out-of-memory recovery, which can change less (a resumed checkpoint must load), keeps its own rungs in oom.py.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterable, Iterator

import torch

from .. import hardware
from ..arguments import Arguments
from ..hardware import eight_bit_available, format_bytes
from ..heap import freed_memory_returned, glibc_heap_available, release_freed_heap
from . import storage16
from .adapters import loaded_adapter
from .estimate import MemoryEstimate, config_jsons, estimate_plan
from .optimizers import OPTIMIZER_NAMES
from .plan import (
    GATHERED_FOR,
    IN_BACKWARD,
    Budget,
    PlannerInputs,
    TrainPlan,
    build_plan,
    can_step_in_backward,
    default_chunk_tokens,
    mixed_precision,
    planner_inputs,
    processes_here,
)
from .step_time import offload_seconds, step_seconds

logger = logging.getLogger("lowmem_aitextgen")

# the optimizers of the tiers that update inside backward, in the planner's order: 8-bit AdamW, then
# Adafactor's few MB of state
IN_BACKWARD_OPTIMIZERS = ("adamw8bit", "adafactor")
FOUR_BIT_TIER = "a 4-bit base (NF4)"

# Left free when no max_memory is given.  On a GPU: what the CUDA libraries load on first use (kernels, loaded
# lazily, and cuBLAS's handles; the context itself is paid by the time mem_get_info answers) and the
# caching allocator's fragmentation, a fraction of what training may use.  Never a fraction of the card's
# total: on a shared card that is more than is free.  On CPU: other programs' growth.
GPU_LIBRARIES_BYTES = 384 * 2**20
GPU_FRAGMENTATION = 0.05
NAMED_HOLDINGS = 256 * 2**20  # what else holds a card is named, when nothing fits, from this size up
CPU_MARGIN_FRACTION, CPU_MARGIN_MIN = 0.10, 1024 * 2**20
# CPU resident size beyond the tensors: torch, transformers and Lightning (measured 0.45 GiB), and glibc's
# slack over the estimate, left alone or with the heap held and released at every block
# (heap_callbacks.py).  Left alone, each checkpointed block also leaves about 0.45 of its activations' size
# in freed heap that stays resident (355M at block 512, LoRA and full fine-tune: benchmarks/RESULTS.md).
CPU_LIBRARIES_BYTES = 480 * 2**20
HEAP_SLACK = {False: 1.03, True: 1.0}
FRAGMENTED_PER_CHECKPOINTED_BLOCK = 0.45


# --- the budget ----------------------------------------------------------------------------


def device_budget(accelerator: str, resident: int, processes: int = 1) -> Budget | None:
    """What training may use on this device (hardware.py's answers); `resident` is what the model's
    weights already hold on a GPU; on CPU, `processes` training processes on this machine share its
    memory, each planning for its equal share.  None where nothing can be read (then the plan is left as
    built)."""
    if accelerator == "gpu":
        card = hardware.gpu()
        return gpu_budget(card, resident) if card is not None else None
    gc.collect()  # what earlier runs in this process freed is this run's too: give it back to the OS first
    release_freed_heap()
    return cpu_budget(hardware.cpu(), processes)


def cpu_budget(machine: hardware.CPU, processes: int = 1) -> Budget | None:
    """What this process may hold on `machine`: its resident size and the available memory, less the margin
    (None where either cannot be read)."""
    if machine.available is None or machine.resident is None:
        return None
    margin = int(max(CPU_MARGIN_MIN, CPU_MARGIN_FRACTION * machine.available))
    available = machine.available + machine.resident
    return Budget(max(0, available - margin) // processes, "available memory", str(machine), available, margin,
                  processes=processes)


def gpu_budget(card: hardware.GPU, resident: int) -> Budget:
    """The card's free memory, what this process's allocator caches (free to it alone) and the model's own
    weights, less the margin: what this process has not loaded yet and fragmentation.  Never negative."""
    available = card.free + card.cached + resident
    margin = GPU_LIBRARIES_BYTES + int(GPU_FRAGMENTATION * available)
    return Budget(max(0, available - margin), "free GPU memory", str(card), available, margin,
                  this_process_elsewhere=max(0, card.allocated - resident), other_processes=card.held_elsewhere)


def budgeted_bytes(plan: TrainPlan, estimate: MemoryEstimate) -> int:
    """What the budget bounds: a GPU's allocated tensors; on CPU the resident size (libraries, tensors
    and the allocator's slack)."""
    if plan.accelerator == "gpu":
        return estimate.total
    fragmented = 0.0
    if not plan.hold_freed_heap:
        fragmented = FRAGMENTED_PER_CHECKPOINTED_BLOCK * plan.checkpointed_blocks \
            * estimate.block_activations
    return CPU_LIBRARIES_BYTES + int(estimate.total * HEAP_SLACK[plan.hold_freed_heap] + fragmented)


def budget_for(plan: TrainPlan, max_memory: int | None, resident: int) -> Budget | None:
    """max_memory (bytes, each process's), else the device's; on a GPU with the host memory an offloading plan
    may use.  The processes this machine runs share its host memory: each plans for its share (the CPU
    budget, and the host side of offloading)."""
    processes = max(1, processes_here(plan.accelerator, plan.devices))
    budget = Budget(max_memory, "max_memory") if max_memory is not None else \
        device_budget(plan.accelerator, resident, processes)
    if budget is None or plan.accelerator != "gpu":
        return budget
    host = device_budget("cpu", 0, processes)
    return dataclasses.replace(budget, host_bytes=host.bytes if host is not None else None, processes=processes)


# --- the fastest plan that fits ---------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def open_choices(plan: TrainPlan, config: object | None = None,
                 asked: PlannerInputs = PlannerInputs()) -> Iterator[TrainPlan]:
    """Every combination of the choices the user left open (checkpointed blocks, micro-batch,
    precision, chunked loss, CPU heap policy, and LoRA's base in bf16 under fp32 where the layers of a
    model of `config` are all ones storage16.py computes for), the effective batch kept."""
    fixed = plan.fixed
    blocks = [plan.checkpointed_blocks] if "gradient_checkpointing" in fixed else range(plan.n_layer + 1)
    micro = [plan.micro_batch_size] if asked.pin_micro_batch else divisors(plan.effective_batch_size)
    precisions = [plan.precision]
    if not fixed & {"fp16", "precision"}:
        precisions += [p for p in (mixed_precision(plan.accelerator), "32-true") if p not in (None, plan.precision)]
    chunks = [plan.loss_chunk_tokens]
    if "chunked_loss" not in fixed and not plan.loss_chunk_tokens:
        chunks.append(default_chunk_tokens(plan.accelerator))
    heaps = [False, True] if plan.accelerator == "cpu" and glibc_heap_available() else [False]
    if plan.step_in_backward and heaps == [False, True]:
        # each tensor's step frees its temporaries among the activations still alive: left alone, glibc keeps
        # them as slack the estimate does not count (1558M: 8.5 GiB resident, estimated 6.5; RESULTS.md)
        heaps = [True]
    effective = plan.effective_batch_size
    upcast = _upcast_choices(plan, config, asked)
    # what a process sharded across others holds whole (sharding.py); an offloaded one gathers per block
    gathered = GATHERED_FOR if plan.shards > 1 and not plan.offload else [plan.gathered_for]
    for k, m, precision, chunk, heap, base, kept in itertools.product(blocks, micro, precisions, chunks, heaps, upcast,
                                                                       gathered):
        if (base and precision != "32-true") or (kept == "step" and m == effective):  # one micro-batch: no step
            continue
        if plan.four_bit_base and precision == "32-true" and not base:  # its other weights are in 16 bits
            continue
        if plan.step_in_backward and not can_step_in_backward(effective // m, plan.sharded, precision):
            continue
        yield dataclasses.replace(plan, checkpointed_blocks=k, micro_batch_size=m, accumulation=effective // m,
                                  precision=precision, loss_chunk_tokens=chunk, hold_freed_heap=heap,
                                  upcast_bf16_weights=base, gathered_for=kept)


def _upcast_choices(plan: TrainPlan, config: object | None, asked: PlannerInputs) -> list[bool]:
    """Whether weights may be held in bf16 and computed in fp32 (storage16.py): a tier that asks for it keeps
    it; else offered for LoRA's base in fp32 only (mixed precision holds it in 16 bits anyway, and
    fp16=False/precision= given asks for fp32 weights; fp16=True asks for 16 bits, computed in fp32 where
    the device has no native 16-bit math), on models whose layers storage16.py computes for."""
    if plan.upcast_bf16_weights:
        return [True]
    if plan.four_bit_base:  # 16 bits beside it: upcast under fp32 math, autocast's dtype under mixed
        return [False, True]
    fp32_asked = "precision" in plan.fixed or asked.fp32_asked
    if plan.trains_adapter and not fp32_asked and config is not None and storage16.supported_config(config):
        return [False, True]
    return [False]


def tiers(plan: TrainPlan, config: object | None = None,
          asked: PlannerInputs = PlannerInputs()) -> Iterator[tuple[str, Iterable[TrainPlan]]]:
    """The plans to weigh, in groups; a later group only when nothing in an earlier one fits."""
    first = plan
    if plan.step_in_backward:  # resumed from that tier: its weights were in bf16, and stay so
        yield in_backward_tier(plan, config, asked)
        return
    yield "", open_choices(plan, config, asked)
    if "optimizer" not in plan.fixed and plan.optimizer == "adamw" and eight_bit_available():
        plan = dataclasses.replace(plan, optimizer="adamw8bit")
        yield "8-bit AdamW", open_choices(plan, asked=asked)
    # also where 8-bit AdamW was given or resumed: a run resumed from this tier must find it again
    if plan.optimizer == "adamw8bit" and not plan.fixed & {"fp16", "precision"}:
        yield "16-bit weights with 8-bit AdamW", sixteen_bit_weights(plan, config, asked)
        if in_backward_possible(plan, asked):
            for optimizer in IN_BACKWARD_OPTIMIZERS:
                yield in_backward_tier(stepping_in_backward(plan, optimizer), config, asked)
    if offload_possible(first):
        # not with fp16's loss scaling (nothing shows it right on offloaded gradients): fp32 where bf16 is not native
        yield "offloading to host memory", (p for p in open_choices(offloading(first), config, asked)
                                            if not p.precision.startswith("16"))
    if four_bit_possible(first, config):  # with the user's optimizer: an adapter's states are small anyway
        yield FOUR_BIT_TIER, open_choices(first.on_four_bit_base(), config, asked)
    if asked.lora_if_needed is not None and plan.adapter is None:
        lora = dataclasses.replace(plan, adapter=asked.lora_if_needed)  # with the optimizer of the tiers above
        lora = lora.on_four_bit_base() if asked.four_bit_asked else lora
        yield "LoRA", open_choices(lora, config, asked)
        if four_bit_possible(lora, config):
            yield f"LoRA on {FOUR_BIT_TIER}", open_choices(lora.on_four_bit_base(), config, asked)


def four_bit_possible(plan: TrainPlan, config: object | None) -> bool:
    """A 4-bit base (four_bit.py) for an adapter's base not in 4 bits yet, in one unsharded process, where the
    user left base_bits open, torchao is installed and storage16.py computes for every layer."""
    return (plan.trains_adapter and not plan.four_bit_base and not plan.sharded and "base_bits" not in plan.fixed
            and eight_bit_available() and config is not None and storage16.supported_config(config))


def sixteen_bit_weights(plan: TrainPlan, config: object | None, asked: PlannerInputs) -> Iterator[TrainPlan]:
    """`plan`'s choices with every weight held in bf16, no fp32 copy (8-bit AdamW rounds each update
    stochastically): computed in bf16 where the device has it natively, and in fp32 by storage16.py where
    it computes for the model's layers (faster where bf16 is emulated)."""
    choices = []
    if hardware.bf16_native(plan.accelerator):
        choices.append(open_choices(dataclasses.replace(plan, precision="bf16-true", fixed=plan.fixed | {"precision"}),
                                    asked=asked))
    if config is not None and storage16.supported_config(config):
        upcast = dataclasses.replace(plan, precision="32-true", fixed=plan.fixed | {"precision"},
                                     upcast_bf16_weights=True)
        choices.append(open_choices(upcast, asked=asked))
    return itertools.chain(*choices)


def stepping_in_backward(plan: TrainPlan, optimizer: str) -> TrainPlan:
    """`plan` updating inside backward with `optimizer`: the effective batch one micro-batch, and no fp16 loss
    scaling (the 16-bit tier then picks bf16 or fp32 math)."""
    return dataclasses.replace(plan, step_in_backward=True, micro_batch_size=plan.effective_batch_size, accumulation=1,
                               precision="32-true" if plan.precision == "16-mixed" else plan.precision,
                               optimizer=optimizer)


def in_backward_tier(plan: TrainPlan, config: object | None,
                     asked: PlannerInputs) -> tuple[str, Iterator[TrainPlan]]:
    """A tier of plans updating inside backward (`plan` does) with 16-bit weights, and its name."""
    return (f"16-bit weights with {OPTIMIZER_NAMES[plan.optimizer]} {IN_BACKWARD}",
            sixteen_bit_weights(plan, config, asked))


def in_backward_possible(plan: TrainPlan, asked: PlannerInputs) -> bool:
    """Updates inside backward (in_backward.py) for a full fine-tune in one unsharded process, where the user
    pinned neither the optimizer nor an accumulation (it accumulates nothing, and clips each tensor alone)."""
    return not (plan.trains_adapter or plan.sharded or "optimizer" in plan.fixed or asked.accumulation_pinned)


def offload_possible(plan: TrainPlan) -> bool:
    """Offloading (sharding.py) for a full fine-tune on one GPU (or already sharded), AdamW kept."""
    card = hardware.gpu()
    devices = plan.devices
    one_card = devices == 1 or (isinstance(devices, tuple) and len(devices) == 1) or (
        devices == "auto" and card is not None and card.count == 1)
    one_process = plan.strategy == "auto" and plan.num_nodes == 1 and one_card
    return (plan.accelerator == "gpu" and not plan.trains_adapter and not plan.offload
            and (one_process or plan.strategy == "fsdp") and (plan.optimizer == "adamw" or "optimizer" not in plan.fixed))


def offloading(plan: TrainPlan) -> TrainPlan:
    """`plan` with its weights, gradients and AdamW states in host memory (FSDP2 in one process or more), not
    compiled (compiling.py compiles no sharded model)."""
    return dataclasses.replace(plan, offload=True, strategy="fsdp", optimizer="adamw", fixed=plan.fixed | {"optimizer"},
                               torch_compile=None)


def fit_plan(config: object, plan: TrainPlan, block_size: int, budget: int | Budget,
             asked: PlannerInputs = PlannerInputs()) -> tuple[TrainPlan, MemoryEstimate]:
    """The fastest plan whose estimate fits the budget (bytes: max_memory), with why it was chosen, or a
    clear error."""
    from .plan import block_count

    budget = budget if isinstance(budget, Budget) else Budget(budget, "max_memory")
    plan = dataclasses.replace(plan, n_layer=plan.n_layer or block_count(config))
    native = hardware.bf16_native(plan.accelerator)
    jsons = config_jsons(config, plan.accelerator)
    smallest: tuple[int, MemoryEstimate] | None = None
    host_short: int | None = None  # the least host memory an offloading plan that fits the card needs
    for needed, candidates in tiers(plan, config, asked):
        ranked, too_big = [], []
        for candidate in candidates:
            estimate = estimate_plan(config, candidate, block_size, jsons)
            seconds = step_seconds(candidate, config, block_size, estimate.trained_parameters, native,
                                   estimate.activations, estimate.block_activations,
                                   (estimate.weights * candidate.shards, estimate.gradients * candidate.shards))
            needs = budgeted_bytes(candidate, estimate)
            host_fits = not candidate.offload or (budget.host_bytes is not None and estimate.host <= budget.host_bytes)
            (ranked if needs <= budget.bytes and host_fits else too_big).append((seconds, needs, candidate, estimate))
            if not host_fits and needs <= budget.bytes:
                host_short = min(host_short or estimate.host, estimate.host)
            elif smallest is None or needs < smallest[0]:
                smallest = needs, estimate
        if ranked:
            seconds, needs, chosen, estimate = min(ranked, key=lambda r: r[:2])
            faster = sorted((r for r in too_big if r[0] < seconds * 0.999), key=lambda r: r[:2])[:2]
            why = explain(chosen, needs, budget, needed, faster, estimate.host,
                          # host memory holds 16 bytes a parameter: fp32 weight, gradient and AdamW's two states
                          offload_seconds(chosen, chosen.n_layer, estimate.host // 16) if chosen.offload else 0.0)
            logger.info(f"{why}.\n{estimate}")
            return dataclasses.replace(chosen, budget=budget, chosen_because=why), estimate
    message = nothing_fits(plan, budget, *smallest, host_short, lora_offered=asked.lora_if_needed is not None)
    raise MemoryError("\n".join(filter(None, (message, in_backward_if_unpinned(plan, config, block_size, budget,
                                                                              asked), tiers_without_torchao()))))


def tiers_without_torchao() -> str | None:
    """Where torchao is missing, the tiers the planner could not try, with the install line: a budget that
    nothing fits may fit one of them."""
    if eight_bit_available():
        return None
    return ("Not tried, as torchao is not installed: 8-bit AdamW, 16-bit weights, updates inside backward and a "
            f"4-bit base; {hardware.INSTALL_TORCHAO} makes them possible.")


def in_backward_if_unpinned(plan: TrainPlan, config: object, block_size: int, budget: Budget,
                            asked: PlannerInputs) -> str | None:
    """Where nothing fits because the user pinned what updates inside backward change (the optimizer, an
    accumulation), and that tier would fit without the pins: what to leave out.  Never chosen silently."""
    pinned = [name for name, given in (("optimizer=", "optimizer" in plan.fixed - plan.checkpoint_fixes),
                                       ("gradient_accumulation_steps=", asked.accumulation_pinned)) if given]
    if not pinned or plan.trains_adapter or plan.sharded or plan.step_in_backward or not eight_bit_available():
        return None
    free = dataclasses.replace(asked, accumulation_pinned=False, pin_micro_batch=False)
    jsons = config_jsons(config, plan.accelerator)
    # the call without them: its own optimizer choice, and batch_size alone as the effective batch
    unpinned = dataclasses.replace(plan, fixed=plan.fixed - {"optimizer"},
                                   accumulation=1 if asked.accumulation_pinned else plan.accumulation)
    for optimizer in IN_BACKWARD_OPTIMIZERS:
        _, candidates = in_backward_tier(stepping_in_backward(unpinned, optimizer), config, free)
        for candidate in candidates:
            if budgeted_bytes(candidate, estimate_plan(config, candidate, block_size, jsons)) <= budget.bytes:
                return (f"Without {' and '.join(pinned)} the planner could fit this run by holding the weights in "
                        f"bf16 and updating them with {OPTIMIZER_NAMES[optimizer]} {IN_BACKWARD}: leave "
                        f"{' and '.join(pinned)} out to let it.")
    return None


def nothing_fits(plan: TrainPlan, budget: Budget, needs: int, estimate: MemoryEstimate,
                 host_short: int | None = None, lora_offered: bool = False) -> str:
    """Why no plan fits: the budget and what made it, the smallest plan's needs, what else holds the
    card where that is known, and the fixes."""
    fixed = ", ".join(sorted(plan.fixed - plan.checkpoint_fixes)) or "none"
    lora = "" if lora_offered or plan.trains_adapter else "lora=True (or lora='auto'), "
    where = budget if budget.source == "max_memory" else f"the memory budget of {budget}"
    held = checkpoint_holds(plan)
    lines = [f"No plan fits {where}: the smallest one needs {format_bytes(needs)} "
             f"(arguments you fixed: {fixed}{'; the checkpoint to resume fixes ' + held if held else ''}).",
             str(estimate)]
    if budget.this_process_elsewhere >= NAMED_HOLDINGS:
        lines.append(f"This process already holds {format_bytes(budget.this_process_elsewhere)} of GPU tensors "
                     "besides this model (an earlier model or run in this notebook?): delete them (del old_ai), "
                     "then run gc.collect() and torch.cuda.empty_cache().")
    if host_short is not None:
        each = f" in each of the {budget.processes} processes this machine runs" if budget.processes > 1 else ""
        lines.append(f"Offloading the weights, gradients and AdamW states to host memory would fit the card, but needs "
                     f"{format_bytes(host_short)} of host memory{each} and {format_bytes(budget.host_bytes or 0)} is "
                     "available (less a margin): free host memory, or use a machine with more.")
    if budget.other_processes >= NAMED_HOLDINGS:
        lines.append(f"Other processes hold {format_bytes(budget.other_processes)} of this card (nvidia-smi lists "
                     "them).")
    raise_it = "raise max_memory, " if budget.source == "max_memory" else \
        "free memory on the device, give max_memory= to plan for another budget, "
    lines.append(f"To train: {raise_it}use {lora}a smaller block_size or a smaller model"
                 + (", or pass resume=False to start over without the checkpoint." if held else "."))
    return "\n".join(lines)


def checkpoint_holds(plan: TrainPlan) -> str:
    """What the checkpoint being resumed holds the plan to, in words ("" where nothing)."""
    said = {"optimizer": f"the optimizer ({OPTIMIZER_NAMES.get(plan.optimizer, plan.optimizer)}: its state is in it)",
            "step_in_backward": "updates inside backward (one micro-batch a step)",
            "four_bit_base": "a 4-bit base (its adapter trained on one)"}
    return ", ".join(said[name] for name in sorted(plan.checkpoint_fixes) if name in said)


def explain(plan: TrainPlan, needs: int, budget: Budget, needed: str, faster: list, estimate_host: int = 0,
            offload_cost: float = 0.0) -> str:
    """The plan line's 'why': the budget, the estimate (and an offloading plan's host memory and what its
    copies cost a step), and the faster plans that did not fit."""
    from .plan import describe_checkpointing

    def short(p: TrainPlan) -> str:
        return (f"checkpointing {describe_checkpointing(p.checkpointed_blocks, p.n_layer)}, micro-batch "
                f"{p.micro_batch_size}x{p.accumulation}, {p.precision}"
                + ((" with a bf16 LoRA base" if p.trains_lora else " with a bf16 base" if p.trains_adapter else " with bf16 weights") if p.bf16_weights_computed_in_fp32 else "")
                + (", the base's block matrices in 4-bit NF4" if p.four_bit_base else "")
                + (", heap released every block" if p.hold_freed_heap else "")
                + (f", gathered whole for a {p.gathered_for}" if p.shards > 1 else ""))

    why = (f"chosen as the fastest plan within {budget}: {short(plan)}"
           + (f", needing {needed}" if needed else "") + f", estimated {format_bytes(needs)}")
    if plan.offload:
        why += (f", and {format_bytes(estimate_host)} of host memory (of {format_bytes(budget.host_bytes or 0)}): "
                f"each step moves the weights to the GPU and the gradients back, and AdamW runs on the CPU "
                f"(about {offload_cost:.1f} s a step more)")
    if faster:
        why += "; faster but too big: " + "; ".join(f"{short(p)} ({format_bytes(total)})" for _, total, p, _ in faster)
    return why


def fit_to_budget(plan: TrainPlan, asked: PlannerInputs, config: object, block_size: int,
                  weights_on_gpu: int = 0) -> TrainPlan:
    """The plan fitted to the budget (max_memory, else the device's), with the budget and the reason
    recorded; unchanged where no budget can be known."""
    budget = budget_for(plan, asked.max_memory, weights_on_gpu)
    if budget is None:
        return plan
    # the probes make and free model blocks at the model's width on the CPU: what they freed goes back to the
    # OS afterwards instead of staying resident in glibc's heap under the training it plans (no mallopt:
    # training's own heap settings must be the plan's, heap.py)
    with freed_memory_returned():
        fitted, _ = fit_plan(config, plan, block_size, budget, asked)
    return fitted


# --- a train() call planned: the one way, for train() and the card table ---------------------------


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """A train() call on its way to a plan, in train()'s two steps: built from the arguments and what the
    object holds (plan.build_plan), then, once the data's block size is known, fitted to the memory budget.
    train() and the card table (cards.py) both plan through it, so the table shows the plan train() makes."""

    built: TrainPlan
    asked: PlannerInputs
    config: object
    weights_on_gpu: int = 0  # what the model's weights already hold on a GPU (to_gpu=True): no longer free

    @classmethod
    def of(cls, model: torch.nn.Module, args: Arguments, *, constructor_checkpointing: bool | None = None,
           freeze_by_default: bool = False, resume_from: str | None = None,
           resumed: dict | None = None) -> CallPlan:
        """The call's plan as built; the defaults are a freshly constructed object's, starting a new run."""
        plan = build_plan(model, args, constructor_checkpointing=constructor_checkpointing,
                          freeze_by_default=freeze_by_default, loaded_adapter=loaded_adapter(model),
                          resume_from=resume_from, resumed=resumed)
        on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
        return cls(plan, planner_inputs(args), model.config, on_gpu)

    def fitted(self, block_size: int) -> TrainPlan:
        """The built plan fitted to the budget at `block_size` tokens (fit_to_budget)."""
        return fit_to_budget(self.built, self.asked, self.config, block_size, self.weights_on_gpu)
