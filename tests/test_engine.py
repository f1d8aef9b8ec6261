"""Generated tokens against the truth: a plain loop over the trained model's own forward (no cache; peft's
PeftModel forward for prompt learning), for every kind of model train() leaves (full, LoRA, IA3, prefix,
prompt tuning, LoRA on a 4-bit base), GPT-2 and GPT-Neo, held in fp32 or 16 bits, in the object after
train() and read from its folder, in each decoding form this CPU runs: token for token with
decoding="exact"; in a fast form, equal wherever the truth's top two scores are further apart than the
form's measured error (forms.Form.score_error).  Tiny models trained a few steps, on the CPU."""

import copy
import threading
from unittest import mock

import pytest
import torch
from peft import IA3Config, PromptTuningConfig
from transformers import GPT2LMHeadModel, GPTNeoConfig, GPTNeoForCausalLM

from conftest import corpus_text, realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.generation import decoding, int8_kernels, kv_cache, stepping
from lowmem_aitextgen.generation.engine import Decoder, Engine, as_decoder
from lowmem_aitextgen.generation.forms import FORM_RECORDS
from lowmem_aitextgen.generation.generation import prompt_ids
from lowmem_aitextgen.generation.int8_kernels import FbgemmProduct, NativeProduct, OneDNNProduct
from lowmem_aitextgen.generation.sampling import Row, RowSettings
from lowmem_aitextgen.native import native_attention, native_block
from lowmem_aitextgen.training import storage16

pytestmark = pytest.mark.edges  # transformers' cache and forward arguments, peft's virtual tokens

PROMPT, NEW = "The for statement", 12
LEARNING_RATE = {"prefix": 3e-1, "prompt": 5e-1, "lora": 5e-2, "ia3": 1e-1, "lora, 4-bit base": 5e-2}
KINDS = {
    "full": dict(),
    "lora": dict(lora=True),
    "ia3": dict(peft_config=IA3Config(target_modules=["c_attn", "c_fc"], feedforward_modules=["c_fc"])),
    "prefix": dict(adapter="prefix"),
    "prompt": dict(peft_config=PromptTuningConfig(num_virtual_tokens=6)),
    "lora, 4-bit base": dict(lora=True, base_bits=4),
    "gpt-neo": dict(),
}


def tiny_neo() -> GPTNeoForCausalLM:
    config = GPTNeoConfig(vocab_size=1000, max_position_embeddings=96, hidden_size=64, num_layers=2, num_heads=4,
                          attention_types=[[["global", "local"], 1]], window_size=16, bos_token_id=0, eos_token_id=0)
    return GPTNeoForCausalLM(config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_file):
    """Each kind trained a few steps: (the object after train(), its output folder)."""
    root = tmp_path_factory.mktemp("kinds")
    text = root / "text.txt"
    text.write_text(corpus_text(20_000), encoding="utf-8")
    made = {}
    for kind, options in KINDS.items():
        torch.manual_seed(0)
        # prompt learning's context past the cache's room (kv_cache.ROOM) once its virtual tokens are in
        positions = 160 if kind in ("prefix", "prompt") else 96
        base = tiny_neo() if kind == "gpt-neo" else realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=positions)))
        base.save_pretrained(root / f"base-{kind}")
        ai = aitextgen(model_folder=str(root / f"base-{kind}"), tokenizer_file=tokenizer_file)
        out = str(root / f"out-{kind}")
        ai.train(str(text), output_dir=out, num_steps=20, batch_size=4, learning_rate=LEARNING_RATE.get(kind, 1e-2),
                 save_every=0, generate_every=0, seed=1, block_size=32, **options)
        made[kind] = (ai, out)
    return made


def truth_loop(model: torch.nn.Module, ids: torch.Tensor, new: int, eos: int) -> tuple[list[int], list]:
    """Greedy tokens by the model's own forward over the whole text each step (no cache), each step's scores;
    up to end-of-text."""
    tokens, scores = [], []
    with torch.no_grad():
        while len(tokens) < new and (not tokens or tokens[-1] != eos):
            full = torch.cat((ids, torch.tensor(tokens, dtype=ids.dtype)))[None]
            logits = model(input_ids=full, attention_mask=torch.ones_like(full)).logits[0, -1].float()
            scores.append(logits)
            tokens.append(int(logits.argmax()))
    return tokens, scores


