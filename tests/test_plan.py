"""plan: the decisions a plan makes from train()'s arguments."""

import re

import pytest

from lowmem_aitextgen import hardware
from lowmem_aitextgen.training import plan

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("plan decisions on presented hardware; the models they build are test_checkpointing's and test_run's")

T4, H100 = hardware.CARDS["T4"], hardware.CARDS["80 GiB"]
OLD_GPU = hardware.card("GeForce GTX 970", 4, (5, 2))  # Maxwell: no native half math
NATIVE, EMULATED = hardware.CPUS["native bf16"], hardware.CPUS["no native bf16"]


@pytest.mark.parametrize("fp16, precision, accelerator, cpu, gpu, expected", [
    (True, None, "gpu", NATIVE, H100, "bf16-mixed"),
    (True, None, "gpu", NATIVE, T4, "16-mixed"),  # pre-Ampere GPU: fp16 with dynamic loss scaling
    (True, None, "gpu", NATIVE, OLD_GPU, "32-true"),  # no native 16-bit math: fp32, said once
    (True, None, "cpu", EMULATED, None, "32-true"),  # bf16 emulated: 20x slower, so fp32
    (True, None, "cpu", NATIVE, None, "bf16-mixed"),
    (None, None, "cpu", NATIVE, None, "bf16-mixed"),  # default: bf16 where the device computes it natively
    (None, None, "cpu", EMULATED, None, "32-true"),
    (None, None, "gpu", NATIVE, T4, "32-true"),  # the planner may still take fp16 (test_hardware.py)
    (False, None, "gpu", NATIVE, H100, "32-true"),  # an explicit fp16=False wins
    (True, "32", "gpu", NATIVE, H100, "32-true"),  # precision= wins over fp16
    (None, "bf16", "cpu", EMULATED, None, "bf16-mixed"),  # kept as asked, with a warning
])
def test_precision_selection(fp16, precision, accelerator, cpu, gpu, expected):
    with hardware.presenting(hardware.Hardware(cpu=cpu, gpu=gpu)):
        assert plan.resolve_precision(fp16, precision, accelerator) == expected


@pytest.mark.parametrize("fp16, precision, cpu, gpu, says", [
    (True, None, EMULATED, None, r"fp16=True: CPU with AVX2 only \(no native bf16\) has no native 16-bit math.*"
                                 r"about 20x the time of an fp32 step.*training in fp32"),
    (None, "bf16-mixed", EMULATED, None, r"precision='bf16-mixed': CPU with AVX2 only .* computes bf16 only "
                                         r"emulated \(about 20x.*kept as asked"),
    (True, None, NATIVE, OLD_GPU, r"fp16=True: GeForce GTX 970 .*capability 5.2\) has no native 16-bit math"),
    (None, "bf16-mixed", NATIVE, T4, r"precision='bf16-mixed': Tesla T4 .* computes bf16 only emulated"),
    (True, None, NATIVE, None, None), (None, None, EMULATED, None, None), (True, None, NATIVE, T4, None),
    (None, "16-mixed", NATIVE, T4, None), (False, None, EMULATED, None, None),
])
def test_sixteen_bits_that_are_not_native_are_said_once_with_their_cost(fp16, precision, cpu, gpu, says):
    accelerator = "gpu" if gpu else "cpu"
    with hardware.presenting(hardware.Hardware(cpu=cpu, gpu=gpu)):
        note = plan.precision_note(fp16, precision, accelerator)
    if says is None:
        assert note is None
    else:
        assert re.search(says, note), note


def test_fp16_true_on_a_cpu_without_native_bf16_trains_in_fp32_and_says_so_once(caplog, tmp_path):
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config())
    with hardware.presenting(hardware.Hardware(cpu=EMULATED)), caplog.at_level("WARNING", "lowmem_aitextgen"):
        chosen = plan_for(model, n_gpu=0, fp16=True)
    assert chosen.precision == "32-true" and "fp16" in chosen.fixed
    assert [r.getMessage().startswith("fp16=True: CPU with AVX2 only") for r in caplog.records] == [True]


def plan_for(model, **kwargs):
    """The plan of a train() call with these arguments (the others at train()'s defaults)."""
    from lowmem_aitextgen.cards import plan_of_call

    return plan_of_call(model, **kwargs)


def test_each_decision_is_made_from_the_arguments_in_one_place():
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config())
    plan = plan_for(model, n_gpu=0, lora=True, lora_r=4, batch_size=2, gradient_accumulation_steps=3, seed=5)
    assert (plan.accelerator, plan.adapter.lora_fields()["r"], plan.effective_batch_size, plan.data_seed) == ("cpu", 4, 6, 5)
    assert plan.cpu_speedups and not plan.hold_freed_heap and plan.loss_chunk_tokens == 128  # budget.py may hold it
    assert plan.fixed == frozenset()  # nothing a budget may change was set
    fixed = plan_for(model, n_gpu=0, optimizer="adafactor", gradient_checkpointing=False).fixed
    assert fixed == {"optimizer", "gradient_checkpointing"}
    assert not plan_for(model, n_gpu=0).gradient_checkpointing  # 0.2M parameters: below 300M


