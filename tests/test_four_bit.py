"""A 4-bit (NF4) frozen base for adapters: what it holds, how it computes, when the planner takes it, and
what a run on it saves."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
from transformers import GPT2LMHeadModel

from conftest import CtrlC, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import budget, four_bit, storage16
from lowmem_aitextgen.training.adapter_settings import AdapterSettings
from lowmem_aitextgen.training.budget import budgeted_bytes, fit_plan
from lowmem_aitextgen.training.counting import unique_tensor_bytes
from lowmem_aitextgen.training.estimate import estimate_plan
from lowmem_aitextgen.training.plan import PlannerInputs, TrainPlan
from lowmem_aitextgen.training.techniques import apply_memory_plan

CONFIG = tiny_gpt2_config(n_layer=2, n_positions=64, n_embd=128)
BLOCK = 64


@pytest.mark.parametrize("shape", [(64, 192), (128, 512), (1600, 1600), (1280, 5120)])
def test_the_bytes_counted_are_the_bytes_torchao_holds(shape):
    """GPT-2 1558M's 1600 x 1600 matrices hold 40,000 blocks of 64, no multiple of torchao's 256 scales a
    group: they take groups of 250."""
    weight = torch.randn(shape, dtype=torch.bfloat16)
    nf4 = to_nf4(weight, four_bit.BLOCK, four_bit.scaler_block(weight.numel()))
    held = sum(t.numel() * t.element_size() for t in (nf4.quantized_data, nf4.quantized_scalers,
                                                      nf4.quantization_factor, nf4.scaler_mean, nf4.nf4))
    assert four_bit.nf4_bytes(weight.numel()) == held
    assert held < 0.27 * weight.numel() * 2
    assert four_bit.scaler_block(1600 * 1600) == 250 and four_bit.scaler_block(100) is None


def quantized_and_dense(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model whose block matrices are NF4, and the same model holding their dequantized values as plain
    weights (the rest in `dtype` in both)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG).to(dtype)
    model.requires_grad_(False)
    four_bit.hold_base_in_four_bits(model)
    dense = copy.deepcopy(model)  # copies the forwards installed too; the dense one's are inert under fp32 math
    for module, original in zip(dense.modules(), model.modules()):
        weight = original._parameters.get("weight")
        if weight is not None and storage16.is_quantized(weight):
            module.weight = torch.nn.Parameter(storage16.dense(weight, dtype), requires_grad=False)
    return model, dense


@pytest.mark.edges
@pytest.mark.parametrize("compute", ["fp32", "bf16 autocast", "fp16 autocast"])
def test_a_4_bit_layer_computes_as_its_dequantized_weight_in_the_plans_dtype(compute):
    """fp32 math (a CPU without native bf16: the rest of the base in bf16, upcast), bf16 autocast (native bf16
    CPUs, Ampere GPUs), fp16 autocast (a T4): the 4-bit model's logits and input gradients are the plain
    model's with the dequantized weights."""
    dtype = {"bf16 autocast": torch.bfloat16, "fp16 autocast": torch.float16}.get(compute)
    model, dense = quantized_and_dense(dtype or torch.bfloat16)  # as the plans hold the rest of the base
    ids = torch.randint(1000, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (model, dense):
        if dtype is None:
            storage16.compute_in_fp32(m)
        # what the embedding layer gives the blocks: rows in the dtype the blocks compute in
        embeddings = dense.transformer.wte.weight[ids].to(dtype or torch.float32).requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = m(inputs_embeds=embeddings).logits.float()
        logits.square().mean().backward()
        results.append((logits, embeddings.grad))
    (logits, grad), (dense_logits, dense_grad) = results
    tolerance = 1e-5 if dtype is None else 2e-2
    torch.testing.assert_close(logits, dense_logits, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grad, dense_grad, rtol=tolerance, atol=tolerance * grad.abs().max().item())
    assert storage16.is_quantized(model.transformer.h[0].mlp.c_fc.weight)
    assert not storage16.is_quantized(model.lm_head.weight) and not storage16.is_quantized(model.transformer.wte.weight)


def adapter_plan(**fields) -> TrainPlan:
    return TrainPlan(n_layer=CONFIG.n_layer, adapter=AdapterSettings.lora(8, 16, 0.0, None), loss_chunk_tokens=None,
                     **fields)


def test_the_estimate_counts_the_4_bit_base_as_it_is_held():
    plan = adapter_plan(four_bit_base=True, upcast_bf16_weights=True)
    torch.manual_seed(0)
    model, _ = apply_memory_plan(GPT2LMHeadModel(CONFIG), plan)
    assert estimate_plan(CONFIG, plan, BLOCK).weights == unique_tensor_bytes(model.parameters())
    sixteen = estimate_plan(CONFIG, dataclasses.replace(plan, four_bit_base=False), BLOCK).weights
    matrices = 12 * CONFIG.n_embd**2 * CONFIG.n_layer
    assert sixteen - estimate_plan(CONFIG, plan, BLOCK).weights == 2 * matrices - sum(
        four_bit.nf4_bytes(m.weight.numel())
        for m in four_bit.quantizable_layers(GPT2LMHeadModel(CONFIG).requires_grad_(False)))


@pytest.fixture
def without_native_bf16():
    """On a CPU computing bf16 natively the tiers above hold this tiny model's activations in bf16, smaller than
    the fp32 math of a 4-bit base saves on its few weights: there the 4-bit tier never fits where they do not."""
    from lowmem_aitextgen import hardware

    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):
        yield


