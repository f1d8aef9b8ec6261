"""train(val_data=...): the validation loss, the best model kept, early stopping, resume, and nothing
changed for runs without it."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_report import png_text
from transformers import GPT2LMHeadModel

from conftest import CtrlC, corpus_text, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset
from lowmem_aitextgen.training.evaluation import holdout_split
from lowmem_aitextgen.training.report import PNG_DATA_KEY

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
BLOCK = 32  # tiny_gpt2_config's context, the blocks train() cuts


def write_texts(train_chars: int = 2000, val_chars: int = 1500) -> None:
    """train.txt and val.txt: neighbouring, different passages of the same documentation."""
    with open("train.txt", "w", encoding="utf-8") as f:
        f.write(corpus_text(train_chars))
    with open("val.txt", "w", encoding="utf-8") as f:
        f.write(corpus_text(train_chars + val_chars)[train_chars:])


def summary(output_dir: str) -> dict:
    with open(os.path.join(output_dir, "training_summary.json"), encoding="utf-8") as f:
        return json.load(f)


def val_blocks(tokenizer_file: str, path: str = "val.txt") -> torch.Tensor:
    """The validation text in consecutive blocks of BLOCK tokens (the last partial one left out)."""
    tokens = TokenDataset(path, tokenizer_file=tokenizer_file, block_size=1).tokens
    n = len(tokens) // BLOCK * BLOCK
    return torch.as_tensor(tokens[:n].astype(np.int64)).view(-1, BLOCK)


def mean_token_cross_entropy(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    """The plain definition: every next-token prediction of every block, averaged, in fp32."""
    model = model.float().eval()
    with torch.no_grad():
        logits = model(input_ids=blocks).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)).item()


def overfitting_run(tokenizer_file: str, output_dir: str, **kwargs) -> aitextgen:
    """A 128-wide model over-fits 2,000 characters within 200 steps at this rate.  In fp32 on every CPU: the
    tests weigh the saved model again by hand in fp32, and a CPU with native bf16 would train in bf16."""
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_embd=128))
    ai.train("train.txt", output_dir=output_dir, **{**dict(
        val_data="val.txt", num_steps=200, eval_every=10, learning_rate=1e-3, batch_size=4, save_every=0,
        generate_every=0, seed=1, precision="32-true"), **kwargs})
    return ai


def test_an_overfitting_run_keeps_its_best_model(tokenizer_file):
    write_texts()
    ai = overfitting_run(tokenizer_file, "out")
    result = summary("out")
    losses = [e["loss"] for e in result["validation"]]
    assert [e["step"] for e in result["validation"]] == list(range(10, 201, 10))
    best = int(np.argmin(losses))
    assert 0 < best < len(losses) - 1 and losses[-1] > losses[best] + 0.02  # fell, then rose
    assert result["best_step"] == result["validation"][best]["step"] and result["best_val_loss"] == losses[best]
    assert result["steps"] == 200 and result["stopped_because"] is None

    saved = GPT2LMHeadModel.from_pretrained("out")  # the model output_dir holds, weighed here by hand
    held_out = mean_token_cross_entropy(saved, val_blocks(tokenizer_file))
    assert held_out == pytest.approx(result["best_val_loss"], abs=1e-5)
    assert held_out < losses[-1] - 0.02
    in_file = load_file("out/model.safetensors")
    for name, value in ai.model.state_dict().items():  # the object holds the best model too
        if name in in_file:
            assert torch.equal(value, in_file[name]), name
    assert not os.path.exists("out/last.ckpt")  # a finished run

    plotted = json.loads(png_text("out/loss.png")[PNG_DATA_KEY])  # loss.png's second line
    assert plotted["val_loss"] == losses and plotted["val_step"] == [e["step"] for e in result["validation"]]


def test_early_stopping_stops_and_keeps_the_best(tokenizer_file, capsys):
    write_texts()
    overfitting_run(tokenizer_file, "out", early_stopping_patience=3, save_every=20)  # checkpoints on the way
    result = summary("out")
    losses = [e["loss"] for e in result["validation"]]
    assert result["stopped_because"] == "early_stopping" and result["steps"] < 200
    assert result["steps"] == result["validation"][-1]["step"] == result["best_step"] + 3 * 10
    assert result["best_val_loss"] == min(losses) and all(loss > min(losses) for loss in losses[-3:])
    assert "Early stopping at step" in capsys.readouterr().out
    held_out = mean_token_cross_entropy(GPT2LMHeadModel.from_pretrained("out"), val_blocks(tokenizer_file))
    assert held_out == pytest.approx(result["best_val_loss"], abs=1e-5)
    assert not os.path.exists("out/last.ckpt")  # stopping early ends the run: nothing to resume


@pytest.mark.parametrize("batch_size, chunked_loss", [(4, True), (2, False)])
def test_the_validation_loss_is_the_mean_token_cross_entropy(tokenizer_file, batch_size, chunked_loss):
    """Over blocks that do not divide into micro-batches evenly: every token weighs the same."""
    write_texts(val_chars=900)
    blocks = val_blocks(tokenizer_file)
    assert len(blocks) % batch_size
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train("train.txt", output_dir="out", val_data="val.txt", num_steps=1, learning_rate=1e-3,
             batch_size=batch_size, chunked_loss=chunked_loss, save_every=0, generate_every=0, seed=1,
             precision="32-true")  # the sum over tokens is checked, not bf16's rounding (a CPU with bf16 picks it)
    result = summary("out")
    assert result["best_step"] == 1 and len(result["validation"]) == 1
    assert result["best_val_loss"] == pytest.approx(mean_token_cross_entropy(ai.model, blocks), abs=1e-5)


def test_a_held_out_fraction_shares_no_token_with_training(tokenizer_file):
    write_texts()
    dataset = TokenDataset("train.txt", tokenizer_file=tokenizer_file, block_size=BLOCK)
    train, val = holdout_split(dataset, 0.2)
    n_blocks = len(dataset.tokens) // BLOCK
    assert len(val) == round(0.2 * n_blocks)
    held = set()
    for start in val.starts:
        assert start % BLOCK == 0  # whole, non-overlapping blocks
        held.update(range(start, start + BLOCK))
    for start in train.starts:
        assert not held & set(range(start, start + BLOCK))
        assert torch.equal(train[list(train.starts).index(start)],
                           torch.as_tensor(dataset.tokens[start:start + BLOCK].astype(np.int64)))
    trained_on = {t for s in train.starts for t in range(s, s + BLOCK)}
    assert set(range(n_blocks * BLOCK)) - held <= trained_on  # every other whole block is trained on
    again_train, again_val = holdout_split(dataset, 0.2)  # the same blocks every time
    assert np.array_equal(again_val.starts, val.starts) and np.array_equal(again_train.starts, train.starts)


def test_a_fraction_through_train_evaluates_the_held_out_blocks(tokenizer_file):
    write_texts(train_chars=3000)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train("train.txt", output_dir="out", val_data=0.25, num_steps=1, learning_rate=1e-3, batch_size=2,
             save_every=0, generate_every=0, seed=3, precision="32-true")
    dataset = TokenDataset("train.txt", tokenizer_file=tokenizer_file, block_size=BLOCK)
    _, val = holdout_split(dataset, 0.25)
    blocks = torch.stack([val[i] for i in range(len(val))])
    assert summary("out")["best_val_loss"] == pytest.approx(mean_token_cross_entropy(ai.model, blocks), abs=1e-5)


def test_resuming_after_an_interrupt_keeps_the_best_so_far(tokenizer_file):
    """Interrupted after the best evaluation and resumed: the same evaluations, best model and weights as a
    run that was never interrupted."""
    write_texts()

    def run(output_dir, num_steps, **kwargs):
        ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_embd=128))
        ai.model.load_state_dict(initial)  # the same initial weights in every run
        ai.train("train.txt", output_dir=output_dir, val_data="val.txt", num_steps=num_steps, eval_every=10,
                 learning_rate=3e-3, batch_size=4, save_every=30, generate_every=0, seed=1, **kwargs)
        return ai

    initial = GPT2LMHeadModel(tiny_gpt2_config(n_embd=128)).state_dict()
    whole = run("whole", 100)
    expected = summary("whole")
    stop_at = expected["best_step"] + 10  # the first evaluation after the best
    assert stop_at < 100

    run("parts", 100, callbacks=[CtrlC(at_step=stop_at - 1)])  # stops after stop_at, evaluates it, checkpoints
    first = summary("parts")
    assert first["steps"] == stop_at and first["best_step"] == expected["best_step"]
    assert torch.load("parts/last.ckpt", weights_only=True)["global_step"] == stop_at
    best_file = open("parts/model.safetensors", "rb").read()
    resumed = run("parts", 100, resume=True)
    final = summary("parts")
    assert final["validation"] == expected["validation"]  # no evaluation lost or repeated
    assert (final["best_step"], final["best_val_loss"]) == (expected["best_step"], expected["best_val_loss"])
    assert open("parts/model.safetensors", "rb").read() == best_file  # never replaced by a worse one
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_resuming_with_another_held_out_fraction_is_refused(tokenizer_file):
    write_texts(train_chars=3000)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train("train.txt", output_dir="out", val_data=0.2, num_steps=6, learning_rate=1e-3, save_every=0,
             generate_every=0, seed=1, callbacks=[CtrlC(at_step=2)])
    before = snapshot("out")
    with pytest.raises(ValueError, match=r"another validation .*same val_data"):
        ai.train("train.txt", output_dir="out", val_data=0.3, num_steps=6, learning_rate=1e-3, save_every=0,
                 generate_every=0, seed=1, resume=True)
    assert snapshot("out") == before


def test_evaluating_changes_nothing_in_training(tokenizer_file):
    """A run with val_data trains exactly as one without (dropout on, LoRA too): evaluation draws no random
    numbers and leaves every module's mode as it was; without val_data, no validation file or field."""
    import pytorch_lightning as pl

    class LastWeights(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            self.weights = {k: v.clone() for k, v in pl_module.model.state_dict().items()}

    write_texts()
    runs = {}
    for name, validation in (("plain", {}), ("validated", dict(val_data="val.txt", eval_every=3))):
        ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(dropout=0.1))
        torch.manual_seed(0)
        ai.model.load_state_dict(GPT2LMHeadModel(tiny_gpt2_config(dropout=0.1)).state_dict())
        runs[name] = LastWeights()
        ai.train("train.txt", output_dir=name, num_steps=12, lora=True, learning_rate=1e-2, batch_size=2,
                 save_every=4, generate_every=0, seed=1, callbacks=[runs[name]], **validation)
    for key, value in runs["plain"].weights.items():
        assert torch.equal(runs["validated"].weights[key], value), key
    plain = summary("plain")
    assert not {"validation", "best_step", "best_val_loss"} & set(plain)
    assert sorted(os.listdir("plain")) == sorted(os.listdir("validated"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(eval_every=5), r"eval_every=5 needs a validation set; pass val_data="),
    (dict(early_stopping_patience=2), r"early_stopping_patience=2 needs a validation set"),
    (dict(val_data=0.7), r"val_data=0.7 must be .* in \(0, 0.5\)"),
    (dict(val_data=0), r"val_data=0 must be"),
    (dict(val_data=[1, 2]), r"val_data=\[1, 2\] must be a text file, a TokenDataset, or a fraction"),
    (dict(val_data="val.txt", eval_every=0), r"eval_every=0 must be a positive integer"),
    (dict(val_data="val.txt", early_stopping_patience=0), r"early_stopping_patience=0 must be a positive"),
    (dict(val_data="missing.txt"), r"val_data.*missing.txt"),
])
def test_bad_validation_arguments_are_refused_before_any_work(tokenizer_file, kwargs, message):
    write_texts()
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ai.train("train.txt", output_dir="out", num_steps=2, **kwargs)
    assert not os.path.exists("out")


