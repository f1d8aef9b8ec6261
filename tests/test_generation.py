"""generation: aitextgen's generate() and friends, before and after reload (their input checks: test_faults_arguments.py)."""

import os
import re
import shutil
import threading
import time

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.generation import decoding, sampling

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
    (dict(num_beam_groups=2, num_beams=4), r"generate\(num_beam_groups=2\): transformers 5 no longer ships"),
    (dict(penalty_alpha=0.6), r"generate\(penalty_alpha=0.6\): transformers 5 no longer ships"),
    (dict(num_beams=2, stream=True), r"stream=True with num_beams=2: .*transformers' generate\(\)"),
    (dict(num_beams=2, streamer=object()), r"streamer=\.\.\.\) with num_beams=2: beam search holds"),
    (dict(output_scores=True), r"generate\(output_scores=True\): generate\(\) returns texts"),
    (dict(streamer=object(), n=2), r"a streamer takes one text"),
    (dict(num_return_sequences=2, n=3), r"num_return_sequences=2 with n=3"),
    (dict(prompt="def main and then some", max_length=3), r"max_length=3 is not above the prompt's length"),
    (dict(max_length=1), r"max_length=1 is not above the prompt's length"),
])
def test_what_generate_cannot_honour_is_refused_before_any_work(ai, kwargs, says):
    assert_refused_before_any_work(ai, kwargs, says)


def assert_refused_before_any_work(ai, kwargs: dict, says: str) -> None:
    """generate(**kwargs) raises ValueError matching `says` before the model's first forward pass."""
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


def test_an_object_reading_its_model_on_first_use_reads_its_own_though_another_save_replaced_it(tmp_path,
                                                                                                   tokenizer_file):
    """A save into the folder between construction and first use (by rename: transformers' save_pretrained too)
    leaves the object its own model, the one the folder held when it was constructed; a file rewritten in place is
    refused, naming the folder, before anything is written."""
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "m")
    shutil.copytree(tmp_path / "m", tmp_path / "copy")
    before = aitextgen(model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file)
    torch.manual_seed(1)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "m")  # another object's save
    own = aitextgen(model_folder=str(tmp_path / "copy"), tokenizer_file=tokenizer_file)
    kwargs = dict(prompt="def", max_length=10, do_sample=False, return_as_list=True)
    assert before.generate(**kwargs) == own.generate(**kwargs) != aitextgen(
        model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file).generate(**kwargs)
    rewritten = aitextgen(model_folder=str(tmp_path / "m"), tokenizer_file=tokenizer_file)
    with open(tmp_path / "m" / "model.safetensors", "r+b") as f:  # in place: the same file, other bytes
        f.seek(0, os.SEEK_END)
        f.write(b" ")
    with pytest.raises(ValueError, match=f"read from {tmp_path / 'm'} on first use, and the weights file there was "
                                         "rewritten in place"):
        rewritten.save_for_upload(str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


# aitextgen 0.6.0's docs/generate.md, "Generation Parameters": the arguments it documents for generate(), in its
# words; each is called the way that page calls it
DOCUMENTED = {
    "n": "Number of texts generated.",
    "max_length": "Maximum length of the generated text",
    "prompt": "Prompt that starts the generated text and is included in the generated text.",
    "temperature": 'Controls the "craziness" of the text (default: 0.7)',
    "top_k": "If nonzero, limits the sampled tokens to the top _k_ values. (default: 0)",
    "top_p": "If nonzero, limits the sampled tokens to the cumulative probability",
    "num_beams": "If greater than 1, executes beam search for cleaner text.",
    "repetition_penalty": "If greater than 1.0, penalizes repetition in a text to avoid infinite loops.",
    "length_penalty": "If greater than 1.0, penalizes text proportional to the length",
    "no_repeat_ngram_size": "Token length to avoid repeating given phrases.",
}
DOCUMENTED_CALL = dict(n=1, prompt="Once upon a time", max_length=40, temperature=0.7, top_k=0, top_p=0.9,
                       num_beams=3, repetition_penalty=1.2, length_penalty=1.5, no_repeat_ngram_size=2)


@pytest.mark.parametrize("do_sample", [False, True])
def test_aitextgens_documented_arguments_run_as_transformers_own_generate_runs_them(tokenizer_file, do_sample):
    """Every argument of aitextgen's generate page, beam search among them, in one call: the texts are what
    transformers' generate() gives for the same call over the model as held (what aitextgen ran), with and without
    sampling (seeded: the same texts again, torch's own generator untouched)."""
    assert set(DOCUMENTED) <= set(DOCUMENTED_CALL)
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    realistic(ai.model)
    call = dict(DOCUMENTED_CALL, n=2, do_sample=do_sample, seed=5, decoding="int8")
    torch.manual_seed(123)
    ours = ai.generate(**call, return_as_list=True, lstrip=False, nonempty_output=False)
    after = torch.rand(1).item()
    torch.manual_seed(123)
    assert after == torch.rand(1).item()  # the script's own sequence untouched by the seeded call
    assert ours == ai.generate(**call, return_as_list=True, lstrip=False, nonempty_output=False)
    ids = ai.tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    seed = sampling.row_seed(5, ids[0].tolist(), 0)
    torch.manual_seed(seed)
    theirs = ai.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_length=40, do_sample=do_sample,
                               temperature=0.7, top_k=0, top_p=0.9, num_beams=3, repetition_penalty=1.2,
                               length_penalty=1.5, no_repeat_ngram_size=2, num_return_sequences=2,
                               pad_token_id=ai.tokenizer.eos_token_id, eos_token_id=ai.tokenizer.eos_token_id)
    assert ours == ai.tokenizer.batch_decode(theirs, skip_special_tokens=True)
    assert ai.generate_one(prompt="Once upon a time", max_length=40, num_beams=3, repetition_penalty=1.2,
                           length_penalty=1.5, no_repeat_ngram_size=2)  # the script, unchanged


