"""generation: aitextgen's generate() and friends, before and after reload (their input checks: test_faults_arguments.py)."""

import re
import threading
import time

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, decoding

pytestmark = pytest.mark.edges  # transformers' generate under aitextgen's arguments


@pytest.fixture
def ai(tokenizer_file):
    made = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    made.tokenizer_file = tokenizer_file
    return made


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


# --- the seed rule, streams, transformers' arguments, bad input, changed weights ---------------------------

PROMPTS = ["def main", "class Foo", "import os"]


def test_a_seeded_text_is_the_same_alone_in_a_prompt_list_streamed_and_in_a_file(ai, tmp_path):
    together = ai.generate(prompt=PROMPTS, seed=7, max_length=24, return_as_list=True, nonempty_output=False)
    alone = [ai.generate(prompt=p, seed=7, max_length=24, return_as_list=True, nonempty_output=False)[0]
             for p in PROMPTS]
    assert together == alone
    streamed = "".join(ai.generate(prompt=PROMPTS[1], seed=7, max_length=24, stream=True))
    assert streamed == alone[1]
    three = ai.generate(prompt=PROMPTS[0], n=3, seed=7, max_length=24, return_as_list=True, nonempty_output=False)
    assert three[0] == alone[0] and len(set(three)) == 3  # choice k: its own stream
    ai.generate_to_file(n=3, batch_size=1, prompt=PROMPTS[0], seed=7, max_length=24, nonempty_output=False,
                        destination_path=str(tmp_path / "t.txt"), sample_delim="=====\n")
    assert (tmp_path / "t.txt").read_text().split("\n=====\n")[:3] == three


def test_no_call_reads_or_seeds_torchs_global_generator(ai):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ai.generate(prompt="def", seed=5, max_length=16, return_as_list=True, nonempty_output=False)
    ai.generate(prompt="def", max_length=16, return_as_list=True, nonempty_output=False)
    next(iter(ai.generate(prompt="def", seed=5, max_length=16, stream=True)))
    assert torch.equal(torch.rand(3), expected)  # a script's own sequence is untouched


def test_a_stream_decodes_only_when_asked_on_the_callers_thread_and_frees_its_cache_when_closed(ai):
    forwards = []
    handle = ai.model.register_forward_hook(lambda module, args, out: forwards.append(threading.get_ident()))
    try:
        threads = threading.active_count()
        stream = ai.generate(prompt="def", seed=2, max_length=40, stream=True, decoding="exact")
        assert forwards == []  # nothing decoded before the first piece is asked for
        next(stream)
        asked = len(forwards)
        assert threading.active_count() == threads and set(forwards) == {threading.get_ident()}
        time.sleep(0.2)
        assert len(forwards) == asked  # an unread stream does no work
        engine = stream.gi_frame.f_locals["engine"]
        assert engine.rows and engine.cache is not None
        stream.close()
        assert engine.rows == [] and engine.cache is None  # its cache let go at once
        next(iter(ai.generate(prompt="def", seed=2, max_length=40, stream=True, decoding="exact")))
    finally:
        handle.remove()


def test_transformers_own_arguments_work_as_in_transformers(ai):
    from transformers import StoppingCriteria

    ids = lambda text: ai.tokenizer(text)["input_ids"]

    class Collect:
        def __init__(self):
            self.got, self.ended = [], False

        def put(self, value):
            self.got += value.reshape(-1).tolist()

        def end(self):
            self.ended = True

    streamer = Collect()
    text = ai.generate(prompt="def main", streamer=streamer, max_new_tokens=7, min_new_tokens=7, seed=4,
                       return_as_list=True, nonempty_output=False, skip_special_tokens=False)[0]
    assert streamer.ended and ai.tokenizer.decode(streamer.got) == text  # the prompt, then each token
    assert len(streamer.got) == len(ids("def main")) + 7
    assert len(ai.generate(prompt="def", num_return_sequences=2, max_length=12, seed=1, return_as_list=True)) == 2

    class AfterThree(StoppingCriteria):
        seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return torch.tensor([len(self.seen) >= 3])

    ai.generate(prompt="def", stopping_criteria=[AfterThree()], min_new_tokens=3, max_length=40, seed=1,
                return_as_list=True, nonempty_output=False)
    assert AfterThree.seen == [len(ids("def")) + k for k in (1, 2, 3)]  # asked after each token, then stopped

    def new_tokens(**kwargs) -> list[int]:
        collect = Collect()
        ai.generate(prompt="def", max_length=40, do_sample=False, streamer=collect, nonempty_output=False, **kwargs)
        return collect.got[len(ids("def")):]

    plain, no_repeat = new_tokens(), new_tokens(no_repeat_ngram_size=2)
    pairs = list(zip(ids("def") + no_repeat, (ids("def") + no_repeat)[1:]))
    assert len(pairs) == len(set(pairs)) and no_repeat != plain
    assert plain[0] not in new_tokens(bad_words_ids=[[plain[0]]])
    end = plain.index(plain[-1])  # where that token first comes
    assert new_tokens(eos_token_id=plain[-1]) == plain[:end + 1]  # a text ends at (and with) its end-of-text token