def sure_steps(scores: list[torch.Tensor], error: float) -> int:
    """The steps before the first whose truth's top two scores are within `error` (a form may pick either)."""
    for step, score in enumerate(scores):
        top2 = score.topk(2).values
        if error and float(top2[0] - top2[1]) <= error:
            return step
    return len(scores)


def forms() -> list[str]:
    return ["exact", "int8"] + (["bf16"] if hardware.cpu().bf16_native else [])


@pytest.mark.parametrize("where", ["after train()", "from its folder"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tokens_are_the_trained_models_own_forward_in_every_form(trained, tokenizer_file, kind, where):
    ai, out = trained[kind]
    if where == "from its folder":
        ai = aitextgen(model_folder=out, tokenizer_file=tokenizer_file)
    truth_model = ai.model.eval()
    ids = prompt_ids(truth_model, ai.tokenizer, PROMPT, None)
    truth, scores = truth_loop(truth_model, ids, NEW, ai.tokenizer.eos_token_id)
    if kind in ("prefix", "prompt"):  # the virtual tokens steer it: decoding the base alone would fail below
        base_scores = truth_loop(truth_model.get_base_model(), ids, 1, -1)[1][0]
        largest = max(record.score_error for record in FORM_RECORDS.values())
        assert float((base_scores - scores[0]).abs().max()) > 3 * largest
    for form in forms():
        assert_decodes_the_truth(ai, truth_model, ids, (truth, scores), form, (kind, where))


def assert_decodes_the_truth(ai, truth_model, ids: torch.Tensor, truth_and_scores: tuple[list[int], list], form: str,
                             label: tuple) -> None:
    """In `form`, the engine's first scores (of both int8 views: seeded calls' and unseeded ones') within the form's
    error of the truth's, and generate()'s greedy text the truth's wherever its top two are further apart."""
    truth, scores = truth_and_scores
    error = 0.0 if form == "exact" else FORM_RECORDS[form].score_error
    for tokenwise in (True, False) if form == "int8" else (False,):  # seeded calls' view, and unseeded ones'
        for cpu in hardware.CPUS if form == "int8" else [None]:  # int8's cache in bf16 and in fp32
            view = truth_model if form == "exact" else made_on(cpu, truth_model, form, tokenwise)
            first = first_scores(view, ai, ids)
            assert float((first - scores[0]).abs().max()) <= max(error, 1e-4), (*label, form, tokenwise, cpu)
    text = ai.generate(prompt=PROMPT, max_new_tokens=NEW, do_sample=False, decoding=form, return_as_list=True,
                       nonempty_output=False, skip_special_tokens=False, lstrip=False)[0]
    sure = sure_steps(scores, error)
    expected = ai.tokenizer.decode(ids.tolist() + truth[:sure])
    assert text.startswith(expected), (*label, form, sure, text, expected)
    if sure == len(truth):
        assert text == ai.tokenizer.decode(ids.tolist() + truth), (*label, form)


KERNELS = {"oneDNN": OneDNNProduct, "fbgemm": FbgemmProduct, "ours": NativeProduct}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["full", "prefix", "gpt-neo"])
def test_on_each_int8_kernel_greedy_tokens_are_the_trained_models_own_forward(trained, tokenizer_file, kind, kernel,
                                                                               monkeypatch):
    """Each kernel int8 may compute on (int8_kernels.product_kernel: ours on its CPU's path, fbgemm's where ours is
    not built, oneDNN's where torch lacks torch.ao's fbgemm ops), the view read from its folder (a new object, so
    that no view made on another kernel is reused), against the truth."""
    monkeypatch.setattr(int8_kernels, "product_kernel", lambda: KERNELS[kernel])
    ai = aitextgen(model_folder=trained[kind][1], tokenizer_file=tokenizer_file)
    truth_model = ai.model.eval()
    ids = prompt_ids(truth_model, ai.tokenizer, PROMPT, None)
    view = decoding.decoding_model(truth_model, "int8", True).model
    products = [m.product for m in view.modules() if isinstance(m, int8_kernels.TokenwiseInt8Linear)]
    assert products and all(isinstance(p, KERNELS[kernel]) for p in products)
    assert_decodes_the_truth(ai, truth_model, ids, truth_loop(truth_model, ids, NEW, ai.tokenizer.eos_token_id),
                             "int8", (kind, kernel))


@pytest.mark.parametrize("kind", ["full", "gpt-neo"])
def test_on_our_kernel_a_step_computes_the_mlps_gelu_in_c_fcs_call_unless_a_hook_must_see_c_fcs_output(trained,
                                                                                                       kind):
    """int8_kernels.then_tanh_gelu in the stepping decoder (GPT-2's gelu_new, GPT-Neo's): c_fc's call gives the
    GELU of its output (the truth tests above hold its tokens to the trained model's forward); a hook on c_fc
    sees c_fc's own output, so there the GELU stays a call of its own, and on fbgemm's kernel too."""
    ai, _ = trained[kind]
    with mock.patch.object(int8_kernels, "product_kernel", lambda: NativeProduct):
        view = decoding.decoding_model(ai.model.eval(), "int8", True).model
    assert [layer.act for layer in stepping.Step(view).layers] == [stepping._as_is] * len(view.transformer.h)
    seen = []
    view.transformer.h[1].mlp.c_fc.register_forward_hook(lambda module, args, out: seen.append(out))
    step = stepping.Step(view)
    assert step.layers[0].act is stepping._as_is and step.layers[1].act is stepping._tanh_gelu
    step(torch.tensor([[5]]), torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.long), kv_cache.new_cache([], None))
    assert len(seen) == 1 and float(seen[0].min()) < -0.5  # c_fc's output, not its GELU (which stays above -0.17)
    with mock.patch.object(int8_kernels, "product_kernel", lambda: FbgemmProduct):
        view = decoding.decoding_model(ai.model.eval(), "int8", True).model
    assert all(layer.act is stepping._tanh_gelu for layer in stepping.Step(view).layers)


