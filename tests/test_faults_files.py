"""Nothing a user has is destroyed: finished models, curated files and earlier checkpoints survive every
bad input and fault, and every error names the file or argument (issue: nothing lost, nothing hangs).

Each case snapshots the files it could harm and compares them byte for byte afterwards."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import pytorch_lightning as pl
import torch
from transformers import GPT2LMHeadModel

from conftest import BadWeightsAt, corpus_text, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("our own writers and readers under file faults")

pytestmark = pytest.mark.timeout(300)


def hidden_leftovers(folder) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith((".saving-", ".writing-"))]


# --- resume=True never replaces a finished model ------------------------------------------


def test_resume_true_over_a_finished_model_refuses_and_says_how_to_continue(finished, corpus_file):
    before = snapshot(finished)
    with pytest.raises(FileExistsError, match=r"resume=True.*holds a finished model.*model_folder=.*resume=False"):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, num_steps=2, resume=True)
    assert snapshot(finished) == before


def test_resume_true_without_anything_to_resume_starts_over_and_says_so(corpus_file, tokenizer_file, tmp_path, caplog):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with caplog.at_level("WARNING", logger="lowmem_aitextgen"):
        ai.train(corpus_file, output_dir=str(tmp_path / "new"), num_steps=1, resume=True, generate_every=0)
    assert any("no last.ckpt" in r.message and r.levelname == "WARNING" for r in caplog.records)


# --- non-finite weights are never written ---------------------------------------------------


def nan_weights(ai):
    with torch.no_grad():
        ai.model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    return ai


@pytest.mark.parametrize("method", ["save", "save_for_upload"])
def test_saving_nan_weights_over_a_model_is_refused(finished, method):
    before = snapshot(finished)
    ai = nan_weights(aitextgen(model_folder=finished))
    with pytest.raises(ValueError, match=r"not finite \(NaN/inf in transformer.h.0.mlp.c_fc.weight\)"):
        getattr(ai, method)(finished)
    assert snapshot(finished) == before


def test_weights_that_go_nan_in_training_are_not_saved_and_the_message_says_what_was_kept(finished, corpus_file):
    from lowmem_aitextgen.training.callbacks import TrainingDiverged

    before = snapshot(finished)
    with pytest.raises(TrainingDiverged, match="not finite.*not saved; this run saved no model"):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, num_steps=4, save_every=3,
                                               generate_every=0, callbacks=[BadWeightsAt(step=1)])
    assert snapshot(finished) == before  # neither the model nor a checkpoint of NaN weights


def test_weights_that_go_nan_after_a_save_keep_that_save(finished, corpus_file):
    from lowmem_aitextgen.training.callbacks import TrainingDiverged

    with pytest.raises(TrainingDiverged, match="keeps the model saved at step 2"):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, num_steps=4, save_every=2,
                                               generate_every=0, callbacks=[BadWeightsAt(step=3)])
    ai = aitextgen(model_folder=finished)
    assert all(torch.isfinite(p).all() for p in ai.model.parameters())
    assert json.loads(open(os.path.join(finished, "training_summary.json")).read())["steps"] == 2


# --- bad data is an error before anything is written ------------------------------------------


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return str(path)


@pytest.mark.parametrize("name, content, kwargs, says", [
    ("blank.txt", " \n\t\n  \n", {}, "holds only whitespace"),
    ("quotes.csv", 'text\n"fine row"\n"unterminated, then\nmore rows\nuntil the end\n', {"line_by_line": True},
     "not valid CSV from line 3 on"),
    ("nul.txt", b"text\x00more", {}, "looks binary"),
], ids=["whitespace only", "csv with an unterminated quote", "NUL bytes"])
def test_bad_training_files_are_named_before_any_write(finished, tmp_path, name, content, kwargs, says):
    path = write(tmp_path, name, content)
    before = snapshot(finished)
    with pytest.raises(ValueError, match=says) as caught:
        aitextgen(model_folder=finished).train(path, output_dir=finished, num_steps=2, **kwargs)
    assert name in str(caught.value)
    assert snapshot(finished) == before


def test_a_dataset_from_another_tokenizer_is_an_error_naming_it(finished, tmp_path):
    data = TokenDataset(texts=[corpus_text(5_000)], block_size=32)  # GPT-2's tokenizer: ids up to 50,256
    before = snapshot(finished)
    with pytest.raises(ValueError, match=r"train_data \(a TokenDataset\) was encoded by another tokenizer \("
                                         r"'GPT2Tokenizer', 50,257 tokens\) than the one given \(.*1,000 tokens\)"):
        aitextgen(model_folder=finished).train(data, output_dir=finished, num_steps=2)
    data.tokenizer_record = None  # aitextgen's TokenDataset records none: its ids are checked
    with pytest.raises(ValueError, match=r"token id [\d,]+, but the model's vocabulary has 1,000 tokens.*another "
                                         "tokenizer"):
        aitextgen(model_folder=finished).train(data, output_dir=finished, num_steps=2)
    assert snapshot(finished) == before


def test_a_dataset_with_blocks_longer_than_the_context_is_an_error(finished, tokenizer_file):
    data = TokenDataset(texts=[corpus_text(5_000)], tokenizer_file=tokenizer_file, block_size=64)
    with pytest.raises(ValueError, match="block_size=64 is above the model's context of 32"):
        aitextgen(model_folder=finished).train(data, output_dir=finished, num_steps=2)


def test_an_encoded_cache_trains_from_its_path(finished, corpus_file, tokenizer_file, tmp_path):
    """aitextgen's train('dataset_cache.tar.gz', from_cache=True): the gzip is not 'binary text'."""
    TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=32, save_cache=True,
                 cache_destination=str(tmp_path / "cache.tar.gz"))
    ai = aitextgen(model_folder=finished)
    ai.train(str(tmp_path / "cache.tar.gz"), from_cache=True, output_dir=str(tmp_path / "out"), num_steps=2,
             generate_every=0)
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def test_a_tokenizer_larger_than_the_model_is_an_error_when_loading(tmp_path):
    """A folder without its tokenizer used to fall back to GPT-2's (50,257 tokens) silently."""
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=1000)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="50,257 tokens but the model's embeddings only 1,000.*model_folder=.*no "
                                         "tokenizer files.*tokenizer_file="):
        aitextgen(model_folder=str(tmp_path / "m"))


