"""The lowmem_aitextgen console script with aitextgen's verbs and flags."""

import os
import subprocess
import sys

import pytest

from conftest import tiny_gpt2_config
from lowmem_aitextgen import cli as cli_module


def cli(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    result = subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_cli_tokenizer_encode_train_generate(corpus_file, tmp_path):
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    cli("train_tokenizer", corpus_file, "--vocab_size=1000")
    assert os.path.isfile("aitextgen.tokenizer.json")
    cli("encode", corpus_file, "--tokenizer_file=aitextgen.tokenizer.json", "--block_size=64")
    assert os.path.isfile("dataset_cache.tar.gz")
    cli("train", "dataset_cache.tar.gz", f"--config={tmp_path / 'config.json'}",
        "--tokenizer_file=aitextgen.tokenizer.json", "--num_steps=5", "--save_every=0", "--generate_every=0")
    assert os.path.isfile("trained_model/model.safetensors")
    cli("generate", "--model_folder=trained_model", "--n=2", "--max_length=20", "--destination_path=gen.txt")
    assert open("gen.txt", encoding="utf-8").read().count("=" * 20) >= 1


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_a_mistyped_flag_is_refused_before_any_work(corpus_file, tmp_path):
    """aitextgen's CLI dropped --num_stepz and trained 5,000 steps over trained_model/."""
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    result = run_cli("train", corpus_file, f"--config={tmp_path / 'config.json'}", "--num_stepz=3")
    assert result.returncode == 2
    assert "unknown flag --num_stepz=3; did you mean --num_steps?" in result.stderr
    assert not os.path.exists("trained_model")
    result = run_cli("generate", "--model_folder=trained_model", "--temprature=0.9")
    assert result.returncode == 2 and "did you mean --temperature?" in result.stderr


def test_text_flags_keep_what_was_typed(corpus_file, tokenizer_file, tmp_path):
    """fire would make --output_dir=2024 the number 2024 and --prompt 42 the number 42."""
    tiny_gpt2_config(n_positions=64).save_pretrained(tmp_path)
    cli("train", corpus_file, f"--config={tmp_path / 'config.json'}", f"--tokenizer_file={tokenizer_file}",
        "--output_dir=2024", "--num_steps", "2", "--save_every=0", "--generate_every=0", "--line_by_line", "False")
    assert os.path.isfile(os.path.join("2024", "model.safetensors"))
    cli("generate", "--model_folder=2024", "--prompt", "42", "--n=2", "--max_length=12", "--seed=1",
        "--destination_path=007.txt")
    texts = open("007.txt", encoding="utf-8").read().split("=" * 20 + "\n")
    assert len(texts) == 3 and all(t.startswith("42") for t in texts[:2])


def files_under(folder) -> dict[str, bytes]:
    return {os.path.join(root, name): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


@pytest.mark.parametrize("argv, says", [
    (["estimate", "356M"], "--model='356M' is not a GPT-2 size; use one of"),
    (["estimate", "355M", "--offload"], "--offload=True keeps the weights in host memory while a GPU computes"),
    (["train", "DATA", "--num_steps=0"], "--num_steps=0 must be a positive integer"),
    (["train", "DATA", "--lora=maybe"], "--lora='maybe' must be one of True, False, 'auto'"),
    (["generate", "--model_folder=missing"], "--model_folder='missing' does not exist"),
    # the values before the model is read: a damaged one would otherwise be what the user hears of first
    (["generate", "--model_folder=DAMAGED", "--n=0"], "--n=0 must be"),
    (["generate", "--model_folder=DAMAGED", "--n=3", "--batch_size=2"], "--n=3 must be a multiple of batch_size=2"),
    (["generate", "--model_folder=DAMAGED", "--to_file=False", "--temperature=0"], "--temperature=0 with do_sample=True"),
    (["generate", "--model_folder=DAMAGED", "--prompt_file=missing.txt"], "--prompt_file='missing.txt' does not exist"),
    (["generate", "--model_folder=DAMAGED", "--prompt_file=EMPTY"], "holds no prompt; write one a line"),
    (["generate", "--model_folder=DAMAGED", "--prompt_file=LATIN1"], "is not UTF-8 text (byte 3); save it as UTF-8"),
    (["generate", "--model_folder=DAMAGED", "--stream", "--n=2"], "stream=True with n=2: one text streams at a time"),
    (["encode", "missing.txt"], "--file_path='missing.txt' does not exist"),
    (["train_tokenizer", "missing.txt"], "--files='missing.txt' does not exist"),
])
def test_a_mistake_in_any_verb_is_one_line_on_stderr_and_status_2(argv, says, corpus_file, tmp_path, capsys):
    """No traceback, the flag and its value named with the fix, nothing written or changed."""
    argv = [corpus_file if arg == "DATA" else arg for arg in argv]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    tiny_gpt2_config().save_pretrained(damaged)
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    argv = [arg.replace("DAMAGED", str(damaged)).replace("EMPTY", str(tmp_path / "empty.txt"))
            .replace("LATIN1", str(tmp_path / "latin1.txt")) for arg in argv]
    before = files_under(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli_module.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"lowmem_aitextgen {argv[0]}: ") and says in err, err
    assert "Traceback" not in err and files_under(tmp_path) == before


def test_debug_shows_the_traceback_and_a_crash_of_ours_keeps_it(monkeypatch):
    with pytest.raises(ValueError, match="is not a GPT-2 size"):
        cli_module.main(["estimate", "356M", "--debug"])
    monkeypatch.setenv(cli_module.DEBUG_VARIABLE, "1")
    with pytest.raises(ValueError, match="is not a GPT-2 size"):
        cli_module.main(["estimate", "356M"])
    monkeypatch.delenv(cli_module.DEBUG_VARIABLE)

    def broken(*args, **kwargs):
        return {}["a key our code lost"]

    monkeypatch.setattr(cli_module, "estimate_memory", broken)
    with pytest.raises(KeyError):  # not a user's mistake: the traceback stays
        cli_module.main(["estimate", "355M"])


@pytest.mark.parametrize("verb", sorted(cli_module.COMMANDS))
def test_help_for_each_verb_lists_its_flags_with_their_defaults(verb, capsys):
    cli_module.main([verb, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lowmem_aitextgen {verb}")
    listed = {line.split()[0][2:] for line in out.splitlines() if line.startswith("  --")}
    assert set(cli_module.flag_types(verb)) - listed <= {"file_path", "files"}  # the positional argument
    if verb == "train":
        assert "  --num_steps (5000)" in out and "  --learning_rate (0.001)" in out


def test_generate_takes_a_file_of_prompts_and_streams_until_ctrl_c(tmp_path, tokenizer_file):
    """--prompt_file: n texts for each line's prompt; --stream prints as it goes, and SIGINT (Ctrl-C) ends it at
    once with status 130 and no traceback."""
    import signal
    import time

    from lowmem_aitextgen import aitextgen

    aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64)).save(str(tmp_path / "model"))
    (tmp_path / "prompts.txt").write_text("def\n\nclass\n", encoding="utf-8")
    common = [f"--model_folder={tmp_path / 'model'}", f"--tokenizer_file={tokenizer_file}"]
    cli("generate", *common, f"--prompt_file={tmp_path / 'prompts.txt'}", "--n=2", "--max_length=12",
        "--nonempty_output=False", "--lstrip=False", f"--destination_path={tmp_path / 'texts.txt'}")
    texts = (tmp_path / "texts.txt").read_text(encoding="utf-8").split("\n" + "=" * 20 + "\n")[:-1]
    assert [t[:3] for t in texts] == ["def", "def", "cla", "cla"]

    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    # SIGINT as a terminal delivers it, whoever started the tests: a job a shell starts in the background
    # inherits SIGINT ignored, and Python then leaves it ignored
    process = subprocess.Popen([exe, "generate", *common, "--stream", "--prompt=def", "--max_length=100000",
                                "--suppress_tokens=[0]"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.read(3) == b"def"  # printed as it is made, long before 100,000 tokens
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = process.communicate(timeout=60)
        assert process.returncode == 130 and b"Traceback" not in err, err[-2000:]
        assert time.monotonic() - started < 30
    finally:
        process.kill()