@pytest.fixture(params=["ours", "torch's"])
def attention(request, monkeypatch) -> str:
    """The stepping decoder's one-token attention: our kernel (native_attention.py) where it runs here, or torch's
    (row_attention.py for the rows attending alone), as on a CPU without AVX512F."""
    if request.param == "ours" and not native_attention.available():
        pytest.skip("our attention kernel needs AVX512F and gcc: torch's is this machine's")
    if request.param == "torch's":
        monkeypatch.setattr(native_attention, "available", lambda: False)
    return request.param


def made_on(cpu: str | None, model, form: str = "int8", tokenwise: bool = True) -> Decoder:
    """decoding_model's view as it makes it on a CPU of kind `cpu` (hardware.CPUS; None: this one): an int8 view's
    cache in bf16 where that CPU computes bf16 natively, else in its activations' fp32."""
    if cpu is None:
        return decoding.decoding_model(model, form, tokenwise)
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        view = decoding.decoding_model(model, form, tokenwise)
    native = hardware.CPUS[cpu].bf16_native and form == "int8"
    assert view.cache_dtype == (torch.bfloat16 if native else None)
    return view


def first_scores(view, ai, ids: torch.Tensor) -> torch.Tensor:
    """The scores the engine picks a first token from, decoding `view` (decoding.decoding_model's)."""
    engine = Engine(view, ai.tokenizer, (ai.tokenizer.eos_token_id,))
    engine.join([Row(ids, RowSettings(max_new=1, temperature=0))])
    scores = engine.scores[0]
    engine.close()
    return scores