def test_the_planner_takes_the_4_bit_base_exactly_where_the_tiers_above_stop_fitting(without_native_bf16):
    plan = adapter_plan()
    above = []
    for name, plans in budget.tiers(plan, CONFIG, PlannerInputs()):
        if name == budget.FOUR_BIT_TIER:
            break
        above += plans
    sixteen = min(budgeted_bytes(p, estimate_plan(CONFIG, p, BLOCK)) for p in above)
    chosen, _ = fit_plan(CONFIG, plan, BLOCK, sixteen)
    assert not chosen.four_bit_base
    chosen, _ = fit_plan(CONFIG, plan, BLOCK, sixteen - 1)
    assert chosen.four_bit_base and "4-bit base" in chosen.chosen_because and "NF4" in chosen.describe(1, 1, 0)
    pinned = dataclasses.replace(plan, fixed=frozenset({"base_bits"}))
    with pytest.raises(MemoryError):
        fit_plan(CONFIG, pinned, BLOCK, sixteen - 1)
    asked, _ = fit_plan(CONFIG, dataclasses.replace(plan, four_bit_base=True, upcast_bf16_weights=True,
                                                     fixed=frozenset({"base_bits"})), BLOCK, 2**40)
    assert asked.four_bit_base  # base_bits=4 given: kept however much memory there is


def test_base_bits_is_refused_before_any_work_where_nothing_would_hold_it(tmp_path, small_data, tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^base_bits=4 holds the frozen base of an adapter.*add lora=True"):
        ai.train(small_data, output_dir=str(out), num_steps=1, base_bits=4)
    with pytest.raises(ValueError, match=r"base_bits.*8.*must be one of 4"):
        ai.train(small_data, output_dir=str(out), num_steps=1, lora=True, base_bits=8)
    assert not out.exists()


def test_a_4_bit_base_with_sharding_is_refused_at_the_argument(tmp_path, small_data, tokenizer_file):
    """A 4-bit base is held whole in one process: with strategy="fsdp" over two processes the call is refused
    before any work, naming base_bits, the strategy and the fix (it was TrainPlan's internal invariant)."""
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^base_bits=4 cannot be used with strategy='fsdp'.*strategy='ddp'") as error:
        ai.train(small_data, output_dir=str(out), num_steps=1, lora=True, base_bits=4, strategy="fsdp", n_gpu=0,
                 devices=2)
    assert len(str(error.value)) < 300 and not out.exists()


WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # as if it were not installed: every import of it fails
from lowmem_aitextgen import cli
cli.main(sys.argv[1:])
"""


def test_without_torchao_a_4_bit_run_names_the_install_line_before_any_work(tmp_path, small_data, tokenizer_file):
    """base_bits=4 without torchao: one line naming base_bits and the install line, exit status 2, nothing written
    (it was reworded as a damaged model, after a traceback)."""
    base = str(tmp_path / "base")
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(base)
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCHAO, "train", small_data, f"--model_folder={base}",
                             f"--tokenizer_file={tokenizer_file}", "--lora", "--base_bits=4", "--num_steps=1",
                             f"--output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "base_bits=4" in last and "pip install" in last and "damaged" not in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


RELOADED = """
import json, sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from lowmem_aitextgen import aitextgen
tokenizer_file, original, corpus, results = sys.argv[1], sys.argv[2], sys.argv[3], {}

def loss(model, ids):
    with torch.no_grad():
        return float(model.eval()(input_ids=ids, labels=ids).loss)

for out, adapter in zip(sys.argv[4::2], sys.argv[5::2]):
    ai = aitextgen(model_folder=out, tokenizer_file=tokenizer_file)
    text = ai.generate_one(max_length=12, seed=1)
    # the adapter folder alone: its record names the base it applies to (the original, for LoRA), checked
    aitextgen(model_folder=f"{out}/{adapter}", tokenizer_file=tokenizer_file).generate_one(max_length=4)
    ids = ai.tokenizer(open(corpus, encoding="utf-8").read()[:4000], return_tensors="pt").input_ids[:, :32]
    fell = loss(ai.model, ids) < loss(AutoModelForCausalLM.from_pretrained(original), ids) - 0.05
    on_original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(original), f"{out}/{adapter}")
    on_original = on_original.merge_and_unload() if adapter == "lora_adapter" else on_original.get_base_model()
    saved, theirs = load_file(f"{out}/model.safetensors"), on_original.state_dict()
    names = [n for n in saved if n.endswith(("attn.weight", "proj.weight", "fc.weight"))]
    error = sum(float((saved[n].float() - theirs[n].float()).square().sum()) for n in names)
    norm = sum(float(AutoModelForCausalLM.from_pretrained(original).state_dict()[n].square().sum()) for n in names)
    results[out] = {"generated": isinstance(text, str) and len(text) > 0, "loss fell": fell,
                    "distance": (error / norm) ** 0.5}
