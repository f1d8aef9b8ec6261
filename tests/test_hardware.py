"""hardware: this machine read in one place, any card or CPU presented in its stead, and the budget and
summary made from what it answers."""

import json

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.cards import planned
from lowmem_aitextgen.training import budget
from lowmem_aitextgen.training.report import RunRecorder

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("devices presented as data")

GIB = 2**30


def test_this_machine_is_read_as_it_is():
    machine = hardware.cpu()
    assert machine.name and machine.bf16_native == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert machine.available > 0 and machine.resident > 0
    assert (hardware.gpu() is None) == (not torch.cuda.is_available())
    assert hardware.bf16_native("cpu") == machine.bf16_native


def test_what_is_presented_answers_inside_the_with_and_the_machine_after():
    real = hardware.cpu().name
    t4 = hardware.Hardware(hardware.CPUS["no native bf16"], hardware.CARDS["T4"])
    with hardware.presenting(t4):
        assert hardware.gpu() is hardware.CARDS["T4"] and not hardware.bf16_native("cpu")
        with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
            assert hardware.gpu() is None and hardware.bf16_native("cpu")
        assert hardware.gpu() is hardware.CARDS["T4"]
    assert hardware.cpu().name == real


@pytest.mark.parametrize("capability, bf16, fp16", [((9, 0), True, True), ((8, 0), True, True), ((7, 5), False, True),
                                                   ((7, 0), False, True), ((5, 3), False, True), ((5, 2), False, False)])
def test_native_16_bit_math_by_capability(capability, bf16, fp16):
    card = hardware.card("card", 8, capability)
    assert (card.bf16, card.fp16) == (bf16, fp16)
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"], card)):
        assert hardware.bf16_native("gpu") == bf16 and hardware.native_half_precision("gpu") == fp16


def test_what_holds_a_card_is_split_into_this_process_cache_its_tensors_and_the_others():
    card = hardware.GPU("card", total=16 * GIB, free=5 * GIB, capability=(8, 0), reserved=3 * GIB, allocated=2 * GIB)
    assert card.cached == GIB and card.held_elsewhere == 8 * GIB
    made = budget.gpu_budget(card, resident=GIB)  # the model being trained holds 1 of the 2 GiB allocated
    assert made.available == 5 * GIB + GIB + GIB and made.this_process_elsewhere == GIB
    assert made.bytes == made.available - made.margin and made.margin < 0.06 * made.available + 400 * 2**20


@pytest.mark.parametrize("available, resident", [(20 * GIB, GIB // 2), (512 * 2**20, 300 * 2**20)])
def test_a_cpu_budget_is_what_this_process_may_grow_to_less_a_margin_and_never_negative(available, resident):
    machine = hardware.CPU("cpu", bf16_native=False, available=available, resident=resident)
    with hardware.presenting(hardware.Hardware(machine)):
        made = budget.device_budget("cpu", resident=0)
    assert made.margin == max(GIB, available // 10)
    assert made.bytes == max(0, available + resident - made.margin) and made.device == str(machine)


def test_the_summary_records_the_card_its_free_memory_the_margin_and_the_budget(tmp_path):
    plan, _ = planned("355M", "T4", True)
    summary = RunRecorder(plan, 0.01).summary(GPT2LMHeadModel(tiny_gpt2_config()), str(tmp_path))["plan"]
    card = hardware.CARDS["T4"]
    assert summary["budget"]["device"] == str(card) and summary["budget"]["available"] == card.free
    assert summary["budget"]["bytes"] == summary["budget_bytes"] == card.free - summary["budget"]["margin"]
    assert summary["precision"] == "16-mixed"


def test_a_run_on_a_presented_cpu_records_it_and_trains_in_fp32_where_bf16_is_emulated(
        corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    slow = hardware.CPUS["no native bf16"]
    with hardware.presenting(hardware.Hardware(slow)):
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=2, fp16=True, generate_every=0,
                 save_every=0)
    with open(tmp_path / "out" / "training_summary.json", encoding="utf-8") as f:
        plan = json.load(f)["plan"]
    assert plan["precision"] == "32-true"  # fp16=True on a CPU without native bf16
    assert plan["budget"]["device"] == str(slow) and plan["budget"]["available"] == slow.available + slow.resident
    assert plan["budget_bytes"] == plan["budget"]["available"] - plan["budget"]["margin"]
