"""Loading never runs code from a file: weights through safetensors or torch.load(weights_only=True),
no trust_remote_code, pickled token caches refused."""

import gzip
import pathlib

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import CtrlC, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("our file checks")

PACKAGE = pathlib.Path(__file__).parent.parent / "lowmem_aitextgen"


class Payload:
    """Unpickling this writes a file: proof that code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "code from a pickle ran"))


def test_legacy_bin_with_code_is_refused_not_run(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    tiny_gpt2_config().save_pretrained(folder)
    marker = tmp_path / "ran.txt"
    state = GPT2LMHeadModel(tiny_gpt2_config()).state_dict()
    state["payload"] = Payload(str(marker))
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        aitextgen(model_folder=str(folder))
    assert not marker.exists()


def test_resume_checkpoint_with_code_is_refused_not_run(tmp_path, corpus_file, tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, output_dir="out", num_steps=3, generate_every=0, callbacks=[CtrlC(at_step=1)])
    checkpoint = torch.load("out/last.ckpt", weights_only=True)
    marker = tmp_path / "ran.txt"
    checkpoint["payload"] = Payload(str(marker))
    torch.save(checkpoint, "out/last.ckpt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        ai.train(corpus_file, output_dir="out", num_steps=2, generate_every=0, resume=True)
    assert not marker.exists()


def test_pickled_token_cache_is_refused(tmp_path, tokenizer_file):
    with gzip.open(tmp_path / "cache.tar.gz", "wb") as f:
        np.save(f, np.array([Payload(str(tmp_path / "ran.txt"))], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        TokenDataset(str(tmp_path / "cache.tar.gz"), from_cache=True, tokenizer_file=tokenizer_file)
    assert not (tmp_path / "ran.txt").exists()


def test_source_never_trusts_remote_code_or_loads_pickles():
    sources = list(PACKAGE.rglob("*.py"))
    assert len(sources) > 10  # the scan sees the package
    for path in sources:
        source = path.read_text(encoding="utf-8")
        assert "trust_remote_code" not in source, path
        assert "allow_pickle=True" not in source, path
        for line in source.splitlines():
            if "torch.load(" in line or ".fit(" in line and "ckpt_path" in line:
                assert "weights_only=True" in line, (path, line)