@pytest.mark.parametrize("kind", ["full", "prefix", "prompt", "gpt-neo"])
def test_past_the_context_each_window_is_the_trained_models_own_forward(trained, kind):
    """max_length past the context: the window slides (engine.window_kept), and each token is still the trained
    model's own forward over the window it sees (the prefix's virtual tokens before every window)."""
    from lowmem_aitextgen.generation.decoding import context_length
    from lowmem_aitextgen.generation.engine import window_kept

    ai, _ = trained[kind]
    model = ai.model.eval()
    context = context_length(model)
    window = prompt_ids(model, ai.tokenizer, PROMPT, None).tolist()
    ids, truth, gaps = list(window), [], []
    with torch.no_grad():
        while len(truth) < context + 30:
            logits = model(input_ids=torch.tensor([window])).logits[0, -1].float()
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(logits.argmax())
            truth.append(token)
            window = (window + [token])[-window_kept(context):] if len(window) >= context else window + [token]
    collect = []

    class Collect:
        def put(self, value):
            collect.extend(value.reshape(-1).tolist())

        def end(self):
            pass

    ai.generate(prompt=PROMPT, max_new_tokens=len(truth), do_sample=False, decoding="exact", streamer=Collect(),
                eos_token_id=-1, nonempty_output=False)
    made = collect[len(ids):]
    tolerance = 0.0 if next(model.parameters()).dtype == torch.float32 else 0.02  # 16 bits: a cache rounds
    sure = next((i for i, gap in enumerate(gaps) if gap <= tolerance), len(gaps))
    assert sure > context  # the comparison reaches past the context
    assert made[:sure] == truth[:sure]


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
def test_prompt_learning_takes_every_prompt_its_context_allows_in_every_form_and_cache(trained, kind):
    """Prompts of 1, 63, 64, 65 tokens and up to the context less the virtual tokens (a prompt written after the
    virtual tokens' cache went past its room, kv_cache.ROOM places: it crashed past 64), alone and beside each
    other, in each form this CPU runs, an int8 view's cache in bf16 and in fp32: each row's greedy tokens are the
    trained model's own forward (peft's, the virtual tokens before the text): token for token in the exact form, in
    a fast one up to the first step whose truth's top two are within the form's error."""
    from lowmem_aitextgen.generation.decoding import context_length

    ai, _ = trained[kind]
    model = ai.model.eval()
    context = context_length(model)
    assert context - 1 > kv_cache.ROOM + 1
    prompts = [torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(n))
               for n in (1, 63, 64, 65, context - 8, context - 1)]
    truths = [truth_loop(model, ids, min(6, context - len(ids)), -1) for ids in prompts]
    for form in forms():
        error = 0.0 if form == "exact" else FORM_RECORDS[form].score_error
        for cpu in hardware.CPUS if form == "int8" else [None]:
            view = model if form == "exact" else made_on(cpu, model, form)
            alone = [decoded(view, ai, [ids], len(truth))[0] for ids, (truth, _) in zip(prompts, truths)]
            together = decoded(view, ai, prompts, max(len(truth) for truth, _ in truths))
            for made in (alone, together):
                for ids, (truth, scores), tokens in zip(prompts, truths, made):
                    sure = sure_steps(scores, error)
                    assert tokens[:sure] == truth[:sure], (kind, form, cpu, len(ids))
    text = ai.tokenizer.decode(ai.tokenizer(corpus_text(3000))["input_ids"][:100])  # streamed: the same text
    assert len(ai.tokenizer(text)["input_ids"]) > kv_cache.ROOM
    assert "".join(ai.generate(prompt=text, max_new_tokens=12, seed=2, stream=True)) == ai.generate_one(
        prompt=text, max_new_tokens=12, seed=2)


def decoded(view, ai, prompts: list[torch.Tensor], new: int) -> list[list[int]]:
    """Each prompt's greedy tokens (at most `new`, within the context), the prompts decoding together."""
    from lowmem_aitextgen.generation.decoding import context_length

    context = context_length(ai.model)
    rows = [Row(ids, RowSettings(max_new=min(new, context - len(ids)), temperature=0)) for ids in prompts]
    engine = Engine(view, ai.tokenizer, (-1,))
    engine.join(rows)
    engine.run()
    return [row.tokens for row in rows]


