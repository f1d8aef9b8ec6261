"""Out-of-memory recovery: the step is redone with half the micro-batch and twice the accumulation."""

import dataclasses
import json
import os
import weakref

import pytest
import pytorch_lightning as pl
import torch

from conftest import CtrlC, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.training.estimate import estimate_plan, memory_plan
from lowmem_aitextgen.training.oom import cheaper_plan, is_out_of_memory, rungs

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("out-of-memory recovery is ours; Lightning's loop under it is test_run's")

COMMON = dict(num_steps=6, learning_rate=1e-2, warmup_steps=2, save_every=0, generate_every=0, seed=1,
              pin_micro_batch=True)  # the splits compared are the ones given


class SeenData(pl.Callback):
    """The sequences of the micro-batches that finished, in order."""

    def __init__(self) -> None:
        self.sequences: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sequences.extend(batch.tolist())

    def per_step(self, effective_batch: int = 4) -> list[list[list[int]]]:
        return [self.sequences[i:i + effective_batch] for i in range(0, len(self.sequences), effective_batch)]


def fails_above(model, max_batch: int, after_calls: int):
    """Make the model run out of memory for micro-batches above max_batch, after a number of
    forward calls (as a GPU would once a longer or later batch needs more than it has)."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if calls[0] > after_calls and input_ids.shape[0] > max_batch:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    return model.base_model.register_forward_pre_hook(hook, with_kwargs=True)  # the chunked loss calls the body


def test_out_of_memory_redoes_the_step_with_a_smaller_micro_batch(small_data, base_folder, tokenizer_file,
                                                                  caplog):
    """Out of memory in step 3 at micro-batch 4: training continues from step 2 at micro-batch 2 x 2
    and ends with exactly the weights of a run that switched to micro-batch 2 after step 2."""
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    fails_above(ai.model, max_batch=2, after_calls=2)
    seen_recovered = SeenData()
    ai.train(small_data, output_dir="recovered", batch_size=4, callbacks=[seen_recovered], **COMMON)
    assert any("Out of memory in step 3" in r.message and "micro-batch 2 x 2" in r.message for r in caplog.records)
    with open("recovered/training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 6
    assert summary["plan"]["micro_batch_size"] == 2 and summary["plan"]["gradient_accumulation_steps"] == 2

    switched = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    switched.train(small_data, output_dir="switched", batch_size=4, callbacks=[CtrlC(at_step=1)], **COMMON)
    switched.train(small_data, output_dir="switched", batch_size=2, gradient_accumulation_steps=2, resume=True,
                   **COMMON)
    for key, value in switched.model.state_dict().items():
        assert torch.equal(ai.model.state_dict()[key], value), key
    assert not os.path.exists("recovered/last.ckpt")
    # the data, split into optimizer steps, is that of a run at micro-batch 2 x 2 throughout (weights are
    # not compared with that run: Adam turns the rounding of 4 vs 2 + 2 sequences into visible changes)
    throughout = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    seen_throughout = SeenData()
    throughout.train(small_data, output_dir="throughout", batch_size=2, gradient_accumulation_steps=2,
                     callbacks=[seen_throughout], **COMMON)
    assert seen_recovered.per_step() == seen_throughout.per_step()
    assert len(seen_recovered.per_step()) == 6


def test_out_of_memory_with_nothing_left_stops_with_the_last_good_weights(small_data, base_folder,
                                                                           tokenizer_file):
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    fails_above(ai.model, max_batch=0, after_calls=2)  # even one sequence is too many from step 3 on
    with pytest.raises(MemoryError, match=r"Out of memory in step 3 with the smallest plan left.*after step 2"):
        ai.train(small_data, output_dir="out", batch_size=1, gradient_checkpointing=True, **COMMON)
    saved = aitextgen(model_folder="out")
    for key, value in saved.model.state_dict().items():
        assert torch.equal(ai.model.state_dict()[key], value), key
    assert torch.load("out/last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.parametrize("cpu", hardware.CPUS)
def test_cheaper_plan_order(cpu):
    plan = memory_plan("32-true", False, None, 4, "adamw", chunked_loss=False, n_layer=2)
    changes = []
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        while (step := cheaper_plan(plan)) is not None:
            change, plan = step
            changes.append(change)
    assert changes[:2] == ["micro-batch 2 x 2 accumulation", "micro-batch 1 x 4 accumulation"]
    native = hardware.CPUS[cpu].bf16_native  # emulated bf16 is no way out: 20x slower than fp32
    assert changes[2:] == ["gradient checkpointing", *(["mixed precision"] if native else []), "chunked loss"]
    assert plan.optimizer == "adamw" and not plan.trains_adapter  # never a change the checkpoint cannot follow
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.parametrize("cpu", hardware.CPUS)
def test_every_rung_recovery_steps_down_is_cheaper_keeps_the_effective_batch_and_is_reached(cpu):
    """From micro-batch 4 x 2 accumulation and the optimizer left open: every rung oom.rungs has is taken, in
    order, each estimated below the one before, the effective batch kept."""
    config = tiny_gpt2_config(n_layer=8, n_positions=256, dropout=0.1)  # activations dominate: every rung counts
    plan = dataclasses.replace(memory_plan("32-true", False, None, 4, "adamw", chunked_loss=False, n_layer=8),
                               accumulation=2)
    plans, changes = [plan], []
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        while (step := cheaper_plan(plans[-1])) is not None:
            changes.append(step[0])
            plans.append(step[1])
        # where a step is one sequence, the last rung updates inside backward (the same optimizer state)
        one_sequence = list(rungs(dataclasses.replace(plans[2], accumulation=1, micro_batch_size=1)))
    native = hardware.CPUS[cpu].bf16_native
    assert changes == ["micro-batch 2 x 4 accumulation", "micro-batch 1 x 8 accumulation", "gradient checkpointing",
                       *(["mixed precision"] if native else []), "chunked loss"]
    totals = [estimate_plan(config, p, 256).total for p in plans]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)
    assert all(p.effective_batch_size == 8 for p in plans)
    (_, before), (last, inside) = one_sequence[-2:]
    assert last == "updates inside backward (no gradient copy)"
    assert estimate_plan(config, inside, 256).total < estimate_plan(config, before, 256).total


@pytest.mark.parametrize("pinned", [False, True])
def test_at_one_sequence_a_step_recovery_steps_down_into_updates_inside_backward_unless_the_optimizer_was_given(
        pinned):
    """The last rung keeps the optimizer and its state (in_backward.py's state dict is an ordinary one)."""
    plan = memory_plan("32-true", False, None, 1, "adamw", chunked_loss=True, n_layer=2)
    plan = dataclasses.replace(plan, fixed=frozenset({"optimizer"} if pinned else ()))
    changes = []
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):
        while (step := cheaper_plan(plan)) is not None:
            change, plan = step
            changes.append(change)
    assert (changes[-1] == "updates inside backward (no gradient copy)") != pinned
    assert plan.step_in_backward != pinned and plan.optimizer == "adamw" and plan.accumulation == 1


def test_the_failed_steps_tensors_are_freed_before_the_retry(small_data, base_folder, tokenizer_file):
    """A real out-of-memory error leaves the step's activations referenced from its traceback; the retry
    must not start while they are alive (on a GPU they would make it run out of memory again)."""
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    failed = []

    def fail_after_the_body(module, args, kwargs, output):
        if output.last_hidden_state.shape[0] > 2 and not failed:
            failed.append(weakref.ref(output.last_hidden_state))  # holds the step's graph of activations
            raise torch.OutOfMemoryError("CUDA out of memory (injected after the forward)")

    ai.model.base_model.register_forward_hook(fail_after_the_body, with_kwargs=True)
    alive_at_retry = []

    class AtRetry(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            if failed:
                alive_at_retry.append(failed[0]() is not None)

    ai.train(small_data, output_dir="out", batch_size=4, callbacks=[AtRetry()], **{**COMMON, "num_steps": 3})
    assert alive_at_retry == [False]