def test_beam_search_on_a_prefix_tuned_model_keeps_its_virtual_tokens_and_is_refused_for_prompt_tuning(
        tokenizer_file):
    """peft's generate() puts a prefix's virtual tokens before every beam: the best beam's score is its log-likelihood
    under the model's own forward (peft's); prompt tuning's beams are scored otherwise, so refused by name."""
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model

    for config in (PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
                   PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)):
        torch.manual_seed(0)
        ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
        ai.model = get_peft_model(ai.model, config)
        with torch.no_grad():
            for parameter in ai.model.prompt_encoder.parameters():
                parameter.normal_(0, 3)
        if isinstance(config, PromptTuningConfig):
            with pytest.raises(ValueError, match="num_beams=3 with a prompt-tuned model"):
                ai.generate(prompt="def", max_new_tokens=6, num_beams=3)
            continue
        text = ai.generate_one(prompt="def", max_new_tokens=6, num_beams=3, do_sample=False, length_penalty=0.0,
                               lstrip=False, nonempty_output=False, skip_special_tokens=False)
        ids = ai.tokenizer("def", return_tensors="pt")["input_ids"]
        out = ai.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3,
                                do_sample=False, length_penalty=0.0, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0)
        assert text == ai.tokenizer.decode(out.sequences[0])
        with torch.no_grad():
            logprobs = ai.model(input_ids=out.sequences).logits[0].log_softmax(-1)
        made = out.sequences[0, ids.shape[1]:]
        likelihood = sum(float(logprobs[ids.shape[1] - 1 + i, t]) for i, t in enumerate(made.tolist()))
        assert likelihood == pytest.approx(float(out.sequences_scores[0]), abs=1e-3)