@pytest.mark.parametrize("form, how", [("exact", "join"), ("int8, each token alone", "join"),
                                       ("int8, each token alone", "admit"), ("int8, each token alone, prefix", "admit")])
def test_a_row_joining_a_running_batch_decodes_as_it_would_alone(trained, form, how):
    """Rows join between steps (join: their prompts encoded on their own, the caches put side by side; admit:
    their prompts computed within the running rows' next step) and leave when they end: each row's tokens are
    those it gets alone."""
    ai, _ = trained["prefix"] if "prefix" in form or form == "exact" else trained["full"]
    view = ai.model if form == "exact" else decoding.decoding_model(ai.model, "int8", True)
    assert (Engine(view, ai.tokenizer, (-1,)).stepper is None) == (form == "exact")

    def row(prompt: str, new: int) -> Row:
        return Row(prompt_ids(ai.model, ai.tokenizer, prompt, None), RowSettings(max_new=new, temperature=0.9, seed=3))

    def alone(prompt: str, new: int) -> list[int]:
        engine, made = Engine(view, ai.tokenizer, (-1,)), row(prompt, new)
        engine.join([made])
        engine.run()
        return made.tokens

    engine = Engine(view, ai.tokenizer, (-1,))
    first, second, third = row("The for statement", 20), row("x", 30), row("import os, sys and then some", 8)
    engine.join([first])
    for _ in range(5):
        engine.step()
    getattr(engine, how)([second, third])  # mid-run: longer and shorter prompts than the running row's window
    assert len(engine.joining) == (2 if how == "admit" else 0)
    while engine.held:
        engine.step()
    assert first.tokens == alone("The for statement", 20)
    assert second.tokens == alone("x", 30)
    assert third.tokens == alone("import os, sys and then some", 8)
    assert engine.cache is None  # every row left; the cache with them


class CancelledAtLook(threading.Event):
    """A row's cancel from another thread (batching.Job.cancel: its client left, its time ran out) landing just
    before the engine's `at`-th look at whether it was cancelled."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.looks = at, 0

    def is_set(self) -> bool:
        self.looks += 1
        if self.looks == self.at:
            self.set()
        return super().is_set()


def test_a_row_cancelled_at_any_moment_of_a_step_leaves_with_its_end_told(tokenizer_file):
    """Wherever within a step a cancel lands, the row leaves the engine through step()'s answer with its finish
    ("cancelled"): the server answers a request when its rows' finish is told, and a row that left without it
    kept its request, and the decoding thread, waiting for ever (a server spinning on a request long gone)."""
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    for alone in (True, False):  # the row alone (the engine empties), or beside one that goes on
        for at in range(1, 16):
            engine = Engine(ai.model.eval(), ai.tokenizer, (-1,))
            settings = RowSettings(max_new=40, min_new=40, temperature=0)
            cancelled, other = Row(torch.tensor([11, 22]), settings), Row(torch.tensor([33]), settings)
            cancelled.cancelled = CancelledAtLook(at)
            engine.join([cancelled] if alone else [cancelled, other])
            answered = []
            while cancelled in engine.rows:
                answered += engine.step()
            assert cancelled in answered and cancelled.finish == "cancelled", (alone, at)
            assert len(cancelled.tokens) < 40 and (alone or other in engine.rows)


class Recorded(Row):
    """A row that keeps the scores the engine gives it at each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[torch.Tensor] = []

    def took(self, token: int, tokenizer, eos: tuple[int, ...], scores: torch.Tensor | None = None) -> None:
        self.given.append(scores.clone())
        super().took(token, tokenizer, eos, scores)


