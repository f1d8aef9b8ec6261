"""What fits which card: train()'s own planner, run on the cards users have (hardware.CARDS), presented.

Nothing here decides anything: `planned` plans a train() call through the function train() plans with
(budget.CallPlan: built, then fitted to the budget) while hardware.py presents a card or a CPU, so docs/memory.md's
table, `lowmem_aitextgen estimate 355M --table` and the tests' hardware matrix show the decisions a user
on that card gets.  Everything is estimated; nothing is downloaded or trained.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

from . import hardware
from .arguments import Arguments, of_call
from .hardware import format_bytes
from .training.budget import CallPlan
from .training.estimate import GPT2_SIZES, MemoryEstimate, estimate_plan, model_config
from .training.optimizers import OPTIMIZER_NAMES
from .training.plan import TrainPlan

# The call the table shows: aitextgen's batch_size=1 with accumulation to an effective batch of 8, GPT-2's
# whole context.
TABLE_CALL = dict(batch_size=1, gradient_accumulation_steps=8)
TABLE_BLOCK = 1024
TRAININGS = {"full fine-tune": False, "LoRA": True}


def train_call(**given: object) -> Arguments:
    """The arguments of `ai.train("data.txt", **given)`, train()'s others at their defaults."""
    from .aitextgen import aitextgen

    return of_call(aitextgen.train, train_data="data.txt", **given)


def plan_of_call(model: torch.nn.Module, **given: object) -> TrainPlan:
    """The plan `ai.train("data.txt", **given)` builds on a freshly constructed model, before any budget."""
    return plan_of(model, train_call(**given))


def plan_of(model: torch.nn.Module, args: Arguments) -> TrainPlan:
    """The plan a train() call's arguments build on a freshly constructed model, before any budget."""
    return CallPlan.of(model, args).built


def hardware_named(card: str | None, cpu: str = "native bf16") -> hardware.Hardware:
    """hardware.CARDS[card] (or SHARED_CARDS[card]) beside hardware.CPUS[cpu]; card None: the CPU alone; a
    name of hardware.MACHINES: that machine, without a GPU."""
    if card in hardware.MACHINES:
        return hardware.Hardware(cpu=hardware.MACHINES[card])
    gpu = None if card is None else {**hardware.CARDS, **hardware.SHARED_CARDS}[card]
    return hardware.Hardware(cpu=hardware.CPUS[cpu], gpu=gpu)


@functools.lru_cache(maxsize=512)
def planned(size: str, card: str | None, lora: bool | str, cpu: str = "native bf16", block: int = TABLE_BLOCK,
            **call: object) -> tuple[TrainPlan, MemoryEstimate] | MemoryError:
    """The plan train(lora=lora, **call) fits to GPT-2 `size` on the named card (or CPU) at `block` tokens,
    with its estimate; or the MemoryError train() would raise."""
    config = model_config(size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with hardware.presenting(hardware_named(card, cpu)):
        args = train_call(**{**TABLE_CALL, "lora": lora, **call})
        try:
            fitted = CallPlan.of(model, args).fitted(block)
        except MemoryError as error:
            return error
    return fitted, estimate_plan(config, fitted, block)


def describe(plan: TrainPlan, estimate: MemoryEstimate) -> str:
    """A table cell: the plan in a few words and its estimate."""
    precision = {"16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16 weights", "32-true": "fp32"}
    words = [precision.get(plan.precision, plan.precision)]
    if plan.bf16_weights_computed_in_fp32:
        words = ["bf16 base, fp32 math" if plan.trains_adapter else "bf16 weights, fp32 math"]
    if plan.four_bit_base:
        words[0] = "4-bit base, " + words[0].removeprefix("bf16 base, ")
    if plan.optimizer != "adamw":
        words.append(OPTIMIZER_NAMES[plan.optimizer])
    if plan.step_in_backward:
        words.append("inside backward")
    if plan.offload:
        words.append(f"offloaded ({format_bytes(estimate.host)} of host memory)")
    blocks = plan.checkpointed_blocks
    words.append(f"ckpt {blocks}/{plan.n_layer}" if blocks else "no ckpt")
    words.append(f"{plan.micro_batch_size}×{plan.accumulation}")
    return f"{', '.join(words)}: {format_bytes(estimate.total)}"


def fits_table(models: tuple[str, ...] = tuple(GPT2_SIZES),
               columns: tuple[str, ...] = (*hardware.CARDS, *hardware.MACHINES)) -> str:
    """A markdown table: for each GPT-2 size, full fine-tune and LoRA, the plan train() makes on each card and
    CPU machine (block 1024, batch_size=1 x 8 accumulation) and its estimate, or that none fits."""
    header = "| model | training | " + " | ".join(column_name(c) for c in columns) + " |"
    rows = [header, "|---|---|" + "---|" * len(columns)]
    for model in models:
        for label, lora in TRAININGS.items():
            rows.append(f"| {model} | {label} | " + " | ".join(cell(model, c, lora) for c in columns) + " |")
    return "\n".join(rows)


def column_name(column: str) -> str:
    if column in hardware.MACHINES:
        return f"CPU, {column}"
    card = hardware.CARDS[column]
    return f"{card.name.replace('GeForce ', '')}, {card.total / hardware.GIB:.0f} GiB"


def cell(model: str, column: str, lora: bool) -> str:
    """The plan of TABLE_CALL; where only its accumulation keeps the planner from updating inside backward
    (a user's pinned gradient_accumulation_steps= is never overridden), also the plan without it."""
    result = planned(model, column, lora)
    if not isinstance(result, MemoryError):
        return describe(*result)
    alone = planned(model, column, lora, gradient_accumulation_steps=1)
    if isinstance(alone, MemoryError) or not alone[0].step_in_backward:
        return "does not fit"
    return f"1×8 does not fit; without accumulation, {describe(*alone)}"
