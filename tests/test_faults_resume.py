"""Resume checks the checkpoint before training, and signals stop a run with a checkpoint instead of
losing it (issue: nothing lost, nothing hangs, every bad input named)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import CtrlC, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("resume's checks are ours; Lightning's checkpoint loading runs in test_resume's marked tests")

pytestmark = pytest.mark.timeout(300)
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
COMMON = dict(num_steps=6, save_every=0, generate_every=0, seed=3, learning_rate=1e-2)


@pytest.fixture
def interrupted(small_data, base_folder, tokenizer_file):
    """output_dir 'run' holding the checkpoint of a run stopped by Ctrl-C after step 2 of 6
    (micro-batch 2 x accumulation 2)."""
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir="run", batch_size=2, gradient_accumulation_steps=2, callbacks=[CtrlC(1)],
             **COMMON)
    assert torch.load("run/last.ckpt", weights_only=True)["global_step"] == 2
    return "run"


def resume_with(small_data, tokenizer_file, model_folder, **changes):
    ai = aitextgen(model_folder=model_folder, tokenizer_file=tokenizer_file)
    kwargs = {**COMMON, "batch_size": 2, "gradient_accumulation_steps": 2, **changes}
    ai.train(small_data, output_dir="run", resume=True, **kwargs)


@pytest.mark.parametrize("changes, says", [
    (dict(batch_size=4), r"another effective batch size \(checkpoint 4, now 8\).*product is 4"),
    (dict(optimizer="adafactor"), r"another optimizer \(checkpoint adamw, now adafactor\).*optimizer='adamw'"),
    (dict(lora=True), r"another lora.*same lora"),
    (dict(freeze_layers=True, num_layers_freeze=1), "another frozen layers.*freeze_layers"),
    (dict(num_steps=2), "is at step 2, and num_steps=2 asks for no more.*num_steps above 2"),
], ids=["effective batch", "optimizer", "lora", "frozen layers", "no steps left"])
def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_training(
        interrupted, small_data, base_folder, tokenizer_file, changes, says):
    before = snapshot(interrupted)
    with pytest.raises(ValueError, match=says) as caught:
        resume_with(small_data, tokenizer_file, base_folder, **changes)
    assert "resume=" in str(caught.value) and "last.ckpt" in str(caught.value)
    assert snapshot(interrupted) == before  # the checkpoint is kept, not deleted


def test_a_checkpoint_of_another_model_size_is_refused(interrupted, small_data, tokenizer_file, tmp_path):
    GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)).save_pretrained(tmp_path / "deeper")
    before = snapshot(interrupted)
    with pytest.raises(ValueError, match=r"another base parameters \(transformer.h.2.*same model"):
        resume_with(small_data, tokenizer_file, str(tmp_path / "deeper"))
    assert snapshot(interrupted) == before


def test_a_checkpoint_not_written_by_train_is_refused(interrupted, small_data, base_folder, tokenizer_file):
    checkpoint = torch.load("run/last.ckpt", weights_only=True)
    del checkpoint["lowmem_aitextgen"]
    torch.save(checkpoint, "other.ckpt")
    with pytest.raises(ValueError, match="other.ckpt.* is not a checkpoint written by this version"):
        aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).train(
            small_data, output_dir="run", resume="other.ckpt", **COMMON)


def test_the_same_effective_batch_split_otherwise_resumes(interrupted, small_data, base_folder, tokenizer_file):
    resume_with(small_data, tokenizer_file, base_folder, batch_size=1, gradient_accumulation_steps=4)
    assert json.load(open("run/training_summary.json"))["steps"] == 6


def test_a_resumed_run_keeps_the_optimizer_the_budget_chose(small_data, base_folder, tokenizer_file):
    """max_memory chose 8-bit AdamW; resuming with the same arguments keeps it even where more memory
    is free now (its state is in the checkpoint)."""
    import dataclasses

    from lowmem_aitextgen.training.budget import budgeted_bytes
    from lowmem_aitextgen.training.estimate import estimate_plan, memory_plan

    config = tiny_gpt2_config()
    smallest_adamw = dataclasses.replace(memory_plan("bf16-mixed", True, None, 1, "adamw", True, n_layer=2),
                                         accumulation=2, hold_freed_heap=True)
    tight = budgeted_bytes(smallest_adamw, estimate_plan(config, smallest_adamw, 32)) - 1  # only 8-bit fits
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir="run", batch_size=2, max_memory=tight, callbacks=[CtrlC(1)], **COMMON)
    assert json.load(open("run/training_summary.json"))["plan"]["optimizer"] == "AdamW8bitCompiledOnce"
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir="run", batch_size=2, resume=True, **COMMON)
    assert json.load(open("run/training_summary.json"))["plan"]["optimizer"] == "AdamW8bitCompiledOnce"


# --- signals in a child process -----------------------------------------------------------


def start(small_data, tokenizer_file, base_folder, output_dir, num_steps, resume=False):
    return subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "train_until_signalled.py"), small_data,
                             tokenizer_file, base_folder, output_dir, str(num_steps), str(int(resume))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(child, step: int) -> None:
    for line in child.stdout:
        if line.strip() == f"step {step}":
            return
    raise AssertionError(f"the child ended before step {step}: {child.stderr.read()[-2000:]}")


def test_sigterm_checkpoints_saves_a_loadable_model_and_exits_143(small_data, base_folder, tokenizer_file):
    """docker stop / Kubernetes / SLURM pre-emption: at most one step is lost, the scheduler sees failure,
    and resume=True ends with the weights an uninterrupted run reaches."""
    child = start(small_data, tokenizer_file, base_folder, "stopped", 8)
    wait_for_step(child, 2)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 143, err[-2000:]
    assert "returned" not in out and "exiting with status 143" in err
    stopped_at = torch.load("stopped/last.ckpt", weights_only=True)["global_step"]
    assert stopped_at in (2, 3)
    summary = json.load(open("stopped/training_summary.json"))
    assert summary["steps"] == stopped_at and "interrupted (SIGTERM)" in summary["stopped_because"]
    assert all(torch.isfinite(p).all() for p in aitextgen(model_folder="stopped").model.parameters())

    resumed = start(small_data, tokenizer_file, base_folder, "stopped", 8, resume=True)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0 and "returned" in out, err[-2000:]
    uninterrupted = start(small_data, tokenizer_file, base_folder, "whole", 8)
    out, err = uninterrupted.communicate(timeout=120)
    assert uninterrupted.returncode == 0, err[-2000:]
    whole, continued = (aitextgen(model_folder=f).model.state_dict() for f in ("whole", "stopped"))
    for key, value in whole.items():
        assert torch.equal(continued[key], value), key


def test_ctrl_c_in_a_script_checkpoints_and_returns(small_data, base_folder, tokenizer_file):
    child = start(small_data, tokenizer_file, base_folder, "stopped", 8)
    wait_for_step(child, 2)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "returned" in out, err[-2000:]
    assert "interrupted (Ctrl-C)" in json.load(open("stopped/training_summary.json"))["stopped_because"]
    assert os.path.exists("stopped/last.ckpt")


def test_a_second_sigterm_stops_at_once_and_leaves_nothing_torn(small_data, base_folder, tokenizer_file):
    child = start(small_data, tokenizer_file, base_folder, "stopped", 50)
    wait_for_step(child, 2)
    child.send_signal(signal.SIGTERM)
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=120)
    assert child.returncode != 0
    if os.path.exists("stopped/config.json"):
        aitextgen(model_folder="stopped")
    if os.path.exists("stopped/last.ckpt"):
        torch.load("stopped/last.ckpt", weights_only=True)


STARTS_OVER = """
import sys
from lowmem_aitextgen import aitextgen
data, base, tokenizer = sys.argv[1:4]
aitextgen(model_folder=base, tokenizer_file=tokenizer).train(data, output_dir="fresh", num_steps=1, resume=True,
                                                             generate_every=0)
"""


def test_starting_over_is_said_where_the_user_sees_it(small_data, base_folder, tokenizer_file):
    """No logging configured (a plain script): the warning still reaches stderr; INFO lines do not."""
    result = subprocess.run([sys.executable, "-c", STARTS_OVER, small_data, base_folder, tokenizer_file],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resume=True, but 'fresh' has no last.ckpt: training starts from the beginning." in result.stderr
    assert "Training plan:" not in result.stderr + result.stdout
