"""Every argument checked before any work, each error naming the argument, its value and the fix;
unknown names refused with the closest real ones (issue: nothing lost, every bad input named).

Each case also checks that the finished model in output_dir is byte-identical afterwards."""

import math
import os

import pytest

from conftest import snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen

pytestmark = pytest.mark.timeout(120)
NAN, INF = math.nan, math.inf

# (argument, bad value, what the message must say besides "argument=value")
BAD_TRAIN_ARGUMENTS = [
    ("num_steps", 0, "positive integer"), ("num_steps", "10", "positive integer"), ("num_steps", 2.5, "integer"),
    ("num_steps", True, "integer"),
    ("batch_size", 0, "positive integer"), ("gradient_accumulation_steps", -1, "positive integer"),
    ("learning_rate", 0, r"in \(0, 1\)"), ("learning_rate", 1, r"in \(0, 1\)"), ("learning_rate", NAN, "finite"),
    ("learning_rate", INF, "finite"), ("learning_rate", "1e-3", "finite number"),
    ("weight_decay", -0.1, "in"), ("weight_decay", NAN, "finite"), ("weight_decay", INF, "finite"),
    ("adam_epsilon", 0, "in"), ("adam_epsilon", NAN, "finite"),
    ("max_grad_norm", -1, "in"), ("max_grad_norm", NAN, "finite"), ("max_grad_norm", INF, "finite"),
    ("warmup_steps", -1, "integer >= 0"), ("warmup_steps", 1.5, "integer >= 0"),
    ("save_every", -1, "integer >= 0"), ("generate_every", 0.5, "integer >= 0"), ("n_generate", -1, "integer >= 0"),
    ("seed", -1, "integer >= 0"), ("seed", "x", "integer >= 0"), ("num_workers", -2, "integer >= 0"),
    ("avg_loss_smoothing", 0, "in"), ("avg_loss_smoothing", 1.5, "in"), ("avg_loss_smoothing", NAN, "finite"),
    ("progress_bar_refresh_rate", 0, "positive integer"), ("num_layers_freeze", -1, "integer >= 0"),
    ("n_gpu", -2, "integer >= -1"), ("tpu_cores", -1, "integer >= 0"),
    ("lora", "yes", "one of True, False, 'auto'"), ("lora_r", 0, "positive integer"), ("lora_r", 2.5, "integer"),
    ("lora_alpha", 0, "in"), ("lora_alpha", NAN, "finite"), ("lora_dropout", 1, "in"),
    ("lora_dropout", -0.1, "in"), ("lora_dropout", NAN, "finite"),
    ("lora_target_modules", "c_attn", "list of names"), ("lora_target_modules", [], "list of names"),
    ("chunked_loss", "no", "one of True, False"), ("fp16", "yes", "one of True, False"),
    ("gradient_checkpointing", "on", "one of True, False"), ("freeze_layers", 1, "one of True, False"),
    ("precision", "8-mixed", "not supported"), ("precision", 16.5, "text"),
    ("optimizer", "sgd", "not supported"), ("strategy", "dpp", "not a Lightning strategy"),
    ("num_nodes", 0, "positive integer"), ("devices", "two", "not supported|devices"),
    ("resume", 3, "path of a checkpoint"), ("devices", 2.5, "number of devices"), ("max_memory", "lots", "does not start with a number"), ("max_memory", -5, "must be above 0"),
    ("callbacks", "x", "list of pytorch_lightning Callback"), ("loggers", "wandb", "not a Lightning logger"),
    ("block_size", 0, "positive integer"), ("block_size", 1000, "above the model's context of 32"),
    ("output_dir", "", "empty"), ("output_dir", 42, "path|folder"),
]


@pytest.mark.parametrize("name, value, says", BAD_TRAIN_ARGUMENTS,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_TRAIN_ARGUMENTS])
def test_every_bad_train_argument_is_named_before_any_work(finished, corpus_file, tokenizer_file, name, value, says):
    before = snapshot(os.path.dirname(finished))
    ai = aitextgen(model_folder=finished)
    args = {"num_steps": 2, "output_dir": finished, name: value}
    with pytest.raises((ValueError, TypeError, ImportError)) as caught:
        ai.train(corpus_file, **args)
    message = str(caught.value)
    assert f"{name}={value!r}" in message, message
    assert any(part in message for part in says.split("|")) or __import__("re").search(says, message), message
    assert snapshot(os.path.dirname(finished)) == before


