"""cards: the planner on the hardware users have, presented as data (no GPU needed): every GPT-2 size, full
fine-tune, LoRA and lora="auto", block 1024, batch_size=1 x 8, on common cards, shared cards and both kinds
of CPU; and docs/memory.md's card table is what the same code writes."""

import dataclasses
import os
import subprocess
import sys

import pytest

from lowmem_aitextgen import cards, hardware
from lowmem_aitextgen.cards import TABLE_BLOCK, fits_table, hardware_named, planned
from lowmem_aitextgen.training import budget
from lowmem_aitextgen.training.estimate import GPT2_SIZES, model_config

GPUS = (*hardware.CARDS, *hardware.SHARED_CARDS)
CPUS = tuple(hardware.CPUS)
SIZES = tuple(GPT2_SIZES)
MIB = 2**20


def device_of(where):
    return hardware_named(where).gpu if where in GPUS else hardware.CPUS[where]


def plan_on(size, where, lora, **call):
    """planned() on a card (named in GPUS) or on a CPU (named in CPUS)."""
    if where in GPUS:
        return planned(size, where, lora, **call)
    return planned(size, None, lora, cpu=where, **call)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("where", GPUS + CPUS)
def test_each_plan_fits_its_budget_keeps_the_batch_and_computes_in_what_the_device_has(size, where):
    device = device_of(where)
    for lora in (False, True, "auto"):
        result = plan_on(size, where, lora)
        if isinstance(result, MemoryError):
            continue  # which cells may fail: test_every_size_plans_everywhere_with_lora_auto
        plan, estimate = result
        assert plan.effective_batch_size == 8
        assert budget.budgeted_bytes(plan, estimate) <= plan.budget.bytes
        assert plan.trains_lora == (lora is True) or lora == "auto"
        if where in GPUS:
            assert plan.accelerator == "gpu" and estimate.total <= plan.budget.bytes
            if not device.bf16:  # T4, V100, GTX 16xx: fp16 with loss scaling, or fp32 math on bf16-held weights
                # (or offloaded, in fp32: fp16's loss scaling is not used on offloaded gradients)
                fp32 = plan.bf16_weights_computed_in_fp32 or plan.offload
                assert plan.precision == ("32-true" if fp32 else "16-mixed"), (lora, plan)
            else:
                assert plan.precision.startswith("bf16") or plan.bf16_weights_computed_in_fp32, (lora, plan)
        else:
            assert plan.accelerator == "cpu"
            if not device.bf16_native:  # emulated bf16 is 20x slower: fp32 math, bf16 at most for storage
                assert plan.precision == "32-true", (lora, plan)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("where", GPUS + CPUS)
def test_lora_auto_and_8_bit_adamw_only_where_what_is_faster_does_not_fit(size, where):
    full, auto = plan_on(size, where, False), plan_on(size, where, "auto")
    if not isinstance(full, MemoryError):  # a full fine-tune that fits is kept
        assert dataclasses.replace(auto[0], data_seed=0) == dataclasses.replace(full[0], data_seed=0)
    elif not isinstance(auto, MemoryError):
        assert auto[0].trains_lora
    for lora in (False, True):
        result = plan_on(size, where, lora)
        if not isinstance(result, MemoryError) and result[0].optimizer == "adamw8bit":
            # with AdamW asked for, nothing fits on the card: offloading (GPU, full) or a 4-bit base (LoRA) are
            # the only ways left
            with_adamw = plan_on(size, where, lora, optimizer="adamw")
            assert isinstance(with_adamw, MemoryError) or (with_adamw[0].offload and not lora) or (
                with_adamw[0].four_bit_base and lora)


def test_every_size_plans_everywhere_with_lora_auto_the_xl_on_4_gib_on_a_4_bit_base():
    failing = {(size, where) for size in SIZES for where in GPUS + CPUS
               if isinstance(plan_on(size, where, "auto"), MemoryError)}
    assert failing == set()
    for where in ("4 GiB", "80 GiB, 4 GiB free"):  # its bf16 base alone is 2.9 GiB
        plan = plan_on("1558M", where, "auto")[0]
        assert plan.trains_lora and plan.four_bit_base and "needing LoRA on a 4-bit base" in plan.chosen_because


def test_a_run_that_fits_nothing_is_refused_naming_the_numbers_and_the_fix():
    message = str(plan_on("1558M", "80 GiB, 4 GiB free", False))
    assert "No plan fits the memory budget of 3.43 GiB (free GPU memory on H100 (80.0 GiB" in message
    assert "4.00 GiB, less a margin of" in message and "the smallest one needs" in message
    assert "Other processes hold 76.00 GiB of this card" in message
    assert "free memory on the device, give max_memory=" in message and "a smaller block_size" in message


@pytest.mark.parametrize("card", ["6 GiB", "8 GiB"])
def test_1558m_full_plans_on_6_and_8_gib_without_offloading_where_the_call_leaves_the_accumulation_out(card):
    """The table's call gives gradient_accumulation_steps=8, so the planner never updates inside backward for
    it, and its error says what to leave out; without it, 1558M full fine-tuning plans on the card within
    its budget, and the table's cell shows both.  On 6 GiB that takes Adafactor stepping the embedding in
    slices of rows (as one fp32 step it alone makes 1.2 GiB)."""
    refused = planned("1558M", card, False)
    assert isinstance(refused, MemoryError) and "Without gradient_accumulation_steps= the planner" in str(refused)
    plan, estimate = planned("1558M", card, False, gradient_accumulation_steps=1)
    assert plan.step_in_backward and not plan.offload and estimate.total <= plan.budget.bytes
    assert cards.cell("1558M", card, False).startswith("1×8 does not fit; without accumulation, bf16 weights")


