"""Constructor parity: hub ids (offline, from a cache the test builds), folders, configs, tokenizers."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import CtrlC, corpus_text, fake_hub_cache, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen._compat import default_gpt2_vocab_files, gpt2_tokenizer_from_files

pytestmark = pytest.mark.edges  # transformers' and peft's loaders and configs


def test_hub_model_loads_offline_from_cache(tmp_path):
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "gpt2", model)
    ai = aitextgen(cache_dir=str(tmp_path / "cache"))  # aitextgen(): GPT-2 124M from the hub
    assert torch.equal(ai.model.transformer.wte.weight, model.transformer.wte.weight)
    assert len(ai.tokenizer) == 50257


def test_tf_gpt2_names_the_hub_model_when_offline(tmp_path):
    with pytest.raises(OSError, match=r"(?s)'gpt2-medium'.*model_folder="):
        aitextgen(tf_gpt2="355M", cache_dir=str(tmp_path / "empty"))
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "gpt2-medium", model)
    ai = aitextgen(tf_gpt2="355M", cache_dir=str(tmp_path / "cache"))
    assert ai.gradient_checkpointing is None  # not forced: the plan checkpoints what the memory needs


def test_non_gpt2_hub_model_brings_its_tokenizer(tmp_path):
    vocab, merges = default_gpt2_vocab_files()
    tokenizer = gpt2_tokenizer_from_files(vocab, merges)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "someone/tiny-lm", model, tokenizer)
    ai = aitextgen(model="someone/tiny-lm", cache_dir=str(tmp_path / "cache"))
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="gpt2"), OSError, r"(?s)'gpt2'.*HF_HUB_OFFLINE"),
    (dict(tf_gpt2="999M"), ValueError, "not a GPT-2 size"),
    (dict(model_folder="missing"), FileNotFoundError, "does not exist"),
    (dict(config="missing.json"), FileNotFoundError, "does not exist"),
    (dict(tokenizer_file="missing.json", config=tiny_gpt2_config()), FileNotFoundError, "tokenizer_file"),
    (dict(vocab_file="v.json", config=tiny_gpt2_config()), ValueError, "together"),
])
def test_constructor_errors(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        aitextgen(cache_dir=str(tmp_path / "empty"), **kwargs)


def test_config_path_and_vocab_merges(tmp_path):
    tiny_gpt2_config(vocab_size=50257).save_pretrained(tmp_path)
    vocab, merges = default_gpt2_vocab_files()
    shutil.copy(vocab, tmp_path / "vocab.json")
    shutil.copy(merges, tmp_path / "merges.txt")
    ai = aitextgen(config=str(tmp_path / "config.json"), vocab_file=str(tmp_path / "vocab.json"),
                   merges_file=str(tmp_path / "merges.txt"))
    assert ai.model.config.n_layer == 2
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_finetune_local_gpt2_with_default_tokenizer(tmp_path):
    """A GPT-2-architecture model in a local folder, fine-tuned with GPT-2's own BPE."""
    config = tiny_gpt2_config(vocab_size=50257, n_positions=64, bos_token_id=50256, eos_token_id=50256)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    (tmp_path / "data.txt").write_text(corpus_text(20_000), encoding="utf-8")
    ai = aitextgen(model_folder=str(tmp_path / "base"))
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]
    ai.train(str(tmp_path / "data.txt"), num_steps=20, batch_size=4, learning_rate=1e-3,
             save_every=0, generate_every=0, output_dir=str(tmp_path / "tuned"))
    tuned = aitextgen(model_folder=str(tmp_path / "tuned"))
    assert not torch.equal(tuned.model.transformer.h[0].attn.c_attn.weight,
                           GPT2LMHeadModel.from_pretrained(tmp_path / "base").transformer.h[0].attn.c_attn.weight)
    assert json.load(open(tmp_path / "tuned" / "config.json"))["n_layer"] == 2
    assert isinstance(tuned.generate_one(max_length=20, seed=3), str)


@pytest.mark.parametrize("chooser", ["config", "model_folder", "tf_gpt2"])
def test_model_names_a_tokenizer_only_when_it_chose_the_model(tmp_path, chooser):
    """aitextgen 0.6.0 read a tokenizer named after model= only in its hub branch: with tf_gpt2=,
    model_folder= or config= the model comes from there and the tokenizer from the usual places (here
    GPT-2's: offline, a hub tokenizer for 'trained_model/pytorch_model.bin' would fail)."""
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    model.save_pretrained(tmp_path / "folder")
    fake_hub_cache(str(tmp_path / "cache"), "gpt2", model)
    chosen = {"config": dict(config=tiny_gpt2_config(vocab_size=50257)),
              "model_folder": dict(model_folder=str(tmp_path / "folder")),
              "tf_gpt2": dict(tf_gpt2="124M")}[chooser]
    ai = aitextgen(model="trained_model/pytorch_model.bin", cache_dir=str(tmp_path / "cache"), **chosen)
    assert ai.tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_a_hub_model_that_brings_its_tokenizer_wins_over_tokenizer_file(tmp_path, tokenizer_file, caplog):
    """As in aitextgen: model='owner/name' (not a GPT-2) loads its own tokenizer and nothing else; we say so."""
    vocab, merges = default_gpt2_vocab_files()
    fake_hub_cache(str(tmp_path / "cache"), "someone/tiny-lm", GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257)),
                   gpt2_tokenizer_from_files(vocab, merges))
    ai = aitextgen(model="someone/tiny-lm", tokenizer_file=tokenizer_file, cache_dir=str(tmp_path / "cache"))
    assert len(ai.tokenizer) == 50257
    assert any("tokenizer_file ignored: model='someone/tiny-lm' brings its own tokenizer" in r.message
               for r in caplog.records)