@pytest.mark.parametrize("cpu", list(hardware.CPUS))
@pytest.mark.parametrize("kind", ["full", "prefix", "gpt-neo"])
def test_in_the_seeded_form_a_rows_scores_are_the_bits_it_gets_alone(trained, kind, cpu, attention):
    """The form of seeded texts (int8, each token alone): a row's scores at every step are bit for bit those it
    gets decoded alone, beside rows of other lengths (padded) and of its own length (row_attention.py: one call
    for them), joined and admitted mid-run, one row leaving, and one row that need not be the same (an unseeded
    request's: the batch's attention) beside them.  torch's attention kernel summed a row's places in another
    order beside padding, and (two threads) at one row than at several: a seeded text at 355M came out
    different in a list, and at this size some scores differed in their last bits.  Its cache in bf16 and in
    fp32 (as made on each CPU kind); on our attention kernel and on torch's."""
    ai, _ = trained[kind]
    view = made_on(cpu, ai.model)
    # (prompt, new tokens, seed): the first two of one length all along, the fourth unseeded
    cases = [("The for statement", 24, 1), ("The for statement", 24, 2), ("x", 30, 3),
             ("import os, sys and then some of it", 12, 4), ("def f(", 18, None),
             ("a b c d e f g h i j k l m n o p q r s t u v", 20, 5)]

    def row(prompt: str, new: int, seed: int | None) -> Recorded:
        return Recorded(prompt_ids(ai.model, ai.tokenizer, prompt, None),
                        RowSettings(max_new=new, temperature=0.9, seed=seed or 0, repeatable=seed is not None))

    def alone(case: tuple) -> list[torch.Tensor]:
        engine, made = Engine(view, ai.tokenizer, (-1,)), row(*case)
        engine.join([made])
        engine.run()
        return made.given

    engine = Engine(view, ai.tokenizer, (-1,))
    rows = [row(*case) for case in cases]
    engine.join(rows[:3])
    for _ in range(4):
        engine.step()
    engine.join([rows[3]])
    for _ in range(3):
        engine.step()
    engine.admit(rows[4:])
    engine.run()
    assert len(rows[4].given) == cases[4][1]
    for case, made in zip(cases, rows):
        if not made.settings.repeatable:
            continue
        expected = alone(case)
        assert len(made.given) == len(expected) == case[1]
        differing = [step for step, (a, b) in enumerate(zip(made.given, expected)) if not torch.equal(a, b)]
        assert not differing, (case, differing)


@pytest.mark.parametrize("cpu", list(hardware.CPUS))
def test_rows_joining_beside_a_prompt_scored_whole_get_their_bits_alone(trained, cpu):
    """A prompt scored whole (the server's echo with logprobs) is transformers' forward over a cache of its own;
    the running rows' cache stays in the engine's dtype (bf16 where the view's is), so the seeded rows joining a
    batch that a scored prompt started get each step's scores bit for bit as alone."""
    ai, _ = trained["full"]
    view = made_on(cpu, ai.model)

    def row(prompt: str, new: int, seed: int, score: bool = False) -> Recorded:
        return Recorded(prompt_ids(ai.model, ai.tokenizer, prompt, None),
                        RowSettings(max_new=new, temperature=0.9, seed=seed, logprobs=1 if score else None,
                                    score_prompt=score))

    def alone(case: tuple) -> list[torch.Tensor]:
        engine, made = Engine(view, ai.tokenizer, (-1,)), row(*case)
        engine.join([made])
        engine.run()
        return made.given

    engine, cases = Engine(view, ai.tokenizer, (-1,)), [("x", 12, 2), ("import os, sys", 10, 3)]
    scored_first, joining = row("The for statement", 16, 1, score=True), [row(*case) for case in cases]
    engine.join([scored_first])  # the batch's cache is first this row's
    assert scored_first.prompt_scored
    engine.step()
    engine.join(joining[:1])
    engine.step()
    engine.admit(joining[1:])
    engine.run()
    for case, made in zip(cases, joining):
        expected = alone(case)
        assert len(made.given) == len(expected) and all(torch.equal(a, b) for a, b in zip(made.given, expected))