def test_one_schedule_says_when_to_save_sample_and_evaluate():
    from lowmem_aitextgen.training.plan import Schedule

    schedule = Schedule(num_steps=10, save_every=4, generate_every=3, eval_every=4)
    steps = range(1, 11)
    assert [s for s in steps if schedule.saves_at(s)] == [4, 8]  # the last step: the run's own final save
    assert [s for s in steps if schedule.samples_at(s)] == [3, 6, 9]
    assert [s for s in steps if schedule.evaluates_at(s)] == [4, 8, 10]
    assert schedule.evaluates_at(5, stopping=True)  # a stop is evaluated, so the model it saves is weighed
    assert [s for s in steps if schedule.must_ask_evaluation_at(s)] == [10]  # off the interval
    assert schedule.lightning_validation(accumulation=3) == {"val_check_interval": 12, "check_val_every_n_epoch": None}
    quiet = Schedule(num_steps=10)
    assert not any(quiet.saves_at(s) or quiet.samples_at(s) or quiet.evaluates_at(s, True) for s in steps)
    assert quiet.lightning_validation(accumulation=3) == {}


def test_a_resumed_run_keeps_its_run_id_and_a_new_one_gets_its_own():
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config
    from lowmem_aitextgen.cards import train_call

    model = GPT2LMHeadModel(tiny_gpt2_config())
    first, second = plan_for(model, seed=1), plan_for(model, seed=1)
    assert first.run_id != second.run_id and first == second  # the name is not a decision
    resumed = plan.build_plan(model, train_call(seed=1), constructor_checkpointing=None, freeze_by_default=False,
                              loaded_adapter=None, resume_from="last.ckpt",
                              resumed={"run_id": first.run_id, "lora": None, "optimizer": "adamw"})
    assert resumed.run_id == first.run_id


def test_the_plan_holds_decisions_and_the_run_its_settings():
    """The planner's inputs and the run's settings are values of their own, read from the call once; the
    plan keeps no argument."""
    from dataclasses import fields

    from lowmem_aitextgen.cards import train_call

    assert "args" not in {f.name for f in fields(plan.TrainPlan)}
    call = train_call(lora="auto", lora_r=4, max_memory="2GiB", pin_micro_batch=True, fp16=False, num_steps=7,
                      seed=3, save_every=2, val_data=0.25, max_grad_norm=0)
    asked = plan.planner_inputs(call)
    assert (asked.max_memory, asked.pin_micro_batch, asked.fp32_asked) == (2 * 2**30, True, True)
    assert asked.lora_if_needed.lora_fields()["r"] == 4  # lora="auto" uses the call's LoRA settings
    settings = plan.run_settings(call)
    assert (settings.num_steps, settings.seed, settings.max_grad_norm, settings.held_out_fraction) == (7, 3, 0, 0.25)
    assert settings.schedule == plan.Schedule(7, save_every=2, generate_every=1000, eval_every=2)


def test_the_plan_stores_the_blocks_it_checkpoints_within_the_model():
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=3))
    every = plan_for(model, n_gpu=0, gradient_checkpointing=True)
    assert every.checkpointed_blocks == every.n_layer == 3 and every.checkpoints_every_block
    assert every.checkpointing_all() == every
    with pytest.raises(ValueError, match="checkpointed_blocks=4 must be between 0 and the model's n_layer=3"):
        plan.TrainPlan(n_layer=3, checkpointed_blocks=4)


@pytest.mark.parametrize("lora", [True, False, "auto"])
def test_lora_is_one_adapter_setting_and_checkpoints_written_with_a_lora_entry_still_resume(lora):
    """Before the adapter was one field a run description had "lora" (r, alpha, dropout, target_modules)
    beside "adapter": such a checkpoint resumes a LoRA run with the same settings, lora="auto" takes its LoRA,
    and a full fine-tune or other LoRA settings are refused naming LoRA's arguments."""
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config
    from lowmem_aitextgen.cards import train_call
    from lowmem_aitextgen.training.adapter_settings import AdapterSettings
    from lowmem_aitextgen.training.resume import base_parameters, check_resumable

    model = GPT2LMHeadModel(tiny_gpt2_config())
    old = {"run_id": "r", "base_parameters": base_parameters(model), "adapter": None, "optimizer": "adamw",
           "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": None}, "effective_batch_size": 1,
           "frozen_layers": None, "validation": None, "global_step": 2}
    call = train_call(lora=lora, num_steps=5)
    resumed = plan.build_plan(model, call, constructor_checkpointing=None, freeze_by_default=False, loaded_adapter=None,
                              resume_from="last.ckpt", resumed=old)
    assert resumed.adapter == (AdapterSettings.lora() if lora is not False else None)
    if lora is False:
        with pytest.raises(ValueError, match="another lora.*same lora"):
            check_resumable("last.ckpt", old, resumed, plan.run_settings(call), model)
    else:
        check_resumable("last.ckpt", old, resumed, plan.run_settings(call), model)
        other = {**old, "lora": {**old["lora"], "r": 4}}
        with pytest.raises(ValueError, match="another lora.*same lora"):
            check_resumable("last.ckpt", other, resumed, plan.run_settings(call), model)