print(json.dumps(results))
"""


def test_adapters_on_a_4_bit_base_train_save_reload_and_resume(tmp_path, corpus_file, tokenizer_file):
    """LoRA and prefix tuning on a 4-bit base: in a new process the saved model generates, its loss is below
    the base's, and it is the adapter on the original (unquantized) base but for the base's rounding, which
    the summary reports; a run interrupted and resumed ends bit-equal to the one that was not."""
    base = str(tmp_path / "base")
    GPT2LMHeadModel(tiny_gpt2_config(n_positions=64)).save_pretrained(base)
    runs = {"lora": ({"lora": True}, "lora_adapter"), "prefix": ({"adapter": "prefix"}, "adapter")}
    summaries = {}
    for name, (kwargs, _) in runs.items():
        aitextgen(model_folder=base, tokenizer_file=tokenizer_file).train(
            corpus_file, output_dir=str(tmp_path / name), num_steps=30, block_size=32, learning_rate=1e-2, seed=1,
            base_bits=4, save_every=0, generate_every=0, **kwargs)
        summaries[name] = json.loads((tmp_path / name / "training_summary.json").read_text())
    result = subprocess.run([sys.executable, "-c", RELOADED, tokenizer_file, base, corpus_file,
                             *(x for name, (_, adapter) in runs.items() for x in (str(tmp_path / name), adapter))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, reloaded in json.loads(result.stdout.splitlines()[-1]).items():
        reported = summaries[os.path.basename(name)]["plan"]["four_bit_base"]["relative_distance"]
        assert reloaded["generated"] and reloaded["loss fell"] and 0.01 < reported < 0.2
        # exactly the base's rounding, but for the merged model's own rounding to the 16 bits it is saved in
        assert reloaded["distance"] == pytest.approx(reported, rel=1e-2)
    for callbacks, resume in (([CtrlC(at_step=2)], False), ([], True)):
        aitextgen(model_folder=base, tokenizer_file=tokenizer_file).train(
            corpus_file, output_dir=str(tmp_path / "resumed"), num_steps=30, block_size=32, learning_rate=1e-2,
            seed=1, base_bits=4, save_every=0, generate_every=0, lora=True, callbacks=callbacks, resume=resume)
    for file in ("model.safetensors", "lora_adapter/adapter_model.safetensors"):
        assert (tmp_path / "resumed" / file).read_bytes() == (tmp_path / "lora" / file).read_bytes(), file


@pytest.mark.parametrize("cpu", ["native bf16", "no native bf16"])
@pytest.mark.parametrize("adapter", ["prefix", "prompt"])
def test_prompt_learning_on_a_4_bit_base_samples_while_training_and_generates_past_the_context(
        adapter, cpu, tmp_path, corpus_file, tokenizer_file, capsys):
    """Samples at generate_every on a 4-bit base, on a CPU presented with and without native bf16: without it
    the base is stored in bf16 and computed in fp32, and the virtual tokens' cache took the embeddings' bf16
    beside fp32 queries (the run stopped at its first samples, nothing saved).  After it, a prompt longer than
    the cache's room and a text past the context."""
    from peft import PromptTuningConfig

    from lowmem_aitextgen import hardware

    base = str(tmp_path / "base")
    GPT2LMHeadModel(tiny_gpt2_config(n_positions=128)).save_pretrained(base)
    kwargs = {"adapter": "prefix"} if adapter == "prefix" else {"peft_config": PromptTuningConfig(num_virtual_tokens=4)}
    ai = aitextgen(model_folder=base, tokenizer_file=tokenizer_file)
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        ai.train(corpus_file, output_dir=str(tmp_path / "out"), num_steps=2, block_size=32, seed=1, base_bits=4,
                 save_every=0, generate_every=1, **kwargs)
        assert capsys.readouterr().out.count("generating sample texts") == 1  # at step 1 (step 2 is the end)
        long_prompt = " ".join(["for"] * 80)
        assert len(ai.tokenizer(long_prompt)["input_ids"]) > 64
        for prompt, length in ((long_prompt, 100), ("The", 300)):
            text = ai.generate_one(prompt=prompt, max_length=length, min_length=length, seed=1)
            assert text.startswith(prompt) and len(ai.tokenizer(text)["input_ids"]) >= length - 2
    assert (tmp_path / "out" / "adapter").is_dir()


