"""budget: the fastest plan that fits, from tables of budgets; the effective batch and explicit arguments
kept; a clear failure.  Out-of-memory recovery's rungs are test_oom.py's."""

import dataclasses
import json
import os
import sys

import pytest
from transformers import GPT2LMHeadModel

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, cards, hardware
from lowmem_aitextgen.arguments import parse_bytes
from lowmem_aitextgen.training.budget import CallPlan, budgeted_bytes, fit_plan, open_choices, tiers
from lowmem_aitextgen.training.estimate import estimate_plan, memory_plan
from lowmem_aitextgen.training.plan import IN_BACKWARD, PlannerInputs

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("planner decisions; a GPT-2 model is only the shape a call's plan is built from (the models "
                    "train() builds are test_checkpointing's and test_run's)")

# Activations dominate (8 blocks, 256 tokens, small vocabulary): every choice moves the estimate.
CONFIG = tiny_gpt2_config(n_layer=8, n_positions=256, dropout=0.1)
BLOCK = 256


PINNED = PlannerInputs(pin_micro_batch=True)  # batch_size x gradient_accumulation_steps kept as given


def user_plan(batch_size=1, accumulation=4, fixed=("precision",), **fields):
    plan = memory_plan("32-true", False, None, batch_size, "adamw", chunked_loss=True)
    return dataclasses.replace(plan, accumulation=accumulation, n_layer=8, fixed=frozenset(fixed), **fields)


def needs(plan) -> int:
    return budgeted_bytes(plan, estimate_plan(CONFIG, plan, BLOCK))


@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * 2**30), ("7.5 GB", 7_500_000_000), ("500MiB", 500 * 2**20), (123456789, 123456789), ("2048000", 2048000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["6 GiBs", "lots", -1, "0GB", True])
def test_parse_bytes_refuses_what_is_not_an_amount(text):
    with pytest.raises(ValueError, match="max_memory=.*e.g. max_memory='6GiB'"):
        parse_bytes(text)


def test_with_memory_to_spare_nothing_recomputes_and_the_micro_batch_is_the_whole_effective_batch():
    chosen, _ = fit_plan(CONFIG, user_plan(batch_size=1, accumulation=4), BLOCK, 2**40)
    assert (chosen.checkpointed_blocks, chosen.micro_batch_size, chosen.accumulation) == (0, 4, 1)
    assert not chosen.hold_freed_heap  # glibc left alone: no refaults
    assert "fastest plan within" in chosen.chosen_because


def test_a_pinned_split_between_the_needs_checkpoints_the_fewest_blocks_that_fit():
    """The documented table: micro-batch and precision fixed, each budget gets the fewest checkpointed
    blocks whose plan fits it; none when everything fits, all when only that does."""
    plan = user_plan()
    by_blocks = [needs(dataclasses.replace(plan, checkpointed_blocks=k)) for k in range(9)]
    assert by_blocks[8] < by_blocks[4] < by_blocks[0]  # (one block alone adds its recompute: more than it saves)
    for budget in by_blocks:
        chosen, estimate = fit_plan(CONFIG, plan, BLOCK, budget, PINNED)
        assert chosen.checkpointed_blocks == min(k for k, need in enumerate(by_blocks) if need <= budget)
        assert budgeted_bytes(chosen, estimate) <= budget
        assert (chosen.micro_batch_size, chosen.accumulation) == (1, 4)  # pinned
    assert len({fit_plan(CONFIG, plan, BLOCK, b, PINNED)[0].checkpointed_blocks for b in by_blocks}) == 8  # 0 and 2..8