@pytest.mark.parametrize("kwargs, says", [
    (dict(num_beams=2), r"generate\(num_beams=2\): beam search is not one of this package's decoders"),
    (dict(output_scores=True), r"generate\(output_scores=True\): generate\(\) returns texts"),
    (dict(streamer=object(), n=2), r"a streamer takes one text"),
    (dict(num_return_sequences=2, n=3), r"num_return_sequences=2 with n=3"),
    (dict(prompt="def main and then some", max_length=3), r"max_length=3 is not above the prompt's length"),
    (dict(max_length=1), r"max_length=1 is not above the prompt's length"),
])
def test_what_generate_cannot_honour_is_refused_before_any_work(ai, kwargs, says):
    calls = []
    handle = ai.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=says):
            ai.generate(**kwargs)
    finally:
        handle.remove()
    assert calls == []


def test_weights_changed_in_place_through_data_give_the_new_models_text(ai, tmp_path):
    before = ai.generate(prompt="def", max_length=20, do_sample=False, return_as_list=True)[0]  # the view made
    donor = aitextgen(tokenizer_file=ai.tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    for mine, theirs in zip(ai.model.parameters(), donor.model.parameters()):
        mine.data.mul_(0.5).add_(theirs.data, alpha=0.5)  # a soup, in place: no version counter moves
    ai.model.save_pretrained(tmp_path / "soup")
    fresh = aitextgen(model_folder=str(tmp_path / "soup"), tokenizer_file=ai.tokenizer_file)
    soup = fresh.generate(prompt="def", max_length=20, do_sample=False, return_as_list=True)[0]
    assert ai.generate(prompt="def", max_length=20, do_sample=False, return_as_list=True)[0] == soup != before


def test_an_object_reading_its_model_on_first_use_refuses_a_folder_another_run_wrote_since(tmp_path, tokenizer_file):
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "m")
    before = aitextgen(model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file)
    torch.manual_seed(1)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "m")  # another object's save, by rename
    for use in (lambda: before.generate(prompt="def", max_length=10), lambda: before.save_for_upload(str(tmp_path / "u"))):
        with pytest.raises(ValueError, match=f"read from {tmp_path / 'm'} on first use, and the weights there have "
                                             "changed since"):
            use()
    assert not (tmp_path / "u").exists()


def test_gpt_neo_plans_generates_and_writes_to_a_file(tmp_path, tokenizer_file):
    from test_engine import tiny_neo

    tiny_neo().save_pretrained(tmp_path / "neo")
    ai = aitextgen(model_folder=str(tmp_path / "neo"), tokenizer_file=tokenizer_file)
    plan = decoding.plan_decoding(ai.model_shape, read=False)
    assert plan.max_rows is None or plan.max_rows >= 1
    texts = ai.generate(n=2, prompt="def", seed=3, max_length=30, return_as_list=True, nonempty_output=False)
    assert len(texts) == 2 and all(t.startswith("def") for t in texts)
    ai.generate_to_file(n=2, prompt="def", seed=3, max_length=30, nonempty_output=False,
                        destination_path=str(tmp_path / "neo.txt"), sample_delim="=====\n")
    assert (tmp_path / "neo.txt").read_text().split("\n=====\n")[:2] == texts


def test_the_arguments_page_has_a_row_for_each_of_transformers_arguments():
    import os

    from lowmem_aitextgen import generate_options

    page = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "arguments.md"), encoding="utf-8").read()
    for status, names in (("honoured", generate_options.HONOURED), ("refused", generate_options.REFUSED)):
        listed = {name for line in page.splitlines() if line.startswith(f"| {status} |")
                  for name in re.findall(r"`(\w+)`", line.split("|")[2])}
        assert listed == set(names), (status, sorted(listed ^ set(names)))


def test_a_model_left_in_training_mode_decodes_without_dropout(tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64, dropout=0.5))
    ai.model.train()  # as a run can leave it
    texts = {ai.generate_one(prompt="def", max_length=20, do_sample=False, decoding="exact") for _ in range(3)}
    assert len(texts) == 1 and not ai.model.training
