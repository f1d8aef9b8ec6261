"""Every kind of bad input gets a clear error naming the argument and the fix,
raised before any file is written or overwritten."""

import json
import os
import shutil

import pytest
from transformers import GPT2LMHeadModel

from conftest import CtrlC, tiny_gpt2_config
from lowmem_aitextgen import TokenDataset, aitextgen, saving

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("arguments refused before any library is called")

CONTEXT = 32


def bad_file(content):
    """A train_data path whose file holds `content` (None: no file, "DIR": a folder)."""
    def make(tmp):
        path = os.path.join(tmp, "bad.txt")
        if content == "DIR":
            os.mkdir(path)
        elif content is not None:
            with open(path, "wb") as f:
                f.write(content)
        return path
    return make


def fifo(tmp):
    path = os.path.join(tmp, "pipe")
    os.mkfifo(path)
    return path


def text_file(name, content):
    def make(tmp):
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        return path
    return make


def config_changed(**changes):
    """A model folder whose config.json no longer describes its weights."""
    def make(tmp):
        folder = os.path.join(tmp, "m")
        GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **changes}, f)
        return folder
    return make


def cache_of_another_tokenizer(ai, ctx):
    """A TokenDataset cache encoded by GPT-2's tokenizer, trained on with the model's own."""
    cache = os.path.join(ctx["tmp"], "cache.tar.gz")
    TokenDataset(ctx["corpus"], block_size=8).save(cache)
    ai.train(cache, from_cache=True, output_dir=ctx["out"], num_steps=1)


def unwritable_dir(tmp):
    if os.geteuid() == 0:  # permission bits do not stop root; /proc refuses new files to everyone
        return "/proc/lowmem_aitextgen_out"
    path = os.path.join(tmp, "read_only")
    os.mkdir(path, 0o500)
    return os.path.join(path, "out")


def full_disk(monkeypatch):
    usage = shutil.disk_usage(".")
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda path: usage._replace(free=1000))


def model_folder_without(name):
    def make(tmp):
        GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(os.path.join(tmp, "m"))
        os.remove(os.path.join(tmp, "m", name))
        return os.path.join(tmp, "m")
    return make


def train(data=None, **kwargs):
    """A train() call on the tiny model; `data` makes train_data from the test's folder."""
    def call(ai, ctx):
        args = {"num_steps": 1, "output_dir": ctx["out"], **kwargs}
        if callable(args["output_dir"]):
            args["output_dir"] = args["output_dir"](ctx["tmp"])
        ai.train(data(ctx["tmp"]) if data else ctx["corpus"], **args)
    return call


def construct(**kwargs):
    def call(ai, ctx):
        aitextgen(**{k: v(ctx["tmp"]) if callable(v) else v for k, v in kwargs.items()})
    return call


def generate(**kwargs):
    return lambda ai, ctx: ai.generate(**kwargs)


def small_vocab_model(ai, ctx):
    ai = aitextgen(config=tiny_gpt2_config(vocab_size=1000))  # GPT-2's tokenizer: 50,257 tokens
    ai.train(ctx["corpus"], output_dir=ctx["out"], num_steps=1)


def resume_other_model(ai, ctx):
    """A checkpoint written by a LoRA run cannot continue a full fine-tune."""
    ai.train(ctx["corpus"], output_dir=os.path.join(ctx["tmp"], "lora_run"), num_steps=3, lora=True,
             generate_every=0, callbacks=[CtrlC(at_step=1)])
    ai.train(ctx["corpus"], output_dir=ctx["out"], num_steps=2,
             resume=os.path.join(ctx["tmp"], "lora_run", "last.ckpt"))


