"""What training shows the user: summary JSON, loss/memory plots, Lightning loggers."""

import csv
import glob
import json
import os
import struct
import sys
import zlib

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training.report import PNG_DATA_KEY

pytestmark = pytest.mark.edges  # Lightning's loggers and callbacks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text(path: str) -> dict[str, str]:
    """The text chunks of a PNG file (tEXt and zTXt), read with nothing but the PNG spec."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE
    texts, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"tEXt":
            key, value = body.split(b"\0", 1)
            texts[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, rest = body.split(b"\0", 1)
            texts[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        pos += 12 + length
    return texts


def read_metrics(output_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(output_dir, "logs", "version_*", "metrics.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(tokenizer_file, corpus_file, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("run") / "trained_model")
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, output_dir=output_dir, num_steps=8, batch_size=2, gradient_accumulation_steps=2,
             pin_micro_batch=True,
             warmup_steps=3, save_every=0, generate_every=0, precision="32-true", loggers="csv")
    with open(os.path.join(output_dir, "training_summary.json")) as f:
        return ai, output_dir, json.load(f)


def test_summary_reports_the_run(trained):
    ai, output_dir, summary = trained
    assert summary["steps"] == 8
    block = ai.model.config.n_positions
    assert summary["tokens"] == 8 * 2 * 2 * block  # steps x micro-batch x accumulation x block
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["wall_time_s"], rel=1e-3)
    assert summary["best_avg_loss"] <= summary["final_avg_loss"]
    assert summary["peak_memory_bytes"] > 0 and summary["peak_memory_kind"] == "CPU peak RSS"
    assert summary["plan"]["lora"] is None and summary["plan"]["gradient_checkpointing"] is False
    assert summary["plan"]["precision"] == "32-true"
    assert (summary["plan"]["micro_batch_size"], summary["plan"]["gradient_accumulation_steps"],
            summary["plan"]["effective_batch_size"]) == (2, 2, 4)
    assert summary["plan"]["optimizer"] == "AdamW"
    assert summary["output_dir"] == os.path.abspath(output_dir)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in ai.model.parameters()}.values())
    assert summary["memory_breakdown_bytes"]["weights"] == weights
    assert summary["memory_breakdown_bytes"]["optimizer_states"] >= 2 * weights  # AdamW's two moments


def test_csv_logger_gets_every_optimizer_step(trained):
    _, output_dir, summary = trained
    rows = read_metrics(output_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    losses = [float(r["loss"]) for r in rows]
    assert losses[-1] == pytest.approx(summary["final_loss"])
    rates = [float(r["learning_rate"]) for r in rows]
    assert rates[:4] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3])  # linear warm-up over 3 steps
    assert rates[4:] == sorted(rates[4:], reverse=True)  # then linear decay
    assert all(float(r["tokens_per_s"]) > 0 and int(float(r["peak_memory_bytes"])) > 0 for r in rows)


def test_loss_plot_holds_the_per_step_loss_and_its_average(trained):
    _, output_dir, summary = trained
    plotted = json.loads(png_text(os.path.join(output_dir, "loss.png"))[PNG_DATA_KEY])
    logged = read_metrics(output_dir)
    assert plotted["step"] == list(range(1, 9))
    assert plotted["loss"] == pytest.approx([float(r["loss"]) for r in logged])
    assert plotted["avg_loss"] == pytest.approx([float(r["avg_loss"]) for r in logged])
    assert plotted["avg_loss"][-1] == pytest.approx(summary["final_avg_loss"])


def test_memory_plot_holds_the_breakdown_and_the_peak(trained):
    _, output_dir, summary = trained
    plotted = json.loads(png_text(os.path.join(output_dir, "memory.png"))[PNG_DATA_KEY])
    breakdown = summary["memory_breakdown_bytes"]
    assert plotted["bytes"] == list(breakdown.values())
    assert plotted["labels"][0] == "weights"
    assert plotted["peak_bytes"] == summary["peak_memory_bytes"] >= sum(breakdown.values())


class Crash(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            raise RuntimeError("simulated crash")


def test_an_interrupted_run_keeps_the_summary_and_plots_of_its_last_save(tokenizer_file, corpus_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises(RuntimeError, match="simulated crash"):
        ai.train(corpus_file, output_dir="out", num_steps=10, save_every=2, generate_every=0,
                 precision="32-true", callbacks=[Crash()])
    with open("out/training_summary.json") as f:
        assert json.load(f)["steps"] == 4
    assert json.loads(png_text("out/loss.png")[PNG_DATA_KEY])["step"] == [1, 2, 3, 4]
    assert aitextgen(model_folder="out").model is not None


def test_loggers_accept_tensorboard_and_logger_objects(tokenizer_file, corpus_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    own = CSVLogger(str(tmp_path / "mine"))
    ai.train(corpus_file, output_dir="out", num_steps=3, save_every=0, generate_every=0,
             loggers=["tensorboard", own])
    assert glob.glob("out/logs/version_0/events.out.tfevents.*")
    with open(os.path.join(own.log_dir, "metrics.csv")) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3]


def test_unknown_logger_is_refused_before_anything_is_written(tokenizer_file, corpus_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises(ValueError, match="loggers='wandb' holds 'wandb', which is not a Lightning logger; use 'csv' or 'tensorboard'"):
        ai.train(corpus_file, output_dir="out", num_steps=1, loggers="wandb")
    assert not os.path.exists("out")


def test_without_tensorboard_its_logger_is_refused_naming_the_install_line_before_any_work(
        tokenizer_file, corpus_file, monkeypatch, capsys):
    """train() and the CLI (one line, status 2), nothing written; Lightning's own ModuleNotFoundError came later
    and, in the CLI, as a traceback."""
    from lowmem_aitextgen import cli

    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises(ValueError, match="loggers=.tensorboard. needs TensorBoard: pip install tensorboard"):
        ai.train(corpus_file, output_dir="out", num_steps=1, loggers="tensorboard")
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", corpus_file, "--output_dir=out", "--num_steps=1", "--loggers=tensorboard"])
    assert exited.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err
    assert not os.path.exists("out")


def test_without_matplotlib_training_says_the_plots_are_not_drawn_and_saves_the_rest(tokenizer_file, corpus_file,
                                                                                       monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, output_dir="out", num_steps=2, save_every=0, generate_every=0)
    assert "matplotlib is not installed (pip install matplotlib)" in caplog.text
    assert os.path.exists("out/training_summary.json") and not os.path.exists("out/loss.png")