def test_the_cli_takes_the_validation_flags(tokenizer_file, tmp_path):
    write_texts()
    tiny_gpt2_config().save_pretrained(tmp_path / "config")
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    result = subprocess.run([exe, "train", "train.txt", f"--config={tmp_path / 'config' / 'config.json'}",
                             f"--tokenizer_file={tokenizer_file}", "--val-data=val.txt", "--eval-every=2",
                             "--early-stopping-patience=5", "--num_steps=4", "--save_every=0",
                             "--generate_every=0"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["step"] for e in summary("trained_model")["validation"]] == [2, 4]


def test_ddp_validation_loss_counts_every_block_once(tokenizer_file, tmp_path):
    """Two processes, an odd number of validation blocks: the loss is the mean over all of them."""
    write_texts(val_chars=900)
    blocks = val_blocks(tokenizer_file)
    assert len(blocks) % 2
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "ddp_validate.py"), "train.txt", "val.txt",
                             tokenizer_file, "ddp_out"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = GPT2LMHeadModel.from_pretrained("ddp_out")
    assert summary("ddp_out")["best_val_loss"] == pytest.approx(mean_token_cross_entropy(saved, blocks), abs=2e-4)


@pytest.mark.edges
def test_ddp_spawn_brings_the_run_back_to_the_process_that_waited(corpus_file, tokenizer_file, tmp_path):
    """strategy="ddp_spawn" trains in two new processes; the summary this process writes is the run's."""
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "ddp_spawn_train.py"), corpus_file,
                             tokenizer_file, "spawn_out"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    written = summary("spawn_out")
    assert written["steps"] == 4 and written["tokens"] == 4 * 2 * 2 * 32  # steps x batch x processes x block
    assert written["final_loss"] is not None and written["memory_breakdown_bytes"]["weights"] > 0
    assert [e["step"] for e in written["validation"]] == [2, 4] and written["best_step"] in (2, 4)
    with open("spawn_out/run_files.json", encoding="utf-8") as f:
        assert json.load(f)["run"] == written["run"]
    saved = GPT2LMHeadModel.from_pretrained("spawn_out")
    assert saved.config.n_layer == 2


