"""generation: aitextgen's generate() and friends, before and after reload (their input checks: test_faults_arguments.py)."""

import pytest

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen

pytestmark = pytest.mark.edges  # transformers' generate under aitextgen's arguments


@pytest.fixture
def ai(tokenizer_file):
    return aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))


def test_seeded_generation_is_reproducible(ai):
    first = ai.generate(n=2, prompt="def", max_length=30, seed=11, return_as_list=True)
    assert ai.generate(n=2, prompt="def", max_length=30, seed=11, return_as_list=True) == first
    assert ai.generate(n=2, prompt="def", max_length=30, seed=12, return_as_list=True) != first


def test_generate_one_samples_and_to_file(ai, capsys):
    assert isinstance(ai.generate_one(max_length=20, seed=1), str)
    ai.generate_samples(n=1, temperatures=[0.5, 1.0], max_length=20)
    assert capsys.readouterr().out.count("Temperature") == 2
    ai.generate_to_file(n=4, batch_size=2, destination_path="out.txt", max_length=20, seed=3,
                        nonempty_output=False)
    assert open("out.txt", encoding="utf-8").read().split("\n").count("=" * 20) == 4


def test_default_max_length_fits_small_context(ai):
    assert ai.generate(n=1, return_as_list=True, seed=1)  # aitextgen's 256 is above this 64-token context


def test_schema_generation(tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64),
                   schema_tokens=["<|title|>", "<|body|>"])
    out = ai.generate(n=2, prompt="x", max_length=20, schema=True, return_as_list=True, seed=2)
    assert len(out) == 2 and all(set(d) == {"title", "body"} for d in out)


def test_max_length_above_the_context_generates_past_it_continuing_the_text_and_says_so_once(ai, caplog):
    """aitextgen 0.6.0 clamped at the context; the window slides instead: greedy text past the 64-token context
    starts with the text made up to it (it continues rather than restarts) and is longer."""
    common = dict(prompt="def", do_sample=False, decoding="exact", nonempty_output=False, lstrip=False,
                  suppress_tokens=[0])  # no end-of-text token: the text runs to max_length
    up_to_the_context = ai.generate_one(max_length=64, **common)
    with caplog.at_level("INFO", logger="lowmem_aitextgen"):
        past = ai.generate_one(max_length=200, **common)
    assert past.startswith(up_to_the_context) and len(past) > 2 * len(up_to_the_context)
    assert len(ai.tokenizer(past)["input_ids"]) > 150
    assert sum("max_length=200 is above the model's context of 64 tokens; generating past it" in r.message
               for r in caplog.records) == 1


def test_batch_size_makes_the_texts_that_many_at_a_time(ai):
    """The Colab notebook's generate(n=5, batch_size=5, ...); transformers 5 rejects batch_size itself."""
    calls = []
    ai.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0])
                                       if kwargs.get("input_ids") is not None else None, with_kwargs=True)
    texts = ai.generate(n=5, batch_size=2, prompt="def", max_length=12, seed=1, return_as_list=True)
    assert len(texts) == 5
    assert sorted(set(calls)) == [1, 2]  # batches of 2, 2 and 1 sequences
    assert len(ai.generate(n=5, batch_size=5, prompt="def", max_length=12, return_as_list=True)) == 5
