"""max_memory: the documented ladder, the effective batch kept, explicit arguments kept, clear failure."""

import dataclasses
import json
import os

import pytest

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.budget import estimate_plan, fit_plan, ladder, parse_bytes
from lowmem_aitextgen.estimate import memory_plan

# Activations dominate (8 blocks, 256 tokens, small vocabulary): every rung of the ladder saves memory.
CONFIG = tiny_gpt2_config(n_layer=8, n_positions=256, dropout=0.1)
BLOCK = 256


def user_plan(batch_size=4, accumulation=2):
    plan = memory_plan("32-true", False, None, batch_size, "adamw", chunked_loss=False)
    return dataclasses.replace(plan, accumulation=accumulation)


@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * 2**30), ("7.5 GB", 7_500_000_000), ("500MiB", 500 * 2**20), (123456, 123456), ("2048", 2048),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["6 GiBs", "lots", -1, "0GB", True])
def test_parse_bytes_refuses_what_is_not_an_amount(text):
    with pytest.raises(ValueError, match="max_memory=.*e.g. max_memory='6GiB'"):
        parse_bytes(text)


# (budget: just above the estimate of this rung,
#  expected plan: (checkpointing, precision, chunked, optimizer, micro, lora))
RUNGS = [
    (False, "32-true", False, "adamw", 4, False),  # the plan as given
    (True, "32-true", False, "adamw", 4, False),  # + gradient checkpointing
    (True, "bf16-mixed", False, "adamw", 4, False),  # + mixed precision
    (True, "bf16-mixed", True, "adamw", 4, False),  # + chunked loss
    (True, "bf16-mixed", True, "adamw8bit", 4, False),  # + 8-bit AdamW (torchao is a test dependency)
    (True, "bf16-mixed", True, "adamw8bit", 2, False),  # + micro-batch 2 x 4
    (True, "bf16-mixed", True, "adamw8bit", 1, False),  # + micro-batch 1 x 8
    (True, "bf16-mixed", True, "adamw8bit", 1, True),  # + LoRA (lora="auto")
]


def describe(plan):
    return (plan.gradient_checkpointing, plan.precision, bool(plan.loss_chunk_tokens), plan.optimizer,
            plan.micro_batch_size, plan.lora is not None)


def test_each_budget_gets_the_documented_rung_with_the_same_effective_batch():
    plan = user_plan()
    rungs = [candidate for _, candidate in ladder(plan, allow_lora=True)]
    assert [describe(p) for p in rungs] == RUNGS
    totals = [estimate_plan(CONFIG, p, BLOCK).total for p in rungs]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)  # each rung saves memory
    for rung, total in enumerate(totals):
        chosen, estimate = fit_plan(CONFIG, plan, BLOCK, total, allow_lora=True)
        assert describe(chosen) == RUNGS[rung]
        assert estimate.total <= total  # fits its own estimate
        assert chosen.effective_batch_size == plan.effective_batch_size == 8


def test_explicit_arguments_are_kept_and_lora_needs_auto():
    plan = user_plan()
    fixed = dataclasses.replace(plan, fixed=frozenset({"gradient_checkpointing", "precision", "optimizer"}))
    rungs = [describe(p) for _, p in ladder(fixed, allow_lora=False)]
    assert all(not ckpt and precision == "32-true" and optimizer == "adamw" and not lora
               for ckpt, precision, _, optimizer, _, lora in rungs)
    smallest = estimate_plan(CONFIG, [p for _, p in ladder(plan, allow_lora=False)][-1], BLOCK).total
    with pytest.raises(MemoryError, match=r"(?s)No plan fits max_memory=.*the smallest one needs.*total.*lora='auto'"):
        fit_plan(CONFIG, plan, BLOCK, smallest - 1, allow_lora=False)


def test_train_with_max_memory_fits_and_keeps_the_effective_batch(corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=CONFIG)
    plan = memory_plan("32-true", False, None, 4, "adamw", chunked_loss=True)
    checkpointed = memory_plan("32-true", True, None, 4, "adamw", chunked_loss=True)
    budget = (estimate_plan(CONFIG, plan, BLOCK).total + estimate_plan(CONFIG, checkpointed, BLOCK).total) // 2
    ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=2, batch_size=4, fp16=False,
             gradient_accumulation_steps=2, max_memory=budget, generate_every=0)
    with open(tmp_path / "out" / "training_summary.json", encoding="utf-8") as f:
        chosen = json.load(f)["plan"]
    assert chosen["gradient_checkpointing"] and chosen["precision"] == "32-true"  # fp16=False was explicit
    assert chosen["micro_batch_size"] * chosen["gradient_accumulation_steps"] == 8


def test_nothing_fits_fails_before_writing(corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=CONFIG)
    with pytest.raises(MemoryError, match="No plan fits max_memory=1.00 MiB"):
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=1, max_memory="1MiB")
    assert not os.path.exists(tmp_path / "out")