@pytest.mark.edges
def test_val_loss_reaches_the_loggers_and_lightnings_own_callbacks(tokenizer_file):
    import csv

    from pytorch_lightning.callbacks import EarlyStopping

    write_texts()
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_embd=128))
    stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # nothing improves by 10: stops at once
    ai.train("train.txt", output_dir="out", val_data="val.txt", num_steps=40, eval_every=5, learning_rate=1e-3,
             batch_size=2, save_every=0, generate_every=0, seed=1, loggers="csv", callbacks=[stop])
    result = summary("out")
    assert result["steps"] == 10 and [e["step"] for e in result["validation"]] == [5, 10]
    with open(next(os.path.join(d, "metrics.csv") for d, _, files in os.walk("out/logs") if "metrics.csv" in files),
              encoding="utf-8") as f:
        logged = [(int(row["step"]), float(row["val_loss"])) for row in csv.DictReader(f) if row.get("val_loss")]
    assert [loss for _, loss in logged] == pytest.approx([e["loss"] for e in result["validation"]], abs=1e-6)


def test_val_data_as_a_tokendataset_is_evaluated_as_the_file_is(tokenizer_file):
    """A TokenDataset serves every window; as val_data it is evaluated in the same consecutive blocks as
    the file it came from."""
    write_texts()
    results = []
    for name, val_data in (("file", "val.txt"),
                           ("dataset", TokenDataset("val.txt", tokenizer_file=tokenizer_file, block_size=BLOCK))):
        ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
        torch.manual_seed(0)
        ai.model.load_state_dict(GPT2LMHeadModel(tiny_gpt2_config()).state_dict())
        ai.train("train.txt", output_dir=name, val_data=val_data, num_steps=5, eval_every=2, learning_rate=1e-3,
                 batch_size=2, save_every=0, generate_every=0, seed=1)
        results.append(summary(name)["validation"])
    assert results[0] == results[1]
    assert [e["step"] for e in results[0]] == [2, 4, 5]  # the last step is evaluated too


def test_sigterm_with_val_data_evaluates_checkpoints_and_resumes(small_data, base_folder, tokenizer_file):
    """SIGTERM stops after the step, evaluates it, checkpoints with that evaluation and exits 143; the
    resumed run continues the same evaluation history."""
    def start(resume):
        return subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "train_until_signalled.py"), small_data,
                                 tokenizer_file, base_folder, "stopped", "8", str(int(resume)), "0.2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    child = start(resume=False)
    for line in child.stdout:
        if line.strip().endswith("step 2"):  # after the progress bar's redraw on the same line
            break
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 143, err[-2000:]
    stopped_at = torch.load("stopped/last.ckpt", weights_only=True)["global_step"]
    first = summary("stopped")
    assert [e["step"] for e in first["validation"]] == list(range(1, stopped_at + 1))  # eval_every: 8 // 10 -> 1
    resumed = start(resume=True)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0 and "returned" in out, err[-2000:]
    final = summary("stopped")
    assert [e["step"] for e in final["validation"]] == list(range(1, 9))
    assert final["validation"][:stopped_at] == first["validation"]
    assert final["best_val_loss"] == min(e["loss"] for e in final["validation"])
    assert not os.path.exists("stopped/last.ckpt")
