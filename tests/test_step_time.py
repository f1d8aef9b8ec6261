"""step_time: the cost model the planner ranks by gets the orders right that were measured
(benchmarks/step_time_check.py; benchmarks/RESULTS.md)."""

import dataclasses

import pytest
from transformers import GPT2Config

from lowmem_aitextgen.training.adapter_settings import AdapterSettings
from lowmem_aitextgen.training.estimate import memory_plan
from lowmem_aitextgen.training.step_time import step_seconds

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("our cost model")

GPT2_355M = GPT2Config(n_layer=24, n_embd=1024, n_head=16)
PARAMETERS = 355_000_000


def seconds(device="cpu", config=GPT2_355M, block=512, trainable=PARAMETERS, **fields):
    plan = dataclasses.replace(memory_plan("bf16-mixed", False, None, 1, "adamw", True, device=device),
                               n_layer=config.n_layer, **fields)
    return step_seconds(plan, config, block, trainable)


def test_recompute_costs_time_in_proportion_to_the_blocks_checkpointed():
    none, half, every = (seconds(checkpointed_blocks=k) for k in (0, 12, GPT2_355M.n_layer))
    assert none < half < every
    assert 1.15 < every / none < 1.45  # one more forward of every block: about a quarter to a third more


def test_a_larger_micro_batch_is_faster_for_the_same_sequences_more_so_on_a_gpu():
    for device in ("cpu", "gpu"):
        one_by_eight = seconds(device, micro_batch_size=1, accumulation=8)
        eight_by_one = seconds(device, micro_batch_size=8, accumulation=1)
        assert eight_by_one < one_by_eight
    cpu_gain = seconds("cpu", micro_batch_size=1, accumulation=8) / seconds("cpu", micro_batch_size=8, accumulation=1)
    gpu_gain = seconds("gpu", micro_batch_size=1, accumulation=8) / seconds("gpu", micro_batch_size=8, accumulation=1)
    assert gpu_gain > cpu_gain


def test_lora_steps_are_faster_and_8_bit_adamw_slower_than_the_full_adamw_step():
    full = seconds()
    assert seconds(adapter=AdapterSettings.lora(), trainable=3_000_000) < full
    assert seconds(optimizer="adamw8bit") > full


def test_cpu_bf16_is_faster_where_the_cpu_computes_it_natively_and_slower_where_emulated():
    tiny = GPT2Config(n_layer=2, n_embd=64, n_head=4)  # GPT-2's vocabulary: the head dominates
    for config, trainable in ((tiny, 3_500_000), (GPT2_355M, PARAMETERS)):
        plan = dataclasses.replace(memory_plan("bf16-mixed", False, None, 1, "adamw", True), n_layer=config.n_layer)
        fp32 = dataclasses.replace(plan, precision="32-true")
        assert step_seconds(plan, config, 128, trainable, bf16_native=True) < step_seconds(fp32, config, 128, trainable)
        assert step_seconds(plan, config, 128, trainable, bf16_native=False) > step_seconds(fp32, config, 128, trainable)


def test_the_held_heap_costs_the_activations_faulted_back_in():
    plan = dataclasses.replace(memory_plan("bf16-mixed", False, None, 1, "adamw", True), n_layer=24,
                               hold_freed_heap=True)
    held = step_seconds(plan, GPT2_355M, 512, PARAMETERS, activation_bytes=2**31)
    alone = step_seconds(dataclasses.replace(plan, hold_freed_heap=False), GPT2_355M, 512, PARAMETERS,
                         activation_bytes=2**31)
    assert held - alone == pytest.approx(2.0)  # 2 GiB of activations, measured ~1 s a GiB