# --- output_dir values that cannot work fail before training ------------------------------------


def looping_link(tmp_path):
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    return str(tmp_path / "loop")


@pytest.mark.parametrize("make, error, says", [
    (looping_link, ValueError, "broken or looping symbolic link"),
    (lambda tmp: os.path.join(str(tmp), "x" * 300), OSError, "cannot hold the trained model"),
    (lambda tmp: os.path.join(str(tmp), "caf\udce9"), ValueError, "not valid UTF-8"),
    (lambda tmp: write(tmp, "plain_file", "x") + "/inside", ValueError, "is a file, not a folder"),
], ids=["symlink loop", "name too long", "undecodable name", "below a file"])
def test_output_dirs_that_cannot_work_fail_before_training(corpus_file, tokenizer_file, tmp_path, make, error, says):
    output_dir = make(tmp_path)
    started = []

    class Started(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(True)

    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises(error, match=says) as caught:
        ai.train(corpus_file, output_dir=output_dir, num_steps=1, callbacks=[Started()])
    assert "output_dir=" in str(caught.value) and not started


# --- inherited methods that write or loop ----------------------------------------------------------


def test_generate_to_file_keeps_the_old_file_when_generation_fails_halfway(finished, tmp_path):
    existing = tmp_path / "samples.txt"
    existing.write_text("curated texts\n", encoding="utf-8")
    ai = aitextgen(model_folder=finished)
    calls = []

    def fail_on_the_second_batch(module, args):
        calls.append(1)
        if len(calls) > 20:  # well into the second text
            raise RuntimeError("injected failure")

    ai.model.register_forward_pre_hook(fail_on_the_second_batch)
    with pytest.raises(RuntimeError, match="injected failure"):
        ai.generate_to_file(n=4, batch_size=1, destination_path=str(existing), max_length=16, seed=1)
    assert existing.read_text(encoding="utf-8") == "curated texts\n"
    assert hidden_leftovers(tmp_path) == []


def test_generate_to_file_refuses_what_aitextgen_asserted_before_touching_the_file(finished, tmp_path):
    existing = tmp_path / "samples.txt"
    existing.write_text("curated texts\n", encoding="utf-8")
    ai = aitextgen(model_folder=finished)
    with pytest.raises(ValueError, match="n=3 must be a multiple of batch_size=2"):
        ai.generate_to_file(n=3, batch_size=2, destination_path=str(existing))
    with pytest.raises(FileNotFoundError, match="destination_path=.*does not exist"):
        ai.generate_to_file(n=1, destination_path=str(tmp_path / "missing" / "x.txt"))
    with pytest.raises(ValueError, match="prompt is .* tokens.*context is 32"):
        ai.generate_to_file(n=1, destination_path=str(existing), prompt="word " * 100)
    assert existing.read_text(encoding="utf-8") == "curated texts\n"


def whitespace_only_model():
    """A GPT-2 whose every next token is ' ' (GPT-2 token 220): its texts are empty once stripped."""
    ai = aitextgen(config=tiny_gpt2_config(vocab_size=50257, n_positions=64, bos_token_id=50256,
                                           eos_token_id=50256))
    ai.model.lm_head.register_forward_hook(lambda module, args, logits: logits.index_fill(-1, torch.tensor([220]), 1e4))
    return ai


@pytest.mark.parametrize("do_sample, tries", [(False, "1 try, without sampling"), (True, "10 tries")])
def test_generate_whose_texts_are_all_whitespace_stops_with_an_error(do_sample, tries):
    """aitextgen's retry loop never ended here."""
    with pytest.raises(RuntimeError, match=f"only empty texts \\({tries}\\).*nonempty_output=False"):
        whitespace_only_model().generate(n=2 if do_sample else 1, do_sample=do_sample, max_length=8)
    assert whitespace_only_model().generate(n=1, do_sample=False, max_length=8, nonempty_output=False,
                                            return_as_list=True) == [""]


def test_save_into_an_unwritable_place_names_it(finished):
    with pytest.raises(ValueError, match="target_folder='' is empty"):
        aitextgen(model_folder=finished).save("")


# --- library errors name the file -------------------------------------------------------------------


def broken_copy(finished, tmp_path, name, content):
    folder = tmp_path / "broken"
    shutil.copytree(finished, folder)
    (folder / name).write_bytes(content(folder / name))
    return str(folder)


@pytest.mark.parametrize("name, content, says", [
    ("model.safetensors", lambda path: path.read_bytes()[: path.stat().st_size // 2], "model.safetensors cannot be loaded"),
    ("config.json", lambda path: b"{ not json", "config.json is not readable JSON"),
    ("tokenizer.json", lambda path: b"[1, 2", "its tokenizer files cannot be loaded"),
], ids=["truncated safetensors", "invalid config.json", "invalid tokenizer.json"])
def test_damaged_files_in_a_model_folder_are_named(finished, tmp_path, name, content, says):
    folder = broken_copy(finished, tmp_path, name, content)
    with pytest.raises(ValueError, match=says) as caught:
        aitextgen(model_folder=folder)
    assert "model_folder=" in str(caught.value) or folder in str(caught.value)


def test_an_invalid_tokenizer_file_is_named(tmp_path):
    path = write(tmp_path, "tok.json", "{ broken")
    with pytest.raises(ValueError, match="tokenizer_file=.*tok.json.* is not a tokenizers JSON file"):
        aitextgen(tokenizer_file=path, config=tiny_gpt2_config())


def test_swapped_vocab_and_merges_files_are_named(tmp_path):
    from lowmem_aitextgen._compat import default_gpt2_vocab_files

    vocab, merges = default_gpt2_vocab_files()
    with pytest.raises(ValueError, match="vocab_file=.*merges.txt.* is not a vocabulary JSON file.*merges file"):
        aitextgen(vocab_file=merges, merges_file=vocab, config=tiny_gpt2_config(vocab_size=50257))
    bad_merges = write(tmp_path, "merges.txt", "#version: 0.2\nĠ t\nnot a merge line at all\n")
    with pytest.raises(ValueError, match="merges_file=.*merges.txt.* line 2 is not a merge"):
        aitextgen(vocab_file=vocab, merges_file=bad_merges, config=tiny_gpt2_config(vocab_size=50257))


def test_an_adapter_whose_base_folder_moved_names_the_missing_folder(corpus_file, tokenizer_file, tmp_path):
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "base")
    ai = aitextgen(model_folder=str(tmp_path / "base"), tokenizer_file=tokenizer_file)
    ai.train(corpus_file, output_dir=str(tmp_path / "lora"), num_steps=1, lora=True, generate_every=0)
    shutil.move(tmp_path / "base", tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=f"trained on the model in {tmp_path / 'base'}, which no longer "
                                                "exists.*base_model_name_or_path"):
        aitextgen(model_folder=str(tmp_path / "lora" / "lora_adapter"))


def test_unreadable_checkpoints_are_named_before_training(finished, corpus_file, tmp_path):
    for content in (b"", b"not a checkpoint at all", b"PK\x03\x04 truncated zip"):
        path = write(tmp_path, "last.ckpt", content)
        before = snapshot(finished)
        with pytest.raises(ValueError, match="resume=.*last.ckpt.* cannot be read as a checkpoint.*resume=False"):
            aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, num_steps=2, resume=path)
        assert snapshot(finished) == before


# --- a full disk -----------------------------------------------------------------------------------

FILE_SIZE_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    from lowmem_aitextgen import aitextgen
    data, base, tokenizer, output_dir, limit = sys.argv[1:6]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    try:
        ai.train(data, output_dir=output_dir, num_steps=4, save_every=2, generate_every=0)
    except OSError as error:
        print("ERROR", error)
""")


def test_a_checkpoint_write_past_the_file_size_limit_fails_cleanly_and_the_retry_works(
        finished, corpus_file, tokenizer_file, tmp_path):
    """RLIMIT_FSIZE lets the model (0.7 MB) through and stops the checkpoint (2 MB): no partial file is
    left to block the next run, and the finished model is untouched."""
    before = snapshot(finished)
    result = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, corpus_file, finished, tokenizer_file, finished,
                             str(1_200_000)], capture_output=True, text=True, timeout=240)
    assert "ERROR" in result.stdout and "checkpoint" in result.stdout and "last.ckpt" in result.stdout, result
    assert "untouched" in result.stdout
    assert snapshot(finished) == before and hidden_leftovers(finished) == []
    aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, num_steps=4, save_every=2,
                                           generate_every=0)
    assert hidden_leftovers(finished) == [] and not os.path.exists(os.path.join(finished, "last.ckpt"))


WRITES_PAST_THE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    from lowmem_aitextgen import aitextgen
    data, base, tokenizer, folder, limit = sys.argv[1:6]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    said = {}
    kinds = {"full": {}, "lora": {"lora": True}, "lora on a 4-bit base": {"lora": True, "base_bits": 4}}
    for name, kwargs in kinds.items():
        ai = aitextgen(model_folder=base, tokenizer_file=tokenizer)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
        try:
            ai.train(data, output_dir=f"{folder}/{name}", num_steps=2, save_every=0, generate_every=0, **kwargs)
        except Exception as error:
            said[name] = [type(error).__name__, str(error)]
        try:
            ai.save(f"{folder}/{name} saved")
        except Exception as error:
            said[name + ", ai.save()"] = [type(error).__name__, str(error)]
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        said[name + ", generates"] = ai.generate_one(max_length=4, seed=1) is not None
    print(json.dumps(said))
""")


