"""Generation's plan and forms (decoding.py), many prompts at once, streaming and seeds, on tiny GPT-2s; speed is
benchmarks/generate_speed.py's, never a test's."""

import copy
import dataclasses
import hashlib
import json
import subprocess
import sys
import threading

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.generation import decoding, forms, int8_kernels, packed16, views
from lowmem_aitextgen.native import native, native_attention, native_bf16

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("generate()'s own plan, forms and batching; what it calls of transformers' generate is "
                    "test_generation's, which runs at the oldest versions")

FORMS = ("exact", "int8", "bf16")  # those this machine kind runs (both CPU kinds: bf16 only where native)


def forms_here() -> list[str]:
    return [f for f in FORMS if f != "bf16" or hardware.cpu().bf16_native]


@pytest.fixture
def folder(tmp_path):
    """A tiny GPT-2 with trained-looking biases and norms, saved."""
    realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=64))).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


@pytest.fixture
def ai(folder, tokenizer_file):
    return aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)


def weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode() + value.detach().float().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("cpu", hardware.CPUS)
def test_the_plan_on_each_cpu_kind_decodes_in_int8_and_exact_as_held(cpu, ai):
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        plan = decoding.plan_decoding(ai.model)
        assert (plan.form, plan.device) == ("int8", "cpu")
        assert plan.file_batch == decoding.FILE_BATCH["cpu"] and "int8 kernels" in plan.describe()
        assert decoding.plan_decoding(ai.model, "exact").form == "fp32"


def test_without_int8_kernels_a_cpu_decodes_in_bf16_where_native_else_fp32(ai):
    for bf16_native, form in ((True, "bf16"), (False, "fp32")):
        cpu = hardware.CPU(name="CPU", bf16_native=bf16_native, int8_kernels=False)
        with hardware.presenting(hardware.Hardware(cpu)):
            assert decoding.plan_decoding(ai.model).form == form


def test_an_int8_views_cache_is_bf16_where_the_cpu_computes_it_natively_and_counted_so(ai):
    """decoding.cache_dtype: an int8 view's KV cache in bf16 on a CPU with native bf16 (its attention's kernel
    twice as quick there, kv_cache.py), fp32 elsewhere; the engine's buffers hold it so, and the memory a text
    needs (the texts that fit at once) counts its bytes.  16-bit views keep their own dtype."""
    from lowmem_aitextgen.generation.engine import Engine
    from lowmem_aitextgen.generation.generation import prompt_ids
    from lowmem_aitextgen.generation.sampling import Row, RowSettings

    config, per_row = ai.model.config, {}
    for cpu, machine in hardware.CPUS.items():
        with hardware.presenting(hardware.Hardware(machine)):
            view = decoding.decoding_model(ai.model, "int8", True)
            per_row[cpu] = decoding.DecodingMemory(ai.model, "cpu", 30, read=True).per_row("int8")
            said = decoding.plan_decoding(ai.model, tokenwise=True).describe()
            assert ("its KV cache in bf16" in said) == machine.bf16_native, said
            if machine.bf16_native:
                assert decoding.decoding_model(ai.model, "bf16").cache_dtype is None  # its activations' own
        engine = Engine(view, ai.tokenizer, (-1,))
        engine.join([Row(prompt_ids(ai.model, ai.tokenizer, "def main", None), RowSettings(max_new=3))])
        engine.step()
        held = {layer.keys.dtype for layer in engine.cache.layers} | {layer.slots.both.dtype
                                                                       for layer in engine.cache.layers}
        assert held == {torch.bfloat16 if machine.bf16_native else torch.float32}, cpu
        engine.close()
    fp32_cache = 2 * config.n_layer * config.n_embd * 30 * 4
    assert per_row["no native bf16"] - per_row["native bf16"] == fp32_cache // 2


def test_the_int8_kernels_decoding_calls_are_in_this_torch():
    """Fails on a torch that dropped one: without torch.ao's fbgemm ops int8 decodes on oneDNN's (slower at a batch
    of one), without both decoding plans another form (the tests below)."""
    assert hardware.missing_int8_kernels() == [], "this torch dropped an fbgemm kernel or torch.ao function"
    assert hardware.missing_onednn_int8_kernels() == [], "this torch dropped a oneDNN int8 op int8_kernels.py calls"
    assert hardware.cpu().int8_kernels