@pytest.mark.parametrize("cache", [None, torch.bfloat16])
@pytest.mark.parametrize("how", ["join", "admit"])
@pytest.mark.parametrize("kind", ["full", "prefix", "gpt-neo"])
def test_the_stepping_decoder_scores_each_step_as_the_trained_models_own_forward(trained, kind, how, cache,
                                                                                  attention):
    """stepping.py's decoder, run on an fp32 copy marked a view (so that its arithmetic, not a form's rounding,
    is compared): each row's scores, from its prompt's and at each step, are the trained model's forward over the
    row's whole text (peft's for the prefix), in fp32, with rows of different lengths padded side by side, a row
    leaving and rows joining mid-run (one into the slot left; join: encoded between steps, admit: within the
    running rows' step), a prompt and steps past GPT-Neo's local window (16 places here).  Its cache in fp32, and
    in bf16 (an int8 view's where the CPU computes bf16 natively, decoding.cache_dtype): within a tenth of the
    int8 form's error; on our attention kernel and on torch's."""
    ai, _ = trained[kind]
    model = copy.deepcopy(ai.model).float().eval()  # a prefix's frozen base is held in bf16 where native
    held = as_decoder(model)
    engine = Engine(Decoder(copy.deepcopy(held.model), held.prompt_learning, view=True, cache_dtype=cache),
                    ai.tokenizer, (-1,))
    assert engine.stepper is not None
    long = "import os, sys and then some more words, so that this prompt is longer than the local window"
    rows = [Row(prompt_ids(model, ai.tokenizer, p, None), RowSettings(max_new=new, temperature=0))
            for p, new in (("The for statement", 24), ("x", 4), (long, 24), ("def f", 24))]
    assert len(rows[2].prompt) > 16
    engine.join(rows[:2])
    worst, running = 0.0, []
    with torch.no_grad():
        for step in range(20):
            if step in (3, 6):  # the long prompt beside the running rows; then one into the slot "x" left
                getattr(engine, how)(rows[2:3] if step == 3 else rows[3:])
                assert len(engine.joining) == (how == "admit")
            for row, scores in zip(engine.rows, engine.scores):
                whole = torch.cat((row.prompt, torch.tensor(row.tokens, dtype=row.prompt.dtype)))[None]
                truth = model(input_ids=whole, attention_mask=torch.ones_like(whole)).logits[0, -1].float()
                worst = max(worst, float((scores - truth).abs().max()))
            running.append(len(engine.rows))
            engine.step()
    engine.close()
    # "x" left after its 4 tokens; "def f" took its slot (admitted rows are there after the next step)
    assert running[:8] == ([2, 2, 2, 3, 2, 2, 3, 3] if how == "join" else [2, 2, 2, 2, 2, 2, 2, 3]), running
    assert worst <= (1e-4 if cache is None else FORM_RECORDS["int8"].score_error / 10), worst  # bf16: ~5e-4 here


def test_the_model_as_held_and_a_hooked_view_step_by_transformers_forward(trained):
    """decoding="exact" (the model itself) keeps transformers' forward, token for token its generate(); so does
    a view with a hook on a module the stepping decoder would bypass."""
    ai, _ = trained["full"]
    assert Engine(ai.model, ai.tokenizer, (-1,)).stepper is None
    view = copy.deepcopy(ai.model)
    assert Engine(Decoder(view, view=True), ai.tokenizer, (-1,)).stepper is not None
    view.transformer.h[0].attn.register_forward_hook(lambda *args: None)
    assert Engine(Decoder(view, view=True), ai.tokenizer, (-1,)).stepper is None


@pytest.mark.parametrize("where", ["the module", "every module"])
def test_a_hook_on_a_views_projection_runs_at_every_step_of_the_stepping_decoder(trained, where):
    """The stepping decoder calls an unhooked projection's forward straight (no hook lookup) but a hooked one,
    or every module where a global hook is registered, through the module: the hook sees each step's tokens."""
    ai, _ = trained["full"]
    view = decoding.decoding_model(ai.model, "int8", tokenwise=True).model
    projection = view.transformer.h[1].mlp.c_fc
    seen = []

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if module is projection:
            seen.append(args[0].shape[0])

    handle = (projection.register_forward_hook(hook) if where == "the module" else
              torch.nn.modules.module.register_module_forward_hook(hook))
    try:
        engine = Engine(Decoder(view, view=True), ai.tokenizer, (-1,))
        assert engine.stepper is not None
        prompt = prompt_ids(ai.model, ai.tokenizer, PROMPT, None)
        engine.join([Row(prompt, RowSettings(max_new=4, min_new=4, seed=1)) for _ in range(2)])
        engine.run()
    finally:
        handle.remove()
    assert seen == [2 * len(prompt), 2, 2, 2], seen  # the prompts' tokens, then each step's (the 4th token ends)


