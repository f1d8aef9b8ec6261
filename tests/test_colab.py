"""colab: aitextgen's Drive helpers, and aitextgen's official fine-tuning notebook run end to end offline
(a hub cache built here stands in for GPT-2, a temporary folder for the mounted Drive)."""

import os

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import corpus_text, fake_hub_cache, tiny_gpt2_config
from lowmem_aitextgen import colab

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("aitextgen's Colab helpers; the patches beneath them are test_compat's, which runs at the oldest "
                    "versions")


@pytest.fixture
def drive(tmp_path, monkeypatch):
    """A mounted Drive, as /content/drive/MyDrive is in Colab."""
    root = tmp_path / "drive" / "MyDrive"
    root.mkdir(parents=True)
    monkeypatch.setattr(colab, "DRIVE_ROOT", str(root))
    return root


@pytest.fixture
def hub_gpt2(tmp_path):
    """GPT-2's hub entry, offline: a small model with GPT-2's vocabulary in a cache laid out as the hub's."""
    config = tiny_gpt2_config(vocab_size=50257, n_positions=64, bos_token_id=50256, eos_token_id=50256)
    fake_hub_cache(str(tmp_path / "cache"), "gpt2", GPT2LMHeadModel(config))
    return str(tmp_path / "cache")


def test_the_official_finetuning_notebook_runs_with_only_the_imports_changed(drive, hub_gpt2, caplog):
    """The cells of aitextgen's Colab notebook, in order (its own code, only the import lines changed)."""
    (drive / "input.txt").write_text(corpus_text(20_000), encoding="utf-8")

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.colab import copy_file_from_gdrive, copy_file_to_gdrive

    ai = aitextgen(tf_gpt2="124M", to_gpu=True, cache_dir=hub_gpt2)  # no GPU here: it stays on the CPU, said so
    file_name = "input.txt"
    copy_file_from_gdrive(file_name)
    ai.train(file_name, line_by_line=False, from_cache=False, num_steps=6, generate_every=3, save_every=3,
             save_gdrive=False, learning_rate=1e-3, fp16=False, batch_size=1)
    texts = ai.generate(n=5, batch_size=5, prompt="The", max_length=256, temperature=1.0, top_p=0.9,
                        return_as_list=True)
    assert len(texts) == 5 and all(t.startswith("The") for t in texts)
    assert any("max_length=256 is above the model's context of 64" in r.message for r in caplog.records)
    path = ai.generate_to_file(n=10, batch_size=5, prompt="The", max_length=256, temperature=1.0, top_p=0.9)
    assert open(path, encoding="utf-8").read().count("=" * 20) == 10

    # the docs' way to keep a model: save it, copy aitextgen's two file names to Drive
    ai.save()
    for file in ["pytorch_model.bin", "config.json"]:
        copy_file_to_gdrive(file)
    assert sorted(os.listdir(drive)) == ["config.json", "input.txt", "model.safetensors"]

    # a later session: the notebook's loading cell
    os.remove("model.safetensors")
    os.remove("config.json")
    from_folder = None
    for file in ["pytorch_model.bin", "config.json"]:
        if from_folder:
            copy_file_from_gdrive(file, from_folder)
        else:
            copy_file_from_gdrive(file)
    reloaded = aitextgen(model_folder=".", to_gpu=True)
    assert torch.equal(reloaded.model.lm_head.weight, ai.model.lm_head.weight)
    assert reloaded.generate_one(max_length=20, seed=1)


def test_a_drive_copy_of_an_aitextgen_model_still_loads(drive, tmp_path):
    """An aitextgen-0.6 model kept on Drive as pytorch_model.bin + config.json."""
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    torch.save(model.state_dict(), drive / "pytorch_model.bin")
    model.config.save_pretrained(drive)
    for file in ["pytorch_model.bin", "config.json"]:
        colab.copy_file_from_gdrive(file)
    from lowmem_aitextgen import aitextgen

    assert torch.equal(aitextgen(model_folder=".").model.lm_head.weight, model.lm_head.weight)


def test_a_missing_file_names_both_of_its_names(drive):
    with pytest.raises(FileNotFoundError, match="Neither .*pytorch_model.bin nor .*model.safetensors exists"):
        colab.copy_file_from_gdrive("pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="notes.txt does not exist"):
        colab.copy_file_to_gdrive("notes.txt")


def test_copies_keep_relative_folders_and_folders_on_drive(drive):
    os.makedirs("trained_model")
    with open("trained_model/model.safetensors", "wb") as f:
        f.write(b"weights")
    colab.create_gdrive_folder("run1")
    (drive / "run1" / "trained_model").mkdir()
    colab.copy_file_to_gdrive("trained_model/pytorch_model.bin", to_folder="run1")
    assert (drive / "run1" / "trained_model" / "model.safetensors").read_bytes() == b"weights"


def test_without_a_mounted_drive_or_colab_the_helpers_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(colab, "DRIVE_ROOT", str(tmp_path / "not_mounted"))
    with pytest.raises(RuntimeError, match="not mounted.*mount_gdrive"):
        colab.copy_file_to_gdrive("x.txt")
    with pytest.raises(RuntimeError, match="only in Google Colab"):
        colab.mount_gdrive()