def test_the_packed_bf16_kernels_a_cpus_bf16_view_calls_are_in_this_torch():
    """Fails on a torch that dropped them (private mkldnn ops): a bf16 view then keeps its modules, 1.5x slower."""
    assert hardware.missing_packed_kernels() == [], "this torch dropped an op packed16.py calls"


def _projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for block in model.transformer.h for m in block.modules() if views._is_projection(m)
            or isinstance(m, packed16.PackedLinear)]


@pytest.mark.parametrize("kernel", ["ours", "oneDNN's"])
def test_a_cpus_bf16_view_computes_each_projection_packed_as_the_module_did(ai, kernel, monkeypatch):
    """On a CPU with native bf16, packed for our kernel, or for oneDNN's where ours is not (no gcc); elsewhere
    (AVX2: the bf16 form is not planned there) the view keeps its modules."""
    if kernel == "oneDNN's":
        monkeypatch.setattr(native_bf16, "available", lambda: False)  # as a machine without gcc
    before = weights_hash(ai.model)
    calls = []  # a hook on the model's projection runs in its view too
    ai.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda module, args, out: calls.append(module))
    plain = copy.deepcopy(ai.model).to(torch.bfloat16).eval()
    view = decoding.decoding_model(ai.model, "bf16").model
    packs = hardware.cpu().bf16_native
    assert all(isinstance(m, packed16.PackedLinear) == packs for m in _projections(view))
    kind = packed16.NativeBf16Linear if native_bf16.available() else packed16.PackedLinear  # ours where it runs
    assert not packs or all(type(m) is kind for m in _projections(view))
    with torch.inference_mode():
        for module, packed in zip(_projections(plain), _projections(view)):
            x = torch.randn(3, 5, module.weight.shape[0]).to(torch.bfloat16)  # Conv1D: (in, out)
            expected, got = module(x).float(), packed(x).float()
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2), float((got - expected).abs().max())
    assert len(calls) == 2 and isinstance(calls[1], packed16.PackedLinear) == packs  # the plain copy's, the view's
    copied = packs and kind is packed16.NativeBf16Linear  # ours packs the LM head too, a copy of the embedding
    assert isinstance(view.lm_head, packed16.NativeBf16Linear) == copied == packed16.head_copied()
    with torch.inference_mode():
        x = torch.randn(2, view.config.n_embd).to(torch.bfloat16)
        expected, got = plain.lm_head(x).float(), view.lm_head(x).float()
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2), float((got - expected).abs().max())
    memory = decoding.DecodingMemory(ai.model, "cpu", 64, True)
    embedding = ai.model.get_input_embeddings().weight.numel()
    assert memory.weights("bf16") == 2 * (sum(p.numel() for p in ai.model.parameters()) + embedding * copied)
    assert weights_hash(ai.model) == before  # the model's own weights and modules untouched
    assert all(type(m).__name__ == "Conv1D" for m in _projections(ai.model))


@pytest.mark.parametrize("without", ["an op, and ours", "an op", "native bf16"])
def test_without_the_packed_kernels_a_bf16_view_keeps_its_modules_and_computes(ai, monkeypatch, without):
    """Without oneDNN's ops our own kernel packs them where it runs (native_bf16.py); without it too, or on a CPU
    without native bf16, the view keeps its modules."""
    if without.startswith("an op"):
        monkeypatch.setattr(hardware, "PACKED_OPS", (*hardware.PACKED_OPS, "_gone"))  # as a torch that dropped one
        assert hardware.missing_packed_kernels() == ["torch.ops.mkldnn._gone"]
    if without != "an op":
        monkeypatch.setattr(native_bf16, "available", lambda: False)  # as a CPU without AVX512-BF16, or no gcc
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16" if without.startswith("an op") else
                                                               "no native bf16"])):
        view = decoding.decoding_model(ai.model, "bf16").model
    ours = without == "an op" and native_bf16.available()
    assert all(type(m) is packed16.NativeBf16Linear for m in _projections(view)) if ours else \
        not any(isinstance(m, packed16.PackedLinear) for m in view.modules())
    assert all(m.weight.dtype == torch.bfloat16 for m in _projections(view) if not ours)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        got, expected = view(input_ids=ids).logits.float(), ai.model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=0.1), float((got - expected).abs().max())