# --- saved weights read on first use, in the dtype training needs ---------------------------------------


def test_a_saved_model_is_read_on_first_use_as_aitextgen_read_it(tmp_path):
    reference = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257, n_layer=4))
    reference.save_pretrained(tmp_path / "m")
    ai = aitextgen(model_folder=str(tmp_path / "m"))
    assert next(ai.model_shape.parameters()).is_meta  # nothing read yet
    assert repr(ai) == "GPT2 loaded with 3M parameters."
    assert ai.model.dtype == torch.float32
    for key, value in reference.state_dict().items():
        assert torch.equal(ai.model.state_dict()[key], value), key
    assert ai.model.lm_head.weight.data_ptr() == ai.model.transformer.wte.weight.data_ptr()  # still tied


def test_a_hub_model_is_read_on_first_use(tmp_path):
    reference = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))
    fake_hub_cache(str(tmp_path / "cache"), "gpt2-medium", reference)
    ai = aitextgen(tf_gpt2="355M", cache_dir=str(tmp_path / "cache"), schema_tokens={"a": "<a>"})
    assert next(ai.model_shape.parameters()).is_meta
    assert torch.equal(ai.model.transformer.h[1].mlp.c_fc.weight, reference.transformer.h[1].mlp.c_fc.weight)
    assert ai.model.config.schema_tokens == {"a": "<a>"}  # what the constructor set on the config is kept


def test_a_damaged_weights_file_is_named_by_the_constructor(tmp_path):
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be loaded .*damaged or incomplete"):
        aitextgen(model_folder=str(tmp_path / "m"))


def _train_lora(ai, corpus_file, output_dir):
    torch.manual_seed(0)
    ai.train(corpus_file, lora=True, precision="bf16-mixed", num_steps=3, seed=1, learning_rate=1e-2,
             output_dir=output_dir, save_every=0, generate_every=0)
    return ai.model.state_dict()


def test_lora_on_weights_read_in_16_bits_trains_as_on_weights_read_in_fp32(corpus_file, tokenizer_file, tmp_path):
    """train(lora=True) reads a saved model straight into bf16; the same run on the model read in fp32
    first (ai.model touched before train) gives the same weights, bit for bit: each object ends in the dtype
    it was read in (issue 37), the fp32 merge rounded to bf16 once is the bf16 one."""
    GPT2LMHeadModel(tiny_gpt2_config(n_layer=2)).save_pretrained(tmp_path / "m")
    deferred = aitextgen(model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file)
    read_first = aitextgen(model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file)
    assert read_first.model.dtype == torch.float32
    one = _train_lora(deferred, corpus_file, str(tmp_path / "a"))
    two = _train_lora(read_first, corpus_file, str(tmp_path / "b"))
    assert deferred.model.dtype == torch.bfloat16 and read_first.model.dtype == torch.float32
    for key, value in one.items():
        assert torch.equal(value, two[key].to(value.dtype)), key