@pytest.mark.parametrize("fraction", [1.0, 0.7, 0.4, 0.15, 0.0])
def test_every_choice_fits_keeps_the_effective_batch_and_is_the_fastest_that_fits(fraction):
    from lowmem_aitextgen.training.step_time import step_seconds

    plan = user_plan(batch_size=2, accumulation=4)
    all_needs = [needs(p) for p in open_choices(plan)]
    budget = int(min(all_needs) + fraction * (max(all_needs) - min(all_needs)))
    chosen, estimate = fit_plan(CONFIG, plan, BLOCK, budget)
    assert budgeted_bytes(chosen, estimate) <= budget
    assert chosen.effective_batch_size == 8 and chosen.precision == "32-true"  # precision was fixed

    def seconds(p):
        e = estimate_plan(CONFIG, p, BLOCK)
        return step_seconds(p, CONFIG, BLOCK, e.gradients // 4, True, e.activations, e.block_activations)

    fitting = [p for p in open_choices(chosen) if needs(p) <= budget]
    assert seconds(chosen) <= min(seconds(p) for p in fitting) + 1e-12


def test_explicit_arguments_are_kept_and_lora_needs_auto():
    plan = user_plan(fixed=("precision", "gradient_checkpointing", "optimizer"))
    smallest = needs(dataclasses.replace(plan, hold_freed_heap=True))
    with pytest.raises(MemoryError, match=r"(?s)No plan fits max_memory=.*smallest one needs.*lora='auto'"):
        fit_plan(CONFIG, plan, BLOCK, smallest - 1, PINNED)
    chosen, _ = fit_plan(CONFIG, plan, BLOCK, smallest, PINNED)
    assert chosen.checkpointed_blocks == 0 and chosen.hold_freed_heap  # the heap was the one choice left


def test_train_with_max_memory_fits_and_keeps_the_effective_batch(corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=CONFIG)
    plan = user_plan(batch_size=4, accumulation=2)
    budget = (needs(plan) + needs(plan.checkpointing_all())) // 2
    ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=2, batch_size=4, fp16=False,
             gradient_accumulation_steps=2, max_memory=budget, generate_every=0, pin_micro_batch=True)
    with open(tmp_path / "out" / "training_summary.json", encoding="utf-8") as f:
        chosen = json.load(f)["plan"]
    assert 0 < chosen["checkpointed_blocks"] < 8 and chosen["precision"] == "32-true"  # fp16=False was explicit
    assert (chosen["micro_batch_size"], chosen["gradient_accumulation_steps"]) == (4, 2)
    assert "fastest plan within" in chosen["chosen_because"] and chosen["budget_bytes"] == budget
    # the card table plans a call through the function train() plans with: the same call, the same plan
    call = cards.train_call(batch_size=4, fp16=False, gradient_accumulation_steps=2, max_memory=budget,
                            pin_micro_batch=True)
    tabled = CallPlan.of(GPT2LMHeadModel(CONFIG), call).fitted(BLOCK)
    assert (tabled.checkpointed_blocks, tabled.precision, tabled.micro_batch_size, tabled.accumulation) == (
        chosen["checkpointed_blocks"], chosen["precision"], 4, 2)


def test_nothing_fits_fails_before_writing(corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=CONFIG)
    with pytest.raises(MemoryError, match="No plan fits max_memory=1.00 MiB"):
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=1, max_memory="1MiB")
    assert not os.path.exists(tmp_path / "out")


def test_without_torchao_nothing_fits_names_the_tiers_not_tried_and_the_install_line(corpus_file, tokenizer_file,
                                                                                       tmp_path, monkeypatch):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=CONFIG)
    with pytest.raises(MemoryError) as with_torchao:
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=1, max_memory="1MiB")
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # as if torchao were not installed
    with pytest.raises(MemoryError) as without:
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=1, max_memory="1MiB")
    assert "torchao" not in str(with_torchao.value)
    assert str(without.value).endswith("a 4-bit base; pip install 'lowmem_aitextgen[8bit]' (torchao) makes them "
                                       "possible.")
    assert not os.path.exists(tmp_path / "out")




# each tier the planner has, and the words the pages say it in ("a|b": either; a new tier fails here until the
# pages say it and it has its words)
TIER_WORDS = {
    "8-bit AdamW": ["8-bit AdamW"],
    "16-bit weights with 8-bit AdamW": ["16-bit weights|bf16 weights"],
    "16-bit weights with 8-bit AdamW stepped inside backward": ["inside backward"],
    "16-bit weights with Adafactor stepped inside backward": ["Adafactor"],
    "offloading to host memory": ["offload"],
    "a 4-bit base (NF4)": ["4-bit base"],
    "LoRA": ["LoRA"],
    "LoRA on a 4-bit base (NF4)": ["LoRA", "4-bit base"],
}


def planner_tiers() -> list[str]:
    """The name of every tier budget.tiers weighs, for a full fine-tune with lora="auto" and for an adapter, on a
    presented card (where offloading is one)."""
    names = []
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"], gpu=hardware.CARDS["8 GiB"])):
        for lora in ("auto", True):
            call = CallPlan.of(GPT2LMHeadModel(CONFIG), cards.train_call(lora=lora, max_memory="1GiB"))
            names += [name for name, _ in tiers(call.built, CONFIG, call.asked) if name not in names]
    return [name.replace(f" {IN_BACKWARD}", " stepped inside backward") for name in names if name]


def test_every_tier_of_the_planner_is_on_the_guides_max_memory_row_and_in_the_memory_page():
    named = planner_tiers()
    assert len(named) >= 7 and not set(named) - set(TIER_WORDS), sorted(set(named) - set(TIER_WORDS))
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    with open(os.path.join(root, "MIGRATING.md"), encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `max_memory` |"))
    with open(os.path.join(root, "docs", "memory.md"), encoding="utf-8") as f:
        page = f.read()
    for tier in named:
        for text, where in ((row, "MIGRATING.md's max_memory row"), (page, "docs/memory.md")):
            said = all(any(word in text for word in words.split("|")) for words in TIER_WORDS[tier])
            assert said, f"{where} does not name the tier {tier!r}"