@pytest.mark.parametrize("card", ["T4", "V100"])
def test_cards_without_bf16_train_in_fp16_with_loss_scaling(card):
    for lora in (False, True):
        plan, _ = planned("355M", card, lora)
        assert plan.precision == "16-mixed"


def test_a_shared_card_trains_355m_where_the_trainer_does():
    """The first GPU run: an 80 GB H100 with 8 or 4 GiB left by others was refused everything (a margin
    taken from the total); the Trainer trained 355M full in 5.55 GiB with 8 GiB free."""
    full8, _ = planned("355M", "80 GiB, 8 GiB free", False)
    assert not full8.trains_adapter and full8.budget.bytes > 7 * 2**30
    full4, estimate = planned("355M", "80 GiB, 4 GiB free", False)
    assert not full4.trains_adapter and full4.optimizer == "adamw8bit" and full4.gradient_checkpointing
    assert estimate.total <= full4.budget.bytes < 4 * 2**30
    lora4, _ = planned("355M", "80 GiB, 4 GiB free", True)
    assert lora4.trains_lora


def test_a_gpu_budget_is_the_free_memory_and_this_process_cache_less_a_margin_never_the_total():
    for name in GPUS:
        card = device_of(name)
        plan, _ = planned("124M", name, True)
        available = card.free + card.cached
        assert plan.budget.available == available
        assert 0 < plan.budget.margin <= 384 * MIB + 0.05 * available + 1  # libraries and fragmentation only
        assert plan.budget.bytes == available - plan.budget.margin
    cached = hardware.GPU("card", total=8 * 2**30, free=4 * 2**30, capability=(8, 6), reserved=3 * 2**30,
                          allocated=2**30)
    assert budget.gpu_budget(cached, resident=0).available == 6 * 2**30  # 2 GiB cached: this process's to use


def test_a_card_with_less_free_than_the_margin_has_a_budget_of_zero_and_says_so():
    almost_full = hardware.card("RTX 3070", 8, (8, 6), free_gib=0.25)
    zero = budget.gpu_budget(almost_full, resident=0)
    assert zero.bytes == 0
    plan, _ = planned("124M", "8 GiB", True)
    with pytest.raises(MemoryError) as refused:
        budget.fit_plan(model_config("124M"), plan, TABLE_BLOCK, zero)
    message = str(refused.value)
    assert "budget of 0 B (free GPU memory on RTX 3070 (8.0 GiB, capability 8.6): 256.00 MiB" in message
    assert "the smallest one needs" in message and "Other processes hold 7.75 GiB" in message


def test_a_notebook_that_already_holds_a_model_names_it_and_how_to_free_it():
    earlier = int(1.42 * 2**30)  # an fp32 355M from an earlier cell
    t4 = hardware.notebook_with_earlier_model(hardware.CARDS["T4"], held=earlier)
    fresh = budget.gpu_budget(hardware.CARDS["T4"], resident=0)
    shared = budget.gpu_budget(t4, resident=0)
    assert fresh.bytes - shared.bytes == pytest.approx(earlier * 0.95, rel=0.01)
    assert shared.this_process_elsewhere == earlier and shared.other_processes == fresh.other_processes
    assert budget.gpu_budget(t4, resident=earlier).this_process_elsewhere == 0  # the model being trained
    plan, estimate = planned("124M", "T4", True)
    message = budget.nothing_fits(plan, shared, estimate.total, estimate)
    assert "This process already holds 1.42 GiB of GPU tensors besides this model" in message
    assert "del old_ai" in message and "torch.cuda.empty_cache()" in message


# --- the documented card table (docs/memory.md) ---------------------------------------------------------


def test_the_documented_table_is_what_its_script_writes():
    """docs/memory.md's "What fits my card" rows, regenerated (the planner on each presented card): the same plans,
    each estimate within 1% (the probes measure the installed transformers' kernels)."""
    document = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "memory.md"), encoding="utf-8").read()
    start = document.index("<!-- fits-table: benchmarks/fits_table.py -->\n")
    documented = document[start:document.index("<!-- /fits-table -->")].splitlines()[1:]
    ours = fits_table().splitlines()
    assert documented[:2] == ours[:2] and len(documented) == len(ours)
    for theirs_row, our_row in zip(documented[2:], ours[2:]):
        for theirs, cell in zip(_cells(theirs_row), _cells(our_row), strict=True):
            assert theirs.split(": ")[0] == cell.split(": ")[0], (our_row, theirs_row)  # the same plan
            if ": " in cell:
                assert _gib(cell) == pytest.approx(_gib(theirs), rel=0.01), (our_row, theirs_row)
    assert f"block {TABLE_BLOCK}" in document[:start][-1500:]


def test_every_cell_where_nothing_fits_is_explained_in_one_sentence():
    document = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "memory.md"), encoding="utf-8").read()
    table = fits_table().splitlines()
    columns = _cells(table[0])[2:]
    failing = [f"**{cells[0]} {cells[1]} on {column}**" for cells in map(_cells, table[2:])
               for column, text in zip(columns, cells[2:], strict=True) if text == "does not fit"]
    assert failing and all(name in document for name in failing), failing
    assert document.count("does not fit**") == 0 and document.count("- **1558M") == len(failing)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def _gib(cell: str) -> float:
    number, unit = cell.split(": ")[-1].split()
    return float(number) * {"MiB": 1 / 1024, "GiB": 1}[unit]


def test_cli_estimate_table_prints_one_model_rows():
    result = subprocess.run([sys.executable, "-m", "lowmem_aitextgen.cli", "estimate", "124M", "--table"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2:] == fits_table(("124M",)).splitlines()[2:]
