"""outputs: after any two runs into one output_dir, every file there is the second run's (or the user's),
and the folder loads as the second run's model; an adapter whose base weights changed is refused."""

import json
import os
import shutil

import pytest
import torch

from conftest import CtrlC
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training.outputs import MANIFEST, RunManifest, read_manifest

KINDS = ("full", "lora", "val_data", "interrupted", "resumed")
USER_FILE = "my_notes.txt"


def train(kind: str, base: str, data: str, tokenizer_file: str, out: str) -> aitextgen:
    """One run of `kind` into `out` ("resumed": interrupted at step 2, then resumed to the end)."""
    def call(**kwargs):
        ai = aitextgen(model_folder=base, tokenizer_file=tokenizer_file)
        ai.train(data, output_dir=out, num_steps=4, save_every=2, generate_every=0, batch_size=2, seed=1,
                 learning_rate=1e-2, precision="32-true", loggers="csv", **kwargs)
        return ai

    if kind == "lora":
        return call(lora=True)
    if kind == "val_data":
        return call(val_data=0.25, eval_every=2)
    if kind == "full":
        return call()
    interrupted = call(callbacks=[CtrlC(at_step=1)])
    return call(resume=True) if kind == "resumed" else interrupted


def on_disk(folder: str) -> set[str]:
    """Every file under `folder`, relative to it."""
    return {os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names}


def owned(path: str, files: list[str]) -> bool:
    return any(path == name or path.startswith(name + os.sep) for name in files)


@pytest.mark.parametrize("first", KINDS)
@pytest.mark.parametrize("second", KINDS)
def test_two_runs_into_one_folder_leave_only_the_second_runs_files(first, second, small_data, base_folder,
                                                                  tokenizer_file, tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    with open(os.path.join(out, USER_FILE), "w") as f:
        f.write("mine")
    train(first, base_folder, small_data, tokenizer_file, out)
    earlier = read_manifest(out)["run"]
    ai = train(second, base_folder, small_data, tokenizer_file, out)

    manifest = read_manifest(out)
    with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["run"] == manifest["run"] != earlier
    assert "removing" not in manifest
    for path in on_disk(out) - {MANIFEST, USER_FILE}:
        assert owned(path, manifest["files"]), path  # nothing of the first run is left
    assert open(os.path.join(out, USER_FILE)).read() == "mine"  # nor anything of the user's touched
    assert len(os.listdir(os.path.join(out, "logs"))) == (2 if second == "resumed" else 1)  # one run's versions
    assert os.path.exists(os.path.join(out, "last.ckpt")) == (second == "interrupted")
    assert os.path.isdir(os.path.join(out, "lora_adapter")) == (second == "lora")

    saved = aitextgen(model_folder=out, tokenizer_file=tokenizer_file).model.state_dict()
    for key, value in ai.model.state_dict().items():  # the folder holds the second run's model
        assert torch.equal(saved[key].to(value.dtype), value), key
    if second == "lora":
        adapter = aitextgen(model_folder=os.path.join(out, "lora_adapter")).model.merge_and_unload().state_dict()
        for key, value in ai.model.state_dict().items():
            torch.testing.assert_close(adapter[key].to(value.dtype), value)


def test_an_adapter_is_refused_once_its_base_holds_other_weights(small_data, base_folder, tokenizer_file, tmp_path):
    """The adapter copied elsewhere still names its base folder; once that folder is trained into again, the
    adapter on it would be a model nobody trained."""
    def train_into(out, **kwargs):
        ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
        ai.train(small_data, output_dir=out, num_steps=2, save_every=0, generate_every=0, batch_size=2,
                 learning_rate=1e-2, precision="32-true", **kwargs)

    train_into("lora_run", lora=True)
    shutil.copytree("lora_run/lora_adapter", "copied_adapter")
    aitextgen(model_folder="copied_adapter")  # the base is as it was: loads
    adapter_run = read_manifest("lora_run")["run"]

    train_into(base_folder)  # the base folder now holds another run's model
    with pytest.raises(ValueError, match=rf"run {adapter_run}.*now holds the model of run "
                                         rf"{read_manifest(base_folder)['run']}.*base_model_name_or_path"):
        aitextgen(model_folder="copied_adapter")


def test_a_lora_run_saved_where_its_base_was_leaves_an_adapter_that_is_refused(small_data, base_folder,
                                                                               tokenizer_file):
    """aitextgen(model_folder=X).train(lora=True, output_dir=X): X then holds the merge, no longer the base."""
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir=base_folder, lora=True, num_steps=2, save_every=0, generate_every=0,
             learning_rate=1e-2, precision="32-true")
    with pytest.raises(ValueError, match="that run's own result"):
        aitextgen(model_folder=os.path.join(base_folder, "lora_adapter"))


def test_save_into_a_runs_folder_belongs_to_that_run_only_for_its_own_model(small_data, base_folder,
                                                                           tokenizer_file):
    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir="out", lora=True, num_steps=2, save_every=0, generate_every=0)
    run = read_manifest("out")["run"]
    ai.save_for_upload("out")  # the run's own model: its summary and adapter stay
    assert read_manifest("out")["run"] == run and os.path.isdir("out/lora_adapter")
    assert os.path.isfile("out/training_summary.json")

    aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).save_for_upload("out")  # another model
    assert read_manifest("out")["run"] != run
    assert not os.path.exists("out/lora_adapter") and not os.path.exists("out/training_summary.json")


def test_a_crash_between_claiming_and_removing_is_finished_by_the_next_run(tmp_path):
    out = str(tmp_path)
    for name in ("a.txt", "b.txt", "mine.txt"):
        (tmp_path / name).write_text(name)
    first = RunManifest.start(out, "first")
    first.model_saved(["a.txt", "b.txt"])
    # the second run listed b.txt as "removing" and then died before removing it
    (tmp_path / MANIFEST).write_text(json.dumps({"run": "second", "files": ["a.txt"], "removing": ["b.txt"]}))
    third = RunManifest.start(out, "third")
    third.model_saved(["a.txt"])
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "a.txt", "mine.txt"])


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/passwd", MANIFEST, ".lowmem_aitextgen.lock", "", ".",
                                  "sub/../..", "linked/outside.txt"])
def test_a_manifest_never_removes_anything_outside_its_folder(name, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("the user's")
    (tmp_path / "outside.txt").write_text("keep")
    os.symlink(tmp_path, out / "linked")  # a folder inside output_dir that leads out of it
    (out / MANIFEST).write_text(json.dumps({"run": "earlier", "files": [name]}))
    RunManifest.start(str(out), "now").model_saved([])
    assert (tmp_path / "outside.txt").read_text() == "keep" and (out / "kept.txt").exists()
    assert os.path.exists("/etc/passwd")


def test_a_manifest_that_is_not_ours_keeps_every_file(tmp_path):
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / MANIFEST).write_text("[1, 2]")
    RunManifest.start(str(tmp_path), "now").model_saved(["config.json"])
    assert (tmp_path / "model.safetensors").exists()