def test_without_torch_aos_int8_ops_int8_decodes_on_onednns_the_same_texts(ai, folder, tokenizer_file,
                                                                           monkeypatch):
    """torch.ao's quantize_dynamic gone (torch says it will remove it): every projection of either int8 view is a
    tokenwise Linear on oneDNN's kernel (int8_kernels.py), and a seeded text is the one fbgemm's view gives."""
    calls = dict(n=3, max_length=16, seed=7, temperature=0.9, return_as_list=True, nonempty_output=False)
    monkeypatch.setattr(native_attention, "available", lambda: False)  # torch's attention in both texts
    on_fbgemm = ai.generate(**calls)  # (or on ours: the same bits, tests/test_int8_kernels.py)
    monkeypatch.setattr(native, "built", lambda: None)  # ours not built here
    monkeypatch.delattr(torch.ao.quantization, "quantize_dynamic")  # as a torch without it
    assert hardware.missing_int8_kernels() == ["torch.ao.quantization.quantize_dynamic"]
    plan = decoding.plan_decoding(ai.model)
    assert hardware.cpu().int8_kernels and plan.form == "int8" and "oneDNN's" in plan.describe()
    for tokenwise in (True, False):
        view = decoding.decoding_model(ai.model, "int8", tokenwise).model
        linears = [m for m in view.modules() if isinstance(m, int8_kernels.TokenwiseInt8Linear)]
        assert len(linears) == 4 * view.config.n_layer + 1  # every projection and the LM head
        assert all(isinstance(m.product, int8_kernels.OneDNNProduct) for m in linears)
    fresh = aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)  # its views made on oneDNN's kernel
    assert fresh.generate(**calls) == on_fbgemm
    assert len(fresh.generate(n=2, max_length=12, return_as_list=True, nonempty_output=False)) == 2  # unseeded


def test_without_both_int8_kernels_generate_decodes_in_another_form_and_names_them(ai, monkeypatch):
    monkeypatch.delattr(torch.ao.quantization, "quantize_dynamic")  # as a torch without it
    monkeypatch.setattr(hardware, "ONEDNN_INT8_OPS", (*hardware.ONEDNN_INT8_OPS, "_gone"))  # and one of these
    assert not hardware.cpu().int8_kernels and decoding.plan_decoding(ai.model).form in ("bf16", "fp32")
    assert len(ai.generate(n=2, max_length=12, seed=1, return_as_list=True, nonempty_output=False)) == 2
    assert len(ai.generate(n=2, max_length=12, return_as_list=True, nonempty_output=False)) == 2
    with pytest.raises(ValueError, match="lacks torch.ao.quantization.quantize_dynamic, torch.ops.onednn._gone"):
        ai.generate(max_length=12, decoding="int8")


def test_a_form_that_missed_the_quality_bound_is_not_chosen(ai, caplog):
    """The refusal path: int8 measured 2% above fp32 is passed over for the next form, and said."""
    measured = {**forms.FORM_RECORDS, "int8": dataclasses.replace(forms.FORM_RECORDS["int8"], quality=0.02,
                                                                  tokenwise_quality=0.02)}
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        assert decoding.plan_decoding(ai.model, forms=measured).form == "bf16"
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):
        assert decoding.plan_decoding(ai.model, forms=measured).form == "fp32"
    assert "Not decoding in int8: its held-out loss measured 2.0% above fp32's" in caplog.text