CONSTRUCTION_PEAK = textwrap.dedent("""
    import sys
    from lowmem_aitextgen import aitextgen

    def high_water_mark():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    folder, data, tokenizer, output_dir = sys.argv[1:5]
    before = high_water_mark()
    ai = aitextgen(model_folder=folder, tokenizer_file=tokenizer)
    constructed = high_water_mark()
    ai.train(data, lora=True, precision="bf16-mixed", num_steps=2, output_dir=output_dir, generate_every=0,
             save_every=0)
    print(before, constructed, high_water_mark())
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_construction_then_lora_never_holds_the_fp32_weights(corpus_file, tokenizer_file, tmp_path):
    """A 150M-parameter saved model (600 MB in fp32): the constructor reads no weight, and the whole
    run, construction to final save, stays below what reading the fp32 weights alone would add (it
    holds them in bf16: half that, and the libraries' own growth while training)."""
    config = tiny_gpt2_config(n_layer=12)
    config.n_embd, config.n_head = 1024, 16
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "m")
    fp32_bytes = os.path.getsize(tmp_path / "m" / "model.safetensors")
    result = subprocess.run([sys.executable, "-c", CONSTRUCTION_PEAK, str(tmp_path / "m"), corpus_file,
                             tokenizer_file, str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    before, constructed, whole_run = (int(n) for n in result.stdout.split()[-3:])
    assert constructed - before < 0.1 * fp32_bytes, (before, constructed)
    assert whole_run - before < 0.85 * fp32_bytes, (before, whole_run, fp32_bytes)


def test_the_docs_gpt2_config_cpu_constructs_and_its_first_use_names_tokenizer_file(corpus_file, tokenizer_file,
                                                                                   caplog):
    """aitextgen's model-loading page: `config = GPT2ConfigCPU(); ai = aitextgen(config=config)`, a 1,000-token
    model beside GPT-2's 50,257-token tokenizer, to be followed by a custom tokenizer."""
    from lowmem_aitextgen.utils import GPT2ConfigCPU

    ai = aitextgen(config=GPT2ConfigCPU())
    assert caplog.text.count("The tokenizer has 50,257 tokens but the model's embeddings only 1,000") == 1
    for call, name in ((lambda: ai.generate(max_length=5), "generate"), (ai.generate_one, "generate_one"),
                       (lambda: ai.generate_to_file(n=1), "generate_to_file"),
                       (lambda: ai.train(corpus_file, output_dir="out", num_steps=1), "train"),
                       (lambda: ai.train(corpus_file, output_dir="out", num_steps=1, val_data=corpus_file), "train")):
        with pytest.raises(ValueError, match=r"\(\): The tokenizer has 50,257 tokens.*tokenizer_file="):
            call()
    assert not os.path.exists("out") and not [n for n in os.listdir(".") if n.startswith("ATG_")]
    ai = aitextgen(config=GPT2ConfigCPU(), tokenizer_file=tokenizer_file)  # the page's next step
    ai.train(corpus_file, output_dir="out", num_steps=1, block_size=32, generate_every=0)
    assert isinstance(ai.generate_one(max_length=5), str)


def test_every_path_argument_may_be_a_pathlib_path(corpus_file, tokenizer_file, tmp_path):
    import pathlib

    from lowmem_aitextgen.tokenizers import train_tokenizer

    train_tokenizer([pathlib.Path(corpus_file)], vocab_size=1000, serialize=False, prefix="p",
                    save_path=pathlib.Path("."))
    by_files = aitextgen(vocab_file=pathlib.Path("p-vocab.json"), merges_file=pathlib.Path("p-merges.txt"),
                         config=tiny_gpt2_config())
    assert len(by_files.tokenizer) == 1000
    ai = aitextgen(tokenizer_file=pathlib.Path(tokenizer_file), config=tiny_gpt2_config(),
                   cache_dir=pathlib.Path("cache"))
    ai.train(pathlib.Path(corpus_file), output_dir=pathlib.Path("out"), val_data=pathlib.Path(corpus_file),
             num_steps=2, save_every=1, generate_every=0, callbacks=[])
    ai.train(pathlib.Path(corpus_file), output_dir=pathlib.Path("out2"), num_steps=4, generate_every=0,
             callbacks=[CtrlC(at_step=1)])
    ai.train(pathlib.Path(corpus_file), output_dir=pathlib.Path("out2"), num_steps=4, generate_every=0,
             resume=pathlib.Path("out2/last.ckpt"))
    again = aitextgen(model_folder=pathlib.Path("out"), config=pathlib.Path("out/config.json"))
    assert again.model_source.name == os.path.abspath("out")
    ai.save(pathlib.Path("saved"))
    ai.generate_to_file(n=1, destination_path=pathlib.Path("gen.txt"), max_length=5)
    assert os.path.isfile("saved/model.safetensors") and os.path.isfile("gen.txt")


WRITER = """
import sys, time, torch
sys.path.insert(0, sys.argv[3])
from conftest import tiny_gpt2_config
from transformers import GPT2LMHeadModel
from lowmem_aitextgen.saving import atomic_save
out, seconds = sys.argv[1], float(sys.argv[2])
model, k, ends = GPT2LMHeadModel(tiny_gpt2_config()), 0, time.monotonic() + seconds
print("saving", flush=True)
while time.monotonic() < ends:
    k += 1
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(k / 1000)  # save k: every weight k / 1000, so a mixture of two saves shows
    atomic_save(out, model)
print(k)
"""


def test_a_reader_beside_a_process_saving_in_a_loop_always_gets_one_whole_model(tmp_path, tokenizer_file):
    """Another process saves into the folder over and over (each save atomic: new files renamed into place) while
    this one constructs an object on it and generates, 200 rounds: each object reads the weights it was constructed
    on (the file it opened), whole, never a refusal and never two saves' weights mixed."""
    out = str(tmp_path / "out")
    from lowmem_aitextgen.saving import atomic_save

    model = GPT2LMHeadModel(tiny_gpt2_config())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    atomic_save(out, model)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, out, "600", os.path.dirname(__file__)],
                              stdout=subprocess.PIPE, text=True)
    seen = set()
    try:
        assert writer.stdout.readline() == "saving\n"  # (its imports done: it saves from now on)
        for _ in range(200):
            ai = aitextgen(model_folder=out, tokenizer_file=tokenizer_file)
            ai.generate_one(prompt="def", max_length=6, do_sample=False, decoding="exact")
            values = {float(v) for p in ai.model.parameters() for v in p.detach().unique()}
            assert len(values) == 1, values  # one save's weights
            seen |= values
    finally:
        writer.kill()
        writer.wait()
    assert len(seen) > 20  # the reader met many saves