def test_several_machines_without_a_launcher_is_refused_at_once(finished, corpus_file, monkeypatch):
    """torch would wait 30 minutes for the other machines, silently."""
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_NTASKS", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    before = snapshot(finished)
    with pytest.raises(ValueError, match=r"num_nodes=2 needs one process started on each machine.*torchrun"):
        aitextgen(model_folder=finished).train(corpus_file, num_steps=1, output_dir=finished, num_nodes=2)
    assert snapshot(finished) == before


@pytest.mark.parametrize("call, unknown, suggestion", [
    (lambda ai, data, out: ai.train(data, output_dir=out, num_stpes=3), "num_stpes=3", "num_steps"),
    (lambda ai, data, out: ai.train(data, output_dir=out, learning_rat=0.1), "learning_rat=0.1", "learning_rate"),
    (lambda ai, data, out: ai.train(data, output_dir=out, line_by_lin=True), "line_by_lin=True", "line_by_line"),
    (lambda ai, data, out: ai.generate(temprature=0.9), "temprature=0.9", "temperature"),
    (lambda ai, data, out: ai.generate(top_pp=0.9), "top_pp=0.9", "top_p"),
    (lambda ai, data, out: ai.generate_to_file(n=2, destination_path=os.path.join(out, "x.txt"), prompt_text="a"),
     "prompt_text='a'", "prompt"),
    (lambda ai, data, out: ai.generate_one(max_lenght=20), "max_lenght=20", "max_length"),
    (lambda ai, data, out: aitextgen(modle="gpt2"), "modle='gpt2'", "model"),
    (lambda ai, data, out: aitextgen(model_foldr=out), "model_foldr=", "model_folder"),
    (lambda ai, data, out: ai.cross_train([data], num_stepz=2), "num_stepz=2", "num_steps"),
], ids=["train num_stpes", "train learning_rat", "train line_by_lin", "generate temprature", "generate top_pp",
        "generate_to_file prompt_text", "generate_one max_lenght", "constructor modle", "constructor model_foldr",
        "cross_train num_stepz"])
def test_unknown_arguments_are_errors_with_the_close_names(finished, corpus_file, call, unknown, suggestion):
    before = snapshot(os.path.dirname(finished))
    with pytest.raises(TypeError, match="unknown argument") as caught:
        call(aitextgen(model_folder=finished), corpus_file, finished)
    assert unknown in str(caught.value) and f"did you mean {suggestion}" in str(caught.value), caught.value
    assert snapshot(os.path.dirname(finished)) == before


def test_arguments_train_sets_itself_are_refused(finished, corpus_file):
    with pytest.raises(TypeError, match="tokenizer=.* sets itself"):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, tokenizer="gpt2")


BAD_CONSTRUCTOR_ARGUMENTS = [
    ("tf_gpt2", "2B", "not a GPT-2 size"), ("to_gpu", "yes", "one of True, False"),
    ("config", 12, "transformers config"), ("schema_tokens", "<|title|>", "list of names"),
    ("cache_dir", None, "path"), ("bos_token", 0, "text"),
]


@pytest.mark.parametrize("name, value, says", BAD_CONSTRUCTOR_ARGUMENTS,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_CONSTRUCTOR_ARGUMENTS])
def test_bad_constructor_arguments_are_named(name, value, says):
    with pytest.raises(ValueError) as caught:
        aitextgen(**{"config": tiny_gpt2_config(vocab_size=50257), name: value})
    assert f"{name}={value!r}" in str(caught.value) and says in str(caught.value), caught.value


BAD_GENERATE_ARGUMENTS = [
    ("n", 0, "positive integer"), ("temperature", 0, "above 0"), ("temperature", NAN, "finite"),
    ("temperature", INF, "finite"), ("max_length", 0, "positive integer"), ("min_length", -1, "integer >= 0"),
    ("batch_size", 0, "positive integer"), ("prompt", 42, "text"), ("seed", 1.5, "integer"),
    ("do_sample", "yes", "one of True, False"),
]


@pytest.mark.parametrize("name, value, says", BAD_GENERATE_ARGUMENTS,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_GENERATE_ARGUMENTS])
def test_bad_generate_arguments_are_named_before_any_text_is_made(finished, tmp_path, name, value, says):
    ai = aitextgen(model_folder=finished)
    with pytest.raises(ValueError) as caught:
        ai.generate(**{name: value})
    assert f"{name}={value!r}" in str(caught.value) and says in str(caught.value), caught.value
    existing = tmp_path / "samples.txt"
    existing.write_text("texts the user curated\n", encoding="utf-8")
    with pytest.raises(ValueError):
        ai.generate_to_file(**{"n": 2, "destination_path": str(existing), name: value})
    assert existing.read_text(encoding="utf-8") == "texts the user curated\n"