def test_on_gpus_the_plan_decodes_in_their_native_16_bits(ai):
    """Planned on presented cards (the model's device read as a GPU's)."""
    for name, form in (("12 GiB", "bf16"), ("T4", "fp16")):
        card = hardware.CARDS[name]
        with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"], card)):
            form_chosen, _ = decoding.decide_form(ai.model, "gpu", False)
            assert form_chosen == form, name
            with pytest.raises(ValueError, match="decoding='int8': int8 decoding runs on the CPU"):
                decoding.check_runs_here("int8", "gpu", ai.model)


@pytest.mark.parametrize("asked, cpu, says", [
    ("fp16", "native bf16", "a CPU computes fp16 by emulation"),
    ("bf16", "no native bf16", "this device computes bf16 by emulation"),
])
def test_a_form_this_device_cannot_run_is_refused_before_any_work(ai, asked, cpu, says, tmp_path):
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        with pytest.raises(ValueError, match=f"decoding='{asked}': {says}"):
            ai.generate(decoding=asked)
        with pytest.raises(ValueError, match=f"decoding='{asked}'"):
            ai.generate_to_file(n=2, decoding=asked, destination_path=str(tmp_path / "texts.txt"))
    assert not (tmp_path / "texts.txt").exists()
    no_int8 = hardware.CPU(name="CPU", bf16_native=True, int8_kernels=False)
    with hardware.presenting(hardware.Hardware(no_int8)), pytest.raises(ValueError, match="decoding='int8': torch"):
        ai.generate(decoding="int8")


@pytest.mark.parametrize("form", forms_here())
def test_no_form_changes_the_weights_and_train_after_generate_trains_them(form, ai, folder, tokenizer_file,
                                                                        small_data):
    before = weights_hash(ai.model)
    ai.generate(n=2, prompt="def", max_length=20, seed=1, decoding=form, return_as_list=True)
    assert weights_hash(ai.model) == before and next(ai.model.parameters()).dtype == torch.float32
    common = dict(output_dir="trained", num_steps=2, save_every=0, generate_every=0, seed=1)
    ai.train(small_data, **common)
    untouched = aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)
    untouched.train(small_data, **{**common, "output_dir": "reference"})
    assert weights_hash(ai.model) == weights_hash(untouched.model)
    after = ai.generate_one(prompt="def", max_length=20, seed=1, decoding=form)  # a view of the new weights
    assert after == untouched.generate_one(prompt="def", max_length=20, seed=1, decoding=form)


def test_exact_greedy_decoding_is_transformers_generate_token_for_token(ai):
    ids = ai.tokenizer("def main", return_tensors="pt")["input_ids"]
    theirs = ai.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_length=40, do_sample=False,
                               pad_token_id=0)
    ours = ai.generate_one(prompt="def main", max_length=40, do_sample=False, decoding="exact", lstrip=False,
                           skip_special_tokens=False, nonempty_output=False)
    assert ours == ai.tokenizer.decode(theirs[0])


@pytest.mark.parametrize("form", forms_here())
def test_many_prompts_give_n_texts_each_in_order_each_as_it_would_alone(form, ai):
    prompts = ["def", "class Foo", "import os, sys and then the rest", "x"]  # of different lengths: padded
    common = dict(max_length=30, do_sample=False, decoding=form, nonempty_output=False, return_as_list=True)
    together = ai.generate(prompt=prompts, n=2, **common)
    alone = [text for prompt in prompts for text in ai.generate(prompt=prompt, n=2, **common)]
    assert together == alone and len(together) == 8


def test_generate_to_file_takes_many_prompts(ai, tmp_path):
    path = ai.generate_to_file(n=3, prompt=["def", "class"], destination_path=str(tmp_path / "t.txt"),
                               max_length=12, seed=1, nonempty_output=False, lstrip=False)
    texts = open(path, encoding="utf-8").read().split("\n" + "=" * 20 + "\n")[:-1]
    assert [t[:3] for t in texts] == ["def"] * 3 + ["cla"] * 3