@pytest.mark.edges
def test_a_saved_base_read_straight_into_4_bits_is_the_base_read_then_quantized(tmp_path):
    """loading.DeferredModel.load_in_four_bits quantizes each matrix as it is read (the 16-bit base never whole
    in memory): the same 4-bit weights, the same rounding, and the fingerprint of the base as read in 16 bits,
    which the adapter's record names."""
    from lowmem_aitextgen.loading import DeferredModel
    from lowmem_aitextgen.training.adapters import base_fingerprint

    GPT2LMHeadModel(CONFIG).save_pretrained(tmp_path / "base")
    deferred = DeferredModel(str(tmp_path / "base"), "test")
    streamed, quantized = deferred.load_in_four_bits(torch.bfloat16)
    read = deferred.load(torch.bfloat16)
    record = base_fingerprint(read)
    read.requires_grad_(False)
    rounding = four_bit.hold_base_in_four_bits(read)
    assert quantized.fingerprint.record() == record
    assert (quantized.rounding.squared_error, quantized.rounding.weights) == (rounding.squared_error, rounding.weights)
    pairs = list(zip(streamed.state_dict().items(), read.state_dict().items(), strict=True))
    assert sum(storage16.is_quantized(a) for (_, a), _ in pairs) == 4 * CONFIG.n_layer
    for (name, a), (_, b) in pairs:
        assert torch.equal(storage16.dense(a, torch.float32), storage16.dense(b, torch.float32)), name


def test_base_bits_with_lora_auto_holds_the_lora_the_planner_may_choose_on_a_4_bit_base():
    from lowmem_aitextgen.cards import planned

    full, _ = planned("124M", None, "auto", cpu="no native bf16", base_bits=4, max_memory="2.5GB")
    assert not full.trains_adapter and not full.four_bit_base  # no LoRA chosen: nothing to hold in 4 bits
    lora, _ = planned("124M", None, "auto", cpu="no native bf16", base_bits=4, max_memory="1.6GB")
    assert lora.trains_lora and lora.four_bit_base


def test_the_object_after_a_4_bit_run_never_becomes_another_runs_model(tmp_path, corpus_file, tokenizer_file,
                                                                        monkeypatch):
    """After a run on a 4-bit base the object reads its model back from output_dir on first use: it does so
    after the working folder changed, and refuses, naming the folder, where another run has saved there since
    or the folder is gone, instead of becoming that run's model or calling a good one damaged."""
    base = str(tmp_path / "base")
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(base)

    def four_bit_run(output_dir: str) -> aitextgen:
        ai = aitextgen(model_folder=base, tokenizer_file=tokenizer_file)
        ai.train(corpus_file, output_dir=output_dir, num_steps=2, block_size=32, base_bits=4, lora=True,
                 save_every=0, generate_every=0, seed=1)
        return ai

    monkeypatch.chdir(tmp_path)
    kept = four_bit_run("kept")
    monkeypatch.chdir(tmp_path / "kept")  # a notebook that changes directory
    assert kept.generate_one(max_length=8, seed=1) == aitextgen(model_folder=str(tmp_path / "kept"),
                                                                tokenizer_file=tokenizer_file).generate_one(
        max_length=8, seed=1)
    monkeypatch.chdir(tmp_path)
    overwritten = four_bit_run("out")
    aitextgen(model_folder=base, tokenizer_file=tokenizer_file).train(  # a second cell saves into the same folder
        corpus_file, output_dir="out", num_steps=2, block_size=32, save_every=0, generate_every=0, seed=2)
    with pytest.raises(ValueError, match=f"{tmp_path / 'out'}.*has written there since"):
        overwritten.model
    moved = four_bit_run("moved")
    os.rename("moved", "elsewhere")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'moved'}.*is gone"):
        moved.model