@pytest.mark.parametrize("kwargs, says", [
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"), (dict(top_p=0), r"top_p=0 must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k=-1 must be an integer >= 0"), (dict(top_k=1.5), r"top_k=1.5 must be an integer >= 0"),
    (dict(top_k="50"), r"top_k='50' must be an integer >= 0"),
    (dict(temperature=0), r"temperature=0 with do_sample=True"), (dict(temperature=-1), r"temperature=-1 must be"),
    (dict(repetition_penalty=0), r"repetition_penalty=0 must be in \(0, inf"),
    (dict(typical_p=2.0), r"typical_p=2.0 must be in \(0, 1\]"), (dict(num_beams=0), r"num_beams=0 must be a positive"),
    (dict(no_repeat_ngram_size=-2), r"no_repeat_ngram_size=-2 must be an integer >= 0"),
    (dict(min_p=True), r"min_p=True must be a finite number"), (dict(max_time=0), r"max_time=0 must be in \(0, inf"),
])
def test_sampling_arguments_are_checked_before_any_work_in_generate_and_the_cli(ai, kwargs, says, tmp_path, capsys):
    """generate() refuses each before a forward pass; the CLI (`lowmem_aitextgen generate --NAME=VALUE`) before it
    looks at the model folder (here: none), with the same message."""
    from lowmem_aitextgen import cli

    assert_refused_before_any_work(ai, kwargs, says)
    (name, value), = kwargs.items()
    if isinstance(value, str):
        return  # the command line reads --top_k=50 as the number
    with pytest.raises(SystemExit) as ended:
        cli.main(["generate", f"--model_folder={tmp_path / 'none'}", f"--{name}={value}"])
    assert ended.value.code != 0 and re.search(says, capsys.readouterr().err)


def test_a_temperature_too_small_to_scale_by_decodes_as_the_most_likely_token(tokenizer_file):
    """Below sampling.MIN_TEMPERATURE the scaled scores overflow: such a temperature decodes greedily, the limit
    of sampling as it goes to zero, with top_k and without; one above it still samples."""
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    realistic(ai.model)
    greedy = ai.generate(n=2, prompt="The", max_length=30, do_sample=False, return_as_list=True)
    for top_k in (50, 0):
        for seed in (1, 2):
            assert ai.generate(n=2, prompt="The", max_length=30, temperature=1e-40, top_k=top_k, seed=seed,
                               return_as_list=True) == greedy
    assert ai.generate(n=2, prompt="The", max_length=30, temperature=5.0, top_k=0, seed=1,
                       return_as_list=True) != greedy


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

    from lowmem_aitextgen.generation import generate_options

    page = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "arguments.md"), encoding="utf-8").read()
    for status, names in (("honoured", generate_options.HONOURED), ("transformers", generate_options.BY_TRANSFORMERS),
                          ("refused", generate_options.REFUSED)):
        listed = {name for line in page.splitlines() if line.startswith(f"| {status} |")
                  for name in re.findall(r"`(\w+)`", line.split("|")[2])}
        assert listed == set(names), (status, sorted(listed ^ set(names)))


def test_a_model_left_in_training_mode_decodes_without_dropout(tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64, dropout=0.5))
    ai.model.train()  # as a run can leave it
    texts = {ai.generate_one(prompt="def", max_length=20, do_sample=False, decoding="exact") for _ in range(3)}
    assert len(texts) == 1 and not ai.model.training


def test_generate_to_file_with_beam_search_writes_what_generate_makes(tokenizer_file, tmp_path):
    """generate_to_file(num_beams=...) decodes on transformers' generate() over the model as held too: the file holds
    the texts generate() returns for the same call."""
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    realistic(ai.model)
    kwargs = dict(prompt="def", max_length=20, num_beams=3, do_sample=False, no_repeat_ngram_size=2)
    path = ai.generate_to_file(n=2, batch_size=2, destination_path=str(tmp_path / "beams.txt"), sample_delim="|\n",
                               **kwargs)
    written = open(path, encoding="utf-8").read().split("\n|\n")[:-1]
    assert written == ai.generate(n=2, return_as_list=True, **kwargs) and written[0] != written[1]