def test_stream_pieces_join_to_the_text_generate_returns(ai):
    common = dict(prompt="def", max_length=40, seed=5, suppress_tokens=[0])
    pieces = list(ai.generate(stream=True, **common))
    assert len(pieces) > 5 and "".join(pieces) == ai.generate_one(**common)
    past_the_context = dict(common, max_length=150, decoding="exact")
    assert "".join(ai.generate(stream=True, **past_the_context)) == ai.generate_one(**past_the_context)
    after_a_line = dict(common, prompt="def main():\n")  # the text so far ends a line: decoded apart after it
    pieces = list(ai.generate(stream=True, **after_a_line))
    assert pieces[0].endswith("\n") and "".join(pieces) == ai.generate_one(**after_a_line)


def test_leaving_a_stream_stops_the_decoding_at_once(ai):
    stream = ai.generate(stream=True, prompt="def", max_length=5000, suppress_tokens=[0])
    next(stream)
    stream.close()  # what break or Ctrl-C in the loop does
    assert not [t for t in threading.enumerate() if t.name.startswith("lowmem_aitextgen generate")]


@pytest.mark.parametrize("kwargs, says", [
    (dict(prompt=[]), "prompt=[] is an empty list"),
    (dict(prompt=["a", 3]), "must hold only text"),
    (dict(prompt=7), "must be text or a list of texts"),
    (dict(stream=True, n=2), "stream=True with n=2: one text streams at a time"),
    (dict(stream=True, prompt=["a", "b"]), "one text streams at a time; give one prompt"),
    (dict(stream=True, schema=True), "stream=True with schema=True"),
    (dict(decoding="int4"), "decoding='int4' must be one of 'auto', 'exact'"),
])
def test_bad_generation_arguments_are_refused_naming_them(ai, kwargs, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        ai.generate(**kwargs)


SEEDED = """
import json, sys
from lowmem_aitextgen import aitextgen
ai = aitextgen(model_folder=sys.argv[1], tokenizer_file=sys.argv[2])
print(json.dumps({form: ai.generate(n=2, prompt="def", max_length=24, seed=7, decoding=form, return_as_list=True)
                  for form in sys.argv[3:]}))
"""


def test_a_seed_gives_the_same_texts_twice_in_a_new_process_and_from_the_saved_model(ai, folder, tokenizer_file):
    forms = forms_here()
    here = {form: ai.generate(n=2, prompt="def", max_length=24, seed=7, decoding=form, return_as_list=True)
            for form in forms}
    assert here == {form: ai.generate(n=2, prompt="def", max_length=24, seed=7, decoding=form, return_as_list=True)
                    for form in forms}
    ai.save("resaved")
    for source in (folder, "resaved"):
        result = subprocess.run([sys.executable, "-c", SEEDED, source, tokenizer_file, *forms], capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == here, source


def test_to_fp16_on_a_cpu_keeps_the_model_and_says_so(ai, caplog):
    ai.to_fp16()
    assert next(ai.model.parameters()).dtype == torch.float32 and "no fp16 arithmetic" in caplog.text


def test_to_fp16_then_to_gpu_leaves_fp16_on_the_card(ai, monkeypatch):
    """aitextgen's order (its constructor's to_fp16=True, to_gpu=True, and its tutorials): to_fp16() while the
    model is still on the CPU, then to_gpu().  With a GPU there, the model reaches the card in fp16, as
    aitextgen's did, not fp32.  The machine's answer (a GPU is there) is presented; the move itself, which
    needs one, is aitextgen's own and left out."""
    moved = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aitextgen.__mro__[1], "to_gpu", lambda self, index=0: moved.append(index))
    ai.to_fp16()
    assert next(ai.model.parameters()).dtype == torch.float32  # halved only on the card
    ai.to_gpu()
    assert moved == [0] and next(ai.model.parameters()).dtype == torch.float16


# --- quality: the study, small enough for the suite -------------------------------------------


def held_out_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.stack([model(input_ids=b[None], labels=b[None]).loss for b in blocks]).mean())


def topic_bytes() -> torch.Tensor:
    """Python's documentation topics, as bytes: the study's text."""
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return torch.tensor(list(text.encode("utf-8")[:400_000]), dtype=torch.long)


