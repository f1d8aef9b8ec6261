"""callbacks: periodic saves and the stop on a loss that stays NaN/inf."""

import pytest
import torch

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen

pytestmark = pytest.mark.edges  # Lightning's callback hooks


def test_persistent_nan_loss_stops_with_last_good_weights_saved(tokenizer_file, corpus_file, tmp_path):
    from lowmem_aitextgen.training.callbacks import TrainingDiverged

    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    good = ai.model.lm_head.weight.detach().clone()
    ai.model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    with pytest.raises(TrainingDiverged, match="NaN/inf for 20 optimizer steps"):
        ai.train(corpus_file, num_steps=100, save_every=0, generate_every=0, precision="32-true",
                 output_dir=str(tmp_path / "out"))
    saved = aitextgen(model_folder=str(tmp_path / "out"))
    assert torch.equal(saved.model.lm_head.weight, good)  # NaN steps never reached the weights


def test_save_every_writes_during_training(corpus_file, tokenizer_file, monkeypatch):
    from lowmem_aitextgen.training import outputs

    saved_at = []
    real = outputs.save_model
    monkeypatch.setattr(outputs, "save_model", lambda *a, **k: (saved_at.append(1), real(*a, **k))[1])
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, num_steps=6, save_every=2, generate_every=3, gradient_accumulation_steps=2)
    assert len(saved_at) == 3  # steps 2 and 4, then the final save


def test_a_signal_in_a_resumed_runs_first_step_stops_at_that_steps_end_not_its_first_micro_batch():
    """A resumed run starts at global_step N; StopOnSignal counted its steps from 0 there, so the end of the
    first micro-batch looked like a step's and a Ctrl-C stopped the run in the middle of an accumulation."""
    import signal
    import types

    from lowmem_aitextgen.training.resume import StopOnSignal

    trainer = types.SimpleNamespace(global_step=5, should_stop=False, strategy=types.SimpleNamespace(
        reduce_boolean_decision=lambda decision, all: decision))
    stop = StopOnSignal()
    stop.on_train_start(trainer, None)
    try:
        stop.received = signal.SIGINT  # Ctrl-C during the resumed run's first micro-batch of two
        stop.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
        assert not trainer.should_stop  # the step is not over: no optimizer step yet
        trainer.global_step = 6  # the second micro-batch ended the step
        stop.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 1)
        assert trainer.should_stop and "at step 6" in stop.reason
    finally:
        stop.undo()