def test_the_stepping_decoder_calls_each_module_as_its_forward_computes_it(trained):
    """stepping.called binds a module's call once (an int8 projection's kernel and bias, a LayerNorm's aten op):
    each call gives its module's forward bit for bit, and names its module (module_of); a hooked module, and a
    LayerNorm given a forward of its own (storage16's fp32 math over bf16 weights), are called as themselves.  Where
    the blocks step in one call of our kernels (native_block.py), the blocks' norms are its own, to float precision
    of the module's."""
    ai, _ = trained["full"]
    view = decoding.decoding_model(ai.model, "int8", tokenwise=True).model
    step = stepping.Step(view)
    blocks = view.transformer.h
    torch.manual_seed(0)
    with torch.inference_mode():
        for layer, block in zip(step.layers, blocks):
            for call, module in ((layer.ln_1, block.ln_1), (layer.qkv[0], block.attn.c_attn),
                                 (layer.out, block.attn.c_proj), (layer.ln_2, block.ln_2),
                                 (layer.proj, block.mlp.c_proj)):
                x = torch.randn(3, module.in_features if hasattr(module, "in_features") else view.config.n_embd)
                assert stepping.module_of(call) is module and call is not module
                if step.native_blocks is not None and isinstance(module, torch.nn.LayerNorm):
                    assert torch.equal(call(x), native_block.norm(module)(x))
                    torch.testing.assert_close(call(x), module(x), rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(call(x), module(x)), module
        x = torch.randn(2, view.config.n_embd)
        assert torch.equal(step.final_norm(x), view.transformer.ln_f(x))
    norm = blocks[0].ln_1
    handle = norm.register_forward_hook(lambda *args: None)
    try:
        assert stepping.called(norm) is norm and stepping.module_of(norm) is norm
    finally:
        handle.remove()
    held = copy.deepcopy(ai.model).to(torch.bfloat16)
    storage16.compute_in_fp32(held)
    norm = held.transformer.h[0].ln_1
    assert stepping.called(norm) == norm.forward
    with torch.inference_mode():
        x = torch.randn(2, held.config.n_embd)
        assert stepping.called(norm)(x).dtype == torch.float32 and torch.equal(stepping.called(norm)(x), norm(x))


def test_a_long_text_is_not_copied_to_a_new_buffer_every_few_steps(tokenizer_file, monkeypatch):
    """The engine tells the cache what its rows may still add (their max_new): four rows of 300 tokens move each
    layer's keys and values to a new buffer once (when the prompt's room is used), not every ROOM steps; the
    tokens are those of the cache told nothing."""
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=400))
    model, tokenizer = ai.model.eval(), ai.tokenizer
    made = []

    def texts() -> list[list[int]]:
        engine = Engine(model, tokenizer, (-1,))
        rows = [Row(torch.tensor([11, 22, 33 + i]), RowSettings(max_new=300, min_new=300, temperature=0))
                for i in range(4)]
        engine.join(rows)
        buffers = set()
        while engine.rows:
            engine.step()
            if engine.cache is not None:
                buffers.add(engine.cache.layers[0].slots.both.data_ptr())
        made.append(len(buffers))
        return [row.tokens for row in rows]

    told = texts()
    monkeypatch.setattr(kv_cache.Slots, "expect", lambda self, places: None)
    untold = texts()
    assert told == untold
    assert made[0] <= 2 < 300 // kv_cache.ROOM <= made[1]