@pytest.fixture(scope="module")
def study():
    """A small GPT-2 trained on Python's documentation topics (bytes), its held-out blocks, and the same model
    carrying GPT-2's activation outliers (views.carry_outliers)."""
    data = topic_bytes()
    blocks = data[: len(data) // 64 * 64].view(-1, 64)
    held_out, train = blocks[:24], blocks[24:]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=256, n_positions=64, n_layer=2, n_embd=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        batch = train[torch.randint(len(train), (8,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model, views.carry_outliers(copy.deepcopy(model), [3, 17, 60, 101], 40.0), held_out


def test_the_outlier_model_computes_what_the_trained_one_does_in_fp32(study):
    trained, outliers, held_out = study
    assert outliers.transformer.h[0].ln_1.weight.abs().max() > 20 * trained.transformer.h[0].ln_1.weight.abs().max()
    torch.testing.assert_close(outliers(held_out[:4]).logits, trained(held_out[:4]).logits, rtol=1e-4, atol=1e-4)


def test_int8_without_the_smoothing_misses_the_bound_where_outliers_are_large_and_the_plan_passes_it_over(
        study, monkeypatch, ai):
    """Per-tensor activation scales on a model whose outlier channels are 100x: more than 1% worse than fp32
    (why decoding.py smooths), and a form measured so is not chosen."""
    trained, _, held_out = study
    large = views.carry_outliers(copy.deepcopy(trained), [3, 17, 60, 101], 100.0)
    exact = held_out_loss(trained, held_out)
    smoothed = held_out_loss(decoding.decoding_model(large, "int8").model, held_out)
    monkeypatch.setattr(views, "smooth", lambda norm, linear: (norm, linear))
    unsmoothed = held_out_loss(decoding.decoding_model(large, "int8").model, held_out)
    assert smoothed <= exact * (1 + decoding.QUALITY_BOUND) < unsmoothed
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        missed = {**forms.FORM_RECORDS, "int8": dataclasses.replace(forms.FORM_RECORDS["int8"],
                                                                    quality=unsmoothed / exact - 1)}
        assert decoding.plan_decoding(ai.model, forms=missed).form == "bf16"


@pytest.mark.parametrize("form, tokenwise", [("int8", False), ("int8", True), ("bf16", False)])
def test_each_default_form_is_within_the_quality_bound_on_both_models(form, tokenwise, study):
    trained, outliers, held_out = study
    exact = held_out_loss(trained, held_out)
    for model in (trained, outliers):
        loss = held_out_loss(decoding.decoding_model(model, form, tokenwise).model, held_out)
        assert loss <= exact * (1 + decoding.QUALITY_BOUND), (form, loss, exact)
        assert forms.FORM_RECORDS[form].measured(tokenwise) <= decoding.QUALITY_BOUND


def test_a_model_not_read_yet_decodes_in_int8_read_straight_from_its_folder(folder, tokenizer_file):
    """The object's model stays unread (1558M decodes in 3 GB: benchmarks/generate_speed.py --memory), and the
    texts are those of the int8 view of the model read whole."""
    unread = aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)
    common = dict(n=2, prompt="def", max_length=24, seed=7, decoding="int8", return_as_list=True)
    from_folder = unread.generate(**common)
    assert unread._deferred is not None  # not read
    read = aitextgen(model_folder=folder, tokenizer_file=tokenizer_file)
    read.model  # noqa: B018  (read whole first)
    assert read.generate(**common) == from_folder


# --- memory, and when a view is made ------------------------------------------------------------


def gpt2_1558m(dtype: torch.dtype) -> torch.nn.Module:
    """GPT-2 1558M's shape, weightless."""
    from transformers import GPT2Config

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25)).to(dtype)


def test_a_4_gib_card_holding_1558m_in_fp16_plans_within_its_budget_and_refuses_what_does_not_fit():
    """aitextgen's 1558M tutorial (to_fp16, to_gpu) on a 4 GiB card: aitextgen's default length fits one text
    at a time; the whole context does not, refused before any work, naming a length that fits."""
    model = gpt2_1558m(torch.float16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    card = hardware.notebook_with_earlier_model(hardware.CARDS["4 GiB"], held)
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"], card)):
        plan = decoding.plan_decoding(model, length=256, device="gpu")
        memory = decoding.DecodingMemory(model, "gpu", 256, read=True)
        assert plan.form == "fp16" and plan.max_rows >= 1 and plan.file_batch == min(plan.max_rows, 32)
        assert memory.weights("fp16") + plan.max_rows * memory.per_row("fp16") <= memory.room
        with pytest.raises(ValueError, match=r"max_length=1024: one text decoded in fp16 needs .* use max_length="
                                             r"(\d+) or less") as refused:
            decoding.plan_decoding(model, length=1024, device="gpu")
        fits = int(refused.value.args[0].split("use max_length=")[1].split()[0])
        assert decoding.plan_decoding(model, length=fits, device="gpu").max_rows == 1
        with pytest.raises(ValueError, match="max_length"):
            decoding.plan_decoding(model, length=fits + 1, device="gpu")


def test_a_small_cpu_reads_1558m_straight_into_int8_and_a_large_one_may_decode_as_held_first():
    model = gpt2_1558m(torch.float32)
    small = hardware.CPU(name="CPU", bf16_native=True, available=int(3.5 * 2**30), resident=2**29)
    with hardware.presenting(hardware.Hardware(small)):
        plan = decoding.plan_decoding(model, length=256, read=False)
        assert (plan.form, plan.view_after) == ("int8", 0)  # fp32's 6.2 GB does not fit: no waiting
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        assert decoding.plan_decoding(model, length=256, read=False).view_after == forms.FORM_RECORDS[
            "int8"].pays_after["cpu"]


def test_texts_are_decoded_as_many_at_once_as_the_memory_holds(ai, tmp_path):
    memory = decoding.DecodingMemory(ai.model, "cpu", 30, read=True)
    room = int(3.5 * memory.per_row("fp32"))  # three texts fit beside the model as held
    cpu = hardware.CPU(name="CPU", bf16_native=True, available=1024**3 + room, resident=2**29)
    sizes = []
    ai.model.transformer.wte.register_forward_hook(lambda module, args, out: sizes.append(out.shape[0]))
    with hardware.presenting(hardware.Hardware(cpu)):
        assert decoding.plan_decoding(ai.model, "exact", length=30).max_rows == 3
        texts = ai.generate(n=7, max_length=30, seed=1, return_as_list=True, nonempty_output=False,
                            decoding="exact")
        assert len(texts) == 7 and max(sizes) == 3
        sizes.clear()
        ai.generate_to_file(n=7, max_length=30, seed=1, destination_path=str(tmp_path / "t.txt"), decoding="exact")
        assert max(sizes) == 3


def test_a_first_call_nobody_can_repeat_decodes_as_held_until_the_view_pays(ai, caplog):
    """An unseeded sampled call, short: the model as held (the view costs what ~45 tokens do); a seeded or
    greedy call makes the view at once, so that its text is the same in every call; past view_after tokens,
    every call uses the view."""
    caplog.set_level("INFO", logger="lowmem_aitextgen")
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        ai.generate(max_length=10, return_as_list=True, nonempty_output=False)
        assert not ai._decoding._views and "Decoding as held until this object has asked for 45" in caplog.text
        assert ai._deferred is None  # read to decode as held
        seeded = ai.generate(max_length=20, seed=3, return_as_list=True)
        assert set(ai._decoding._views) == {"int8, each token alone"}  # a seeded text: the same in any batch
        assert ai.generate(max_length=20, seed=3, return_as_list=True) == seeded
        ai._decoding.forget()
        ai.generate(max_length=60, return_as_list=True, nonempty_output=False)  # asks more than a view costs
        assert set(ai._decoding._views) == {"int8"}


def test_the_tokenwise_int8_view_gives_a_text_the_same_logits_in_any_batch(ai):
    """The server's form: each token's activations quantized alone, so a row's logits in a batch are bit for bit
    its logits alone; torch's dynamic quantization (the batch's range), the unseeded view's on fbgemm's kernel, is
    not (on ours every view quantizes each token alone: views.int8_linear)."""
    torch.manual_seed(0)
    ids = torch.randint(0, ai.model.config.vocab_size, (4, 12))
    ids[3] = ids[3] % 7  # a row unlike the others
    ours = int8_kernels.product_kernel() is int8_kernels.NativeProduct
    for tokenwise, same in ((True, True), (False, ours)):
        view = decoding.decoding_model(ai.model, "int8", tokenwise).model
        with torch.no_grad():
            together = view(input_ids=ids).logits
            alone = torch.cat([view(input_ids=row[None]).logits for row in ids])
        assert torch.equal(together, alone) == same, tokenwise


@pytest.fixture(scope="module")
def prefix_study(study):
    """The study model with a prefix (8 virtual tokens) trained on it, the base frozen, and its held-out blocks."""
    from peft import PrefixTuningConfig, get_peft_model

    trained, _, held_out = study
    model = get_peft_model(copy.deepcopy(trained), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8))
    data = topic_bytes()
    train = data[: len(data) // 56 * 56].view(-1, 56)[30:]  # 56 tokens: the 64 positions less the prefix's 8
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    torch.manual_seed(0)
    for _ in range(60):
        batch = train[torch.randint(len(train), (8,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval(), held_out[:, :56]


def decoder_loss(decoder, blocks: torch.Tensor) -> float:
    """Held-out loss of an engine.Decoder: its view of the base with the virtual tokens' keys and values first
    (engine.Prefix), positions after them, as the engine decodes."""
    from lowmem_aitextgen import _compat
    from lowmem_aitextgen.generation.engine import Prefix

    prefix = Prefix(decoder)
    losses = []
    with torch.no_grad():
        for block in blocks:
            mask = torch.ones(1, prefix.length + len(block), dtype=torch.long)
            positions = torch.arange(prefix.length, prefix.length + len(block))[None]
            out = decoder.model(input_ids=block[None], labels=block[None], attention_mask=mask, position_ids=positions,
                                **{_compat.cache_keyword(decoder.model): prefix.cache(1)})
            losses.append(out.loss)
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("form, tokenwise", [("int8", False), ("int8", True), ("bf16", False)])
def test_each_default_form_is_within_the_quality_bound_with_a_trained_prefix(form, tokenwise, prefix_study, study):
    model, held_out = prefix_study
    exact = held_out_loss(model, held_out)  # peft's own forward: the prefix as trained
    assert exact < held_out_loss(study[0], held_out) - 0.01  # the prefix learned something the form must keep
    assert abs(decoder_loss(decoding.decoding_model(model, "fp32"), held_out) - exact) < 1e-4  # the engine's way
    loss = decoder_loss(decoding.decoding_model(model, form, tokenwise), held_out)
    assert loss <= exact * (1 + decoding.QUALITY_BOUND), (form, loss, exact)


def test_int8_asked_of_a_family_without_a_measured_view_is_refused_naming_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"])):
        with pytest.raises(ValueError, match="decoding='int8': no int8 view is made of llama models"):
            decoding.plan_decoding(model, "int8")
        assert decoding.plan_decoding(model).form == "bf16"  # the next native form


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_held_in_16_bits_decodes_in_int8_on_each_cpu_kind_and_never_by_emulation(ai, dtype):
    """What a LoRA run leaves on a native-bf16 CPU (bf16), or to_fp16() on a card then a CPU (fp16): the fast form
    made from the 16-bit weights; where no fast form is native, fp32, never emulated 16-bit arithmetic, and from
    the first call (decoding as held would be the emulation)."""
    held = copy.deepcopy(ai.model).to(dtype)
    for cpu in hardware.CPUS.values():
        with hardware.presenting(hardware.Hardware(cpu)):
            plan = decoding.plan_decoding(held)
            assert plan.form == "int8", cpu
    bare = hardware.CPU(name="CPU", bf16_native=False, int8_kernels=False)
    with hardware.presenting(hardware.Hardware(bare)):
        plan = decoding.plan_decoding(held)
        assert plan.form == "fp32" and plan.view_after == 0 and "emulation" in plan.because
    view = decoding.decoding_model(held, "int8").model
    assert next(view.parameters()).dtype == torch.float32 and next(held.parameters()).dtype == dtype  # untouched