def test_a_model_write_past_the_file_size_limit_names_the_folder_and_what_is_kept(finished, corpus_file,
                                                                                  tokenizer_file, tmp_path):
    """A limit on file size (or a full disk) hit by safetensors' own writer, for a full, a LoRA and a 4-bit LoRA
    run's final save and for ai.save(): one OSError naming the folder, saying the files there are untouched and
    the trained model is still in the object, which still generates (safetensors' error named no path)."""
    result = subprocess.run([sys.executable, "-c", WRITES_PAST_THE_LIMIT, corpus_file, finished, tokenizer_file,
                             str(tmp_path), str(300_000)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("full", "lora", "lora on a 4-bit base"):
        kind, message = said[name]
        assert kind in ("OSError", "PermissionError") and str(tmp_path / name) in message, said
        assert "untouched" in message and "still in this aitextgen object" in message, said
        kind, message = said[name + ", ai.save()"]
        assert kind == "OSError" and str(tmp_path / f"{name} saved") in message and "untouched" in message, said
        assert said[name + ", generates"]


LIBRARY_WRITES_PAST_THE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from lowmem_aitextgen.saving import atomic_save
    folder, tokenizer_file = sys.argv[1:3]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    tokenizer, model = Tokenizer.from_file(tokenizer_file), torch.nn.Linear(4, 4)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    writers = {  # each library's own writer, as a save calls it (peft's adapter, the tokenizer, a state dict)
        "safetensors": lambda staging: save_file({"w": torch.zeros(10000)}, f"{staging}/adapter_model.safetensors"),
        "tokenizers": lambda staging: tokenizer.save(f"{staging}/tokenizer.json"),
        "torch": lambda staging: torch.save({"w": torch.zeros(10000)}, f"{staging}/training_args.bin")}
    said = {}
    for name, write in writers.items():
        try:
            atomic_save(f"{folder}/{name}", model, write=write)
        except Exception as error:
            said[name] = [type(error).__name__, str(error)]
    print(json.dumps(said))
""")


def test_a_failed_write_in_any_library_names_the_folder(tmp_path, tokenizer_file):
    """safetensors, tokenizers and torch report a full disk or a file-size limit with exceptions of their own
    that name no path: a save turns each into one OSError naming the folder and saying its files are
    untouched."""
    result = subprocess.run([sys.executable, "-c", LIBRARY_WRITES_PAST_THE_LIMIT, str(tmp_path), tokenizer_file],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said.keys() == {"safetensors", "tokenizers", "torch"}, said
    for name, (kind, message) in said.items():
        assert kind == "OSError" and f"Saving the model to {tmp_path / name} failed" in message, said
        assert "untouched" in message and hidden_leftovers(str(tmp_path / name)) == [], said


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs (needs the right to mount, which CI's root has; skipped otherwise)."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the RLIMIT_FSIZE test covers it")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_disk_that_fills_during_training_keeps_the_saved_model(corpus_file, tokenizer_file, small_disk):
    """The model is saved at step 1; then another program fills the disk and the checkpoint of step 2
    cannot be written: the error names it, nothing partial is left, the step-1 model still loads."""
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    output_dir = str(small_disk / "out")

    class FillTheDisk(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and not os.path.exists(small_disk / "filler"):
                with open(small_disk / "filler", "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                    except OSError:
                        pass

    with pytest.raises(OSError, match="last.ckpt could not be written.*untouched"):
        ai.train(corpus_file, output_dir=output_dir, num_steps=4, save_every=1, generate_every=0,
                 callbacks=[FillTheDisk()])
    assert hidden_leftovers(output_dir) == []
    assert aitextgen(model_folder=output_dir).model is not None
    os.remove(small_disk / "filler")


# --- one run per output_dir ---------------------------------------------------------------------------

HOLDS_THE_LOCK = textwrap.dedent("""
    import sys, time
    import pytorch_lightning as pl
    from lowmem_aitextgen import aitextgen

    class Wait(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            print("training", flush=True)
            time.sleep(60)

    data, base, output_dir = sys.argv[1:4]
    aitextgen(model_folder=base).train(data, output_dir=output_dir, num_steps=1, generate_every=0, callbacks=[Wait()])
""")


def test_a_second_run_into_the_same_output_dir_refuses_and_names_the_first(finished, corpus_file, tmp_path):
    output_dir = str(tmp_path / "shared")
    first = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK, corpus_file, finished, output_dir],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert any("training" in line for line in first.stdout), first.stderr.read()[-2000:]  # (tqdm's \r too)
        with pytest.raises(RuntimeError, match=f"output_dir=.*shared.* is in use by process {first.pid} on"):
            aitextgen(model_folder=finished).train(corpus_file, output_dir=output_dir, num_steps=1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # its lock died with it: the next run takes over, and leaves no lock behind
    aitextgen(model_folder=finished).train(corpus_file, output_dir=output_dir, num_steps=1, generate_every=0)
    assert not os.path.exists(os.path.join(output_dir, ".lowmem_aitextgen.lock"))


# --- what was written is readable by others ------------------------------------------------------------


def test_saved_files_honour_the_umask(corpus_file, tokenizer_file, tmp_path):
    previous = os.umask(0o022)
    try:
        ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=1, generate_every=0)
        ai.generate_to_file(n=1, destination_path=str(tmp_path / "texts.txt"), max_length=8)
    finally:
        os.umask(previous)
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()] + [tmp_path / "texts.txt"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o644" for p in files}
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == "0o755"


def test_nothing_is_left_half_written_after_a_normal_run(corpus_file, tokenizer_file, tmp_path):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=2, save_every=1, generate_every=0)
    assert [n for n in os.listdir(tmp_path / "out") if n.startswith(".")] == []


def test_an_interrupted_cache_save_keeps_the_earlier_cache(corpus_file, tokenizer_file, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache.tar.gz")
    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=32)
    data.save(cache)
    before = snapshot(tmp_path)
    import numpy as np

    def fail_halfway(file, array, **kwargs):
        file.write(b"\x93NUMPY half an array")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        data.save(cache)
    assert snapshot(tmp_path) == before
    monkeypatch.undo()
    assert (TokenDataset(cache, from_cache=True, block_size=32).tokens == data.tokens).all()


@pytest.mark.parametrize("kwargs, says", [
    (dict(files="missing.txt"), "files='missing.txt' does not exist"),
    (dict(vocab_size=0), "vocab_size=0 must be a positive integer"),
    (dict(dropout=1.5), r"dropout=1.5 must be in \(0, 1\)"),
    (dict(added_tokens="<x>"), "added_tokens='<x>' must be a list"),
], ids=["missing file", "vocab_size", "dropout", "added_tokens"])
def test_train_tokenizer_names_bad_input_and_keeps_the_old_tokenizer(corpus_file, tmp_path, kwargs, says):
    from lowmem_aitextgen.tokenizers import train_tokenizer

    prefix = str(tmp_path / "aitextgen")
    train_tokenizer(corpus_file, vocab_size=300, prefix=prefix)
    before = snapshot(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=says):
        train_tokenizer(**{"files": corpus_file, "prefix": prefix, **kwargs})
    assert snapshot(tmp_path) == before
    train_tokenizer(corpus_file, vocab_size=300, prefix=prefix, serialize=False, save_path=str(tmp_path))
    assert {"aitextgen-vocab.json", "aitextgen-merges.txt"} <= set(os.listdir(tmp_path))
    assert hidden_leftovers(tmp_path) == []


def test_a_failed_final_save_keeps_the_trained_model_in_the_object(corpus_file, tokenizer_file, small_disk):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    before = ai.model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    output_dir = str(small_disk / "out")

    class FillTheDiskAtTheEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            with open(small_disk / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass

    with pytest.raises(OSError, match="Saving the model to .* failed.*still in this aitextgen object.*save_for_upload"):
        ai.train(corpus_file, output_dir=output_dir, num_steps=3, save_every=0, generate_every=0,
                 callbacks=[FillTheDiskAtTheEnd()])
    assert not torch.equal(ai.model.transformer.h[0].mlp.c_fc.weight, before)  # trained, not lost
    os.remove(small_disk / "filler")
    ai.save_for_upload(output_dir)
    assert torch.equal(aitextgen(model_folder=output_dir).model.transformer.h[0].mlp.c_fc.weight,
                       ai.model.transformer.h[0].mlp.c_fc.weight)


def test_a_cache_over_its_own_text_is_refused(corpus_file, tokenizer_file, tmp_path):
    text = tmp_path / "text.txt"
    shutil.copy(corpus_file, text)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="cache_destination=.* is the text being encoded"):
        TokenDataset(str(text), tokenizer_file=tokenizer_file, save_cache=True, cache_destination=str(text))
    assert snapshot(tmp_path) == before


def test_generate_checks_what_aitextgen_would_loop_on(finished):
    ai = aitextgen(model_folder=finished)
    with pytest.raises(ValueError, match="min_length=50 is above max_length=20"):
        ai.generate(min_length=50, max_length=20)
    assert ai.generate(n=2, max_length=12, seed=0, return_as_list=True) == ai.generate(
        n=2, max_length=12, seed=0, return_as_list=True)  # aitextgen ignored seed=0


def test_a_model_folder_that_is_a_file_is_named(finished):
    with pytest.raises(NotADirectoryError, match="model_folder=.*model.safetensors.* is a file"):
        aitextgen(model_folder=os.path.join(finished, "model.safetensors"))


def test_deepspeed_without_the_package_is_refused_before_any_work(finished, corpus_file):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    with pytest.raises(ValueError, match="strategy='deepspeed_stage_2' needs the deepspeed package"):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, strategy="deepspeed_stage_2")


DDP_FROM_DASH_C = """
from lowmem_aitextgen import aitextgen
import sys
aitextgen(model_folder=sys.argv[1]).train(sys.argv[2], output_dir="ddp", num_steps=1, n_gpu=0, devices=2,
                                          strategy="ddp")
"""


@pytest.mark.timeout(120)
def test_ddp_from_python_dash_c_is_refused_instead_of_waiting_for_ever(finished, corpus_file):
    """Lightning starts rank 1 by running the script again; from `python -c` there is none."""
    result = subprocess.run([sys.executable, "-c", DDP_FROM_DASH_C, finished, corpus_file], capture_output=True,
                            text=True, timeout=100)
    assert result.returncode == 1 and "not started from a script file" in result.stderr
    assert not os.path.exists("ddp")