CASES = [
    # (what, action, setup, error, message)
    ("missing file", train(bad_file(None)), None, FileNotFoundError, "train_data=.* does not exist"),
    ("directory instead of file", train(bad_file("DIR")), None, IsADirectoryError, "train_data=.* is a folder"),
    ("empty file", train(bad_file(b"")), None, ValueError, "train_data=.* is empty"),
    ("binary file", train(bad_file(b"\x00\x01\x02binary")), None, ValueError, "train_data=.* looks binary"),
    ("non-UTF-8 file", train(bad_file("caf\xe9 au lait".encode("latin-1"))), None, ValueError,
     "train_data=.* is not UTF-8.*iconv"),
    ("non-UTF-8 byte named by offset and line", train(bad_file(b"line one\ncaf\xe9 au lait")), None, ValueError,
     r"train_data=.* is not UTF-8 text: byte 12 \(line 2\) is b'\\xe9'.*iconv -f latin1.*iconv -c"),
    ("a named pipe", train(fifo), None, ValueError, "train_data=.*pipe' is a named pipe \\(FIFO\\), not a regular file"),
    ("a device", train(lambda tmp: "/dev/null"), None, ValueError,
     "train_data='/dev/null' is a character device, not a regular file"),
    ("a CSV with only its header", train(text_file("rows.csv", "text,label\n"), line_by_line=True), None, ValueError,
     "rows.csv' gives no text to train on.*first line, 'text,label', was taken as the header row.*header=False"),
    ("nothing to learn", train(bad_file(b"x")), None, ValueError, "train_data=.* encodes to 1 token.*Add text"),
    ("max_memory with a comma", train(max_memory="2,5GB"), None, ValueError,
     r"max_memory='2,5GB' has a comma in its number; write a decimal point \('2.5GB'\)"),
    ("max_memory with another unit", train(max_memory="2 GBs"), None, ValueError,
     "max_memory='2 GBs' has the unit 'GBs'; use B, KB, MB, GB"),
    ("max_memory without a unit", train(max_memory=6), None, ValueError,
     "max_memory=6 is 6 bytes \\(a number without a unit counts bytes\\); write e.g. '6GB'"),
    ("max_memory below zero", train(max_memory="-1GB"), None, ValueError, "max_memory='-1GB' must be above 0"),
    ("max_memory in words", train(max_memory="two GB"), None, ValueError,
     "max_memory='two GB' does not start with a number"),
    ("a cache encoded by another tokenizer", cache_of_another_tokenizer, None, ValueError,
     "cache.*was encoded by another tokenizer.*50,257 tokens.*1,000 tokens"),
    ("num_steps", train(num_steps=0), None, ValueError, "num_steps=0 must be a positive integer"),
    ("batch_size", train(batch_size=-1), None, ValueError, "batch_size=-1 must be a positive integer"),
    ("gradient_accumulation_steps", train(gradient_accumulation_steps=0), None, ValueError,
     "gradient_accumulation_steps=0 must be a positive integer"),
    ("learning_rate", train(learning_rate=5.0), None, ValueError, r"learning_rate=5.0 must be in \(0, 1\)"),
    ("unknown precision", train(precision="8-mixed"), None, ValueError, "precision='8-mixed' is not supported"),
    ("fp16 precision on CPU", train(precision="16-mixed", n_gpu=0), None, ValueError,
     "needs a CUDA GPU.*bf16-mixed"),
    ("unknown strategy", train(strategy="dpp"), None, ValueError, "strategy='dpp' is not a Lightning strategy"),
    ("unknown optimizer", train(optimizer="sgd"), None, ValueError, "optimizer='sgd' is not supported"),
    ("LoRA targets not in the model", train(lora=True, lora_target_modules=["q_proj"]), None, ValueError,
     r"\['q_proj'\] are not in this model"),
    ("freezing every layer", train(freeze_layers=True, num_layers_freeze=2), None, ValueError,
     "num_layers_freeze=2 freezes every layer"),
    ("tokenizer larger than the embeddings", small_vocab_model, None, ValueError,
     "tokenizer has 50,257 tokens but the model's embeddings only 1,000"),
    ("output_dir is a file", train(output_dir=bad_file(b"x")), None, ValueError, "output_dir=.* is a file"),
    ("output_dir not writable", train(output_dir=unwritable_dir), None, PermissionError,
     "output_dir=.* is not writable"),
    ("output_dir on a full disk", train(), full_disk, OSError, "output_dir=.* free.*needs at least"),
    ("resume from a missing checkpoint", train(resume="nope.ckpt"), None, FileNotFoundError,
     "resume='nope.ckpt' does not exist.*resume=True"),
    ("resume from another model's checkpoint", resume_other_model, None, ValueError,
     "was written by a run with another lora.*same lora"),
    ("model_folder missing", construct(model_folder="missing"), None, FileNotFoundError,
     "model_folder='missing' does not exist"),
    ("model_folder without weights", construct(model_folder=model_folder_without("model.safetensors")), None,
     FileNotFoundError, "model_folder=.* has config.json but no weights"),
    ("model_folder without config", construct(model_folder=model_folder_without("config.json")), None,
     FileNotFoundError, "no config.json in model_folder="),
    ("config with wider weights than the file's", construct(model_folder=config_changed(n_embd=128)), None,
     ValueError, r"config.json does not describe the weights in .*transformer.h.0.attn.c_attn.bias is \[384\] by "
                 r"config.json but \[192\] in the file.*restore the config.json"),
    ("config with more blocks than the file", construct(model_folder=config_changed(n_layer=3)), None,
     ValueError, "config.json does not describe.*12 weights config.json describes are not in the file"),
    ("config with fewer blocks than the file", construct(model_folder=config_changed(n_layer=1)), None,
     ValueError, r"config.json does not describe.*the file holds 12 weights config.json does not describe \(e.g. "
                 r"transformer.h.1"),
    ("config with another vocabulary", construct(model_folder=config_changed(vocab_size=2000)), None,
     ValueError, r"transformer.wte.weight is \[2000, 64\] by config.json but \[1000, 64\]"),
    ("prompt longer than the context", generate(prompt="word " * 200), None, ValueError,
     f"prompt is .* tokens.*context is {CONTEXT} tokens; shorten the prompt"),
]


@pytest.mark.parametrize("what, action, setup, error, match", CASES, ids=[case[0] for case in CASES])
def test_bad_input_fails_clearly_before_writing(corpus_file, tokenizer_file, tmp_path, monkeypatch,
                                                what, action, setup, error, match):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"a previous run's weights")
    before = {p: p.read_bytes() for p in out.rglob("*")}
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=CONTEXT))
    if setup:
        setup(monkeypatch)
    with pytest.raises(error, match=match):
        action(ai, {"tmp": str(tmp_path), "out": str(out), "corpus": corpus_file})
    assert {p: p.read_bytes() for p in out.rglob("*")} == before
