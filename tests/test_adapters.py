"""peft adapters beyond lora=True: prefix tuning (adapter="prefix"), any peft config (peft_config=), each
trained, saved, reloaded, resumed, validated and estimated."""

import json
import os
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from peft import (
    AdaLoraConfig,
    FourierFTConfig,
    IA3Config,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptTuningConfig,
    VeraConfig,
)
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

from conftest import CtrlC, corpus_text, realistic, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import counting, estimate
from lowmem_aitextgen.training.chunked_loss import causal_lm_loss
from lowmem_aitextgen.training.evaluation import ValidationHistory, keep_best_in_memory
from lowmem_aitextgen.training.plan import AdapterSettings, TrainPlan

CONTEXT = 64
PREFIX_TOKENS = 20  # adapter="prefix"'s


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(corpus_text(6_000), encoding="utf-8")
    return str(path)


@pytest.fixture
def base64(tmp_path):
    """A tiny GPT-2 with a context of 64 positions (prefix tuning takes 20 of them), dropout off."""
    GPT2LMHeadModel(tiny_gpt2_config(n_positions=CONTEXT)).save_pretrained(tmp_path / "base64")
    return str(tmp_path / "base64")


@pytest.fixture
def realistic_base64(tmp_path):
    """base64 with biases and layer norms as a trained model has them: merges that forget a bias can fail."""
    realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=CONTEXT))).save_pretrained(tmp_path / "realistic")
    return str(tmp_path / "realistic")


def blocks(ai: aitextgen, path: str, length: int) -> torch.Tensor:
    ids = ai.tokenizer(open(path, encoding="utf-8").read())["input_ids"]
    n = len(ids) // length * length
    return torch.tensor(ids[:n]).view(-1, length)[:8]


def mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return causal_lm_loss(model.eval(), batch, None).item()


@pytest.mark.edges
def test_prefix_tuning_trains_saves_and_reloads_in_a_new_process(text, base64, tokenizer_file, tmp_path):
    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    base = {k: v.clone() for k, v in ai.model.state_dict().items()}
    seen = {}

    class Look(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["trainable"], _ = counting.trainable_parameters(pl_module.model)
            seen["base_dtype"] = pl_module.model.get_base_model().transformer.h[0].mlp.c_fc.weight.dtype
            seen["checkpointing"] = pl_module.plan.checkpointed_blocks

    out = str(tmp_path / "out")
    ai.train(text, adapter="prefix", output_dir=out, num_steps=30, batch_size=4, learning_rate=1e-1, save_every=0,
             generate_every=0, precision="bf16-mixed", seed=1, callbacks=[Look()])
    # keys and values for each of the 20 virtual tokens in each of the 2 blocks: all that trains
    assert seen["trainable"] == PREFIX_TOKENS * 2 * 2 * 64
    assert seen["base_dtype"] == torch.bfloat16  # the frozen base held in 16 bits
    assert seen["checkpointing"] == 0  # prefix tuning recomputes no block (adapters.py says why)
    assert isinstance(ai.model, PeftModel)  # a prefix is not a weight: it stays on its base

    batch = blocks(ai, text, CONTEXT - PREFIX_TOKENS)
    plain = GPT2LMHeadModel.from_pretrained(base64)
    # the prefix learned some of the text (a random base leaves it little to steer: 6.91 -> 6.81 here)
    assert mean_loss(ai.model, batch) < mean_loss(plain, batch) - 0.05

    names = set(os.listdir(out))  # the base at the top, the adapter in adapter/ (none at the top: transformers
    assert {"model.safetensors", "config.json"} <= names and "adapter_config.json" not in names  # would take it)
    assert {"adapter_config.json", "adapter_model.safetensors", "base_weights.json"} <= set(os.listdir(f"{out}/adapter"))
    saved_base = load_file(os.path.join(out, "model.safetensors"))
    for key, value in saved_base.items():  # the base unchanged but for its rounding to the 16 bits it was held in
        assert torch.equal(value, base[key].to(torch.bfloat16).float()), key

    # peft's own loader: the base from the folder plus the adapter beside it is the trained model
    rounded = GPT2LMHeadModel(tiny_gpt2_config(n_positions=CONTEXT))
    rounded.load_state_dict(saved_base, strict=False)
    rounded.tie_weights()
    with_adapter = PeftModel.from_pretrained(rounded, os.path.join(out, "adapter")).eval()
    torch.testing.assert_close(mean_loss(with_adapter, batch), mean_loss(ai.model, batch), rtol=1e-2, atol=1e-2)

    code = ("import json, sys; from lowmem_aitextgen import aitextgen; "
            "ai = aitextgen(model_folder=sys.argv[1], tokenizer_file=sys.argv[2]); ai.model.float(); "
            "print(json.dumps([type(ai.model).__name__, ai.generate(n=2, prompt='The', max_length=30, seed=9, "
            "return_as_list=True)]))")
    ai.model.float()  # the object's base is bf16; the new process reads the saved fp32 base
    texts = ai.generate(n=2, prompt="The", max_length=30, seed=9, return_as_list=True)
    result = subprocess.run([sys.executable, "-c", code, out, tokenizer_file], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    kind, reloaded_texts = json.loads(result.stdout.strip().splitlines()[-1])
    assert kind == "PeftModelForCausalLM" and reloaded_texts == texts and texts[0] != texts[1]


def test_prefix_tuning_resumes_to_the_uninterrupted_weights(small_data, tokenizer_file, tmp_path):
    GPT2LMHeadModel(tiny_gpt2_config(n_positions=CONTEXT)).save_pretrained(tmp_path / "base")
    config = PrefixTuningConfig(num_virtual_tokens=8)

    def run(output_dir, **kwargs):
        ai = aitextgen(model_folder=str(tmp_path / "base"), tokenizer_file=tokenizer_file)
        ai.train(small_data, output_dir=output_dir, num_steps=10, batch_size=2, gradient_accumulation_steps=2,
                 learning_rate=1e-2, warmup_steps=2, save_every=0, generate_every=0, seed=1, peft_config=config,
                 **kwargs)
        return ai

    def adapter_of(ai):
        return {k: v.clone() for k, v in ai.model.named_parameters() if "prompt_encoder" in k}

    uninterrupted = adapter_of(run("uninterrupted"))
    run("interrupted", callbacks=[CtrlC(at_step=4)])
    checkpoint = torch.load("interrupted/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5 and all("prompt_encoder" in k for k in checkpoint["state_dict"])
    with pytest.raises(ValueError, match="another adapter"):
        aitextgen(model_folder=str(tmp_path / "base"), tokenizer_file=tokenizer_file).train(
            small_data, output_dir="interrupted", num_steps=10, batch_size=2, gradient_accumulation_steps=2,
            resume=True)
    resumed = adapter_of(run("interrupted", resume=True))
    assert uninterrupted.keys() == resumed.keys() and uninterrupted
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.edges
def test_a_mergeable_peft_config_saves_the_merged_model_and_its_adapter(small_data, realistic_base64, tokenizer_file):
    ai = aitextgen(model_folder=realistic_base64, tokenizer_file=tokenizer_file)
    ai.train(small_data, peft_config=IA3Config(target_modules=["c_attn", "c_fc"], feedforward_modules=["c_fc"]),
             output_dir="out", num_steps=10, batch_size=2, learning_rate=5e-2, save_every=0, generate_every=0,
             precision="32-true", seed=1)
    assert type(ai.model) is GPT2LMHeadModel  # IA3 folds into the weights
    assert os.path.isfile("out/adapter/adapter_config.json") and os.path.isfile("out/adapter/base_weights.json")
    assert not os.path.exists("out/adapter_config.json")  # the folder's model is the merged one
    merged = aitextgen(model_folder="out", tokenizer_file=tokenizer_file)
    assert type(merged.model) is GPT2LMHeadModel
    for key, value in ai.model.state_dict().items():
        assert torch.equal(merged.model.state_dict()[key], value), key
    start = GPT2LMHeadModel.from_pretrained(realistic_base64)
    assert not torch.equal(start.transformer.h[0].mlp.c_fc.weight, ai.model.transformer.h[0].mlp.c_fc.weight)
    with_adapter = PeftModel.from_pretrained(start, "out/adapter").eval()
    batch = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(batch).logits, merged.model.eval()(batch).logits, rtol=1e-5,
                                   atol=1e-5)


def test_prompt_tuning_trains_with_checkpointing(text, base64, tokenizer_file):
    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    batch = blocks(ai, text, CONTEXT - 8)
    before = mean_loss(GPT2LMHeadModel.from_pretrained(base64), batch)
    ai.train(text, peft_config=PromptTuningConfig(num_virtual_tokens=8), gradient_checkpointing=True,
             output_dir="out", num_steps=30, batch_size=4, learning_rate=3e-1, save_every=0, generate_every=0,
             precision="32-true", seed=1)
    with open("out/training_summary.json", encoding="utf-8") as f:
        plan = json.load(f)["plan"]
    assert plan["gradient_checkpointing"] is True and plan["adapter"]["peft_type"] == "PROMPT_TUNING"
    assert mean_loss(ai.model, batch) < before - 0.015  # 8 virtual tokens before a random base: 6.906 -> 6.882
    reloaded = aitextgen(model_folder="out", tokenizer_file=tokenizer_file)
    ai.model.float()
    assert mean_loss(reloaded.model, batch) == pytest.approx(mean_loss(ai.model, batch), abs=1e-5)


def test_the_best_prefix_is_kept_with_validation(text, base64, tokenizer_file):
    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    ai.train(text, adapter="prefix", val_data=0.2, eval_every=5, output_dir="out", num_steps=10, batch_size=2,
             learning_rate=3e-2, save_every=0, generate_every=0, precision="32-true", seed=1)
    with open("out/training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert [e["step"] for e in summary["validation"]] == [5, 10] and summary["best_step"] in (5, 10)
    kept = {k: v.clone() for k, v in ai.model.named_parameters() if "prompt_encoder" in k}
    for parameter in ai.model.prompt_encoder.parameters():
        parameter.data.add_(1.0)
    history = ValidationHistory(best_step=5, best_loss=summary["best_val_loss"])
    keep_best_in_memory(ai.model, history, final_step=10, output_dir="out")  # reads the saved prefix back
    for key, value in ai.model.named_parameters():
        if "prompt_encoder" in key:
            assert torch.equal(value, kept[key]), key


@pytest.mark.parametrize("kwargs, message", [
    (dict(adapter="prompt"), "adapter='prompt'"),
    (dict(peft_config="prefix"), "must be a peft config"),
    (dict(peft_config=PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)), "task_type='SEQ_CLS'"),
    (dict(adapter="prefix", lora=True), "pass only one of them"),
    (dict(adapter="prefix", peft_config=IA3Config()), "pass only one of them"),
    (dict(adapter="prefix", gradient_checkpointing=True), "gradient_checkpointing=True cannot be used"),
    (dict(adapter="prefix", block_size=60), "less the 20 its adapter's virtual tokens take"),
])
def test_bad_adapter_arguments_are_refused_before_training(base64, tokenizer_file, text, kwargs, message):
    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    ai.save_for_upload("out")  # a finished model in output_dir: it must come through untouched
    before = snapshot("out")
    with pytest.raises(ValueError, match=message):
        ai.train(text, output_dir="out", num_steps=2, **kwargs)
    assert snapshot("out") == before


def test_a_loaded_prefix_keeps_training_and_refuses_a_second_adapter(text, base64, tokenizer_file):
    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    ai.train(text, peft_config=PrefixTuningConfig(num_virtual_tokens=4), output_dir="first", num_steps=4,
             save_every=0, generate_every=0, seed=1)
    loaded = aitextgen(model_folder="first", tokenizer_file=tokenizer_file)
    with pytest.raises(ValueError, match="already has a prefix tuning, 4 virtual tokens adapter"):
        loaded.train(text, adapter="prefix", output_dir="second", num_steps=2)
    before = {k: v.clone() for k, v in loaded.model.named_parameters() if "prompt_encoder" in k}
    loaded.train(text, output_dir="second", num_steps=4, save_every=0, generate_every=0, seed=2,
                 learning_rate=1e-2)
    after = dict(loaded.model.named_parameters())
    assert before and all(not torch.equal(after[k], v) for k, v in before.items())
    assert os.path.isfile("second/adapter/adapter_model.safetensors")


def test_the_estimate_counts_only_the_adapter_as_trained_and_its_virtual_tokens():
    config = tiny_gpt2_config(n_positions=CONTEXT, n_embd=128)
    prefix = AdapterSettings.of(PrefixTuningConfig(num_virtual_tokens=8))
    prompt = AdapterSettings.of(PromptTuningConfig(num_virtual_tokens=16))
    plans = {name: TrainPlan(adapter=settings) for name, settings in
             (("full", None), ("prefix", prefix), ("prompt", prompt))}
    found = {name: estimate.estimate_plan(config, plan, block_size=32) for name, plan in plans.items()}
    assert found["prefix"].gradients == 8 * 2 * 2 * 128 * 4  # fp32 keys and values of 8 tokens in 2 blocks
    assert found["prompt"].gradients == 16 * 128 * 4
    assert found["prefix"].weights == found["full"].weights + found["prefix"].gradients
    # prompt tuning's 16 virtual tokens run through every block with the text's 32: 48 positions, not 33
    one = estimate.estimate_plan(config, TrainPlan(adapter=AdapterSettings.of(PromptTuningConfig(num_virtual_tokens=1))),
                                 block_size=32)
    assert found["prompt"].activations > 1.3 * one.activations
    # and fewer positions are left for the text
    assert estimate.probe_lengths(config, prompt.positions_taken)[-1] == CONTEXT - 16


def test_estimate_memory_takes_the_short_form_and_a_peft_config_alike():
    short = estimate.estimate_memory("124M", block_size=64, adapter="prefix")
    config = estimate.estimate_memory("124M", block_size=64, adapter=PrefixTuningConfig(num_virtual_tokens=20))
    assert short.gradients == config.gradients == 20 * 2 * 12 * 768 * 4  # keys and values, 20 tokens, 12 blocks
    with pytest.raises(ValueError, match="adapter='prompt' is not one of 'prefix'"):
        estimate.estimate_memory("124M", adapter="prompt")


def test_a_peft_config_naming_layers_gpt2_lacks_is_refused_before_any_work(text, tokenizer_file, tmp_path):
    """LLaMA's names from a tutorial: refused naming the argument and GPT-2's own layers, before the data is
    encoded or output_dir is made (peft's own error named neither)."""
    from peft import LoraConfig

    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=CONTEXT))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^peft_config: this LoRA r=8 adapter does not fit this gpt2 model: target_mo"
                                         r"dules \['q_proj', 'v_proj'\] are not in this model.*'c_attn', 'c_fc', 'c_proj'"):
        ai.train(text, output_dir=str(out), num_steps=1, peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"^lora_target_modules: .*\['wq'\] are not in this model"):
        ai.train(text, output_dir=str(out), num_steps=1, lora="auto", lora_target_modules=["wq"])
    assert not out.exists()


@pytest.mark.parametrize("cpu", ["native bf16", "no native bf16"])
@pytest.mark.parametrize("kind", [{}, {"lora": True}, {"adapter": "prefix"}, {"peft_config": IA3Config()},
                                  {"lora": True, "base_bits": 4}, {"adapter": "prefix", "base_bits": 4}],
                         ids=["full", "lora", "prefix", "ia3", "lora on 4-bit base", "prefix on 4-bit base"])
def test_the_model_in_memory_after_train_is_the_model_on_disk(kind, cpu, text, base64, tokenizer_file, tmp_path):
    """The same text for a seed and the same logits from the object train() leaves as from output_dir
    reloaded, for every kind of run, where the CPU computes bf16 (the frozen base held in bf16 while
    training) and where it does not."""
    from lowmem_aitextgen import hardware

    ai = aitextgen(model_folder=base64, tokenizer_file=tokenizer_file)
    with hardware.presenting(hardware.Hardware(hardware.CPUS[cpu])):
        ai.train(text, output_dir=str(tmp_path / "out"), num_steps=2, save_every=0, generate_every=0,
                 learning_rate=1e-2, block_size=32, seed=1, **kind)
    reloaded = aitextgen(model_folder=str(tmp_path / "out"), tokenizer_file=tokenizer_file)
    ids = torch.randint(1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ai.model(input_ids=ids).logits, reloaded.model(input_ids=ids).logits)
    for seed in (3, 4):
        kwargs = dict(n=1, max_length=20, seed=seed, return_as_list=True)
        assert ai.generate(**kwargs) == reloaded.generate(**kwargs)


LOADERS = """
import json, os, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, pipeline
from lowmem_aitextgen import aitextgen, cli
tokenizer_file, original, results = sys.argv[1], sys.argv[2], {}
ids = torch.tensor([[5, 17, 230, 41, 9]])

def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()

def same(a, b):
    return "equal" if torch.equal(a, b) else "close" if torch.allclose(a, b, atol=1e-4) else "other"

untrained = logits(AutoModelForCausalLM.from_pretrained(original))
for out in sys.argv[3:]:
    ours = aitextgen(model_folder=out, tokenizer_file=tokenizer_file).model
    adapter = next((os.path.join(out, d) for d in ("adapter", "lora_adapter")
                    if os.path.isdir(os.path.join(out, d))), None)
    base = None
    if adapter is not None:
        named = json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"]
        prompt_learning = hasattr(ours, "prompt_encoder")
        base = AutoModelForCausalLM.from_pretrained(out if prompt_learning else named)
        peft = PeftModel.from_pretrained(base, adapter)
        from_adapter_folder = aitextgen(model_folder=adapter, tokenizer_file=tokenizer_file).model
    texts = pipeline("text-generation", model=out, tokenizer=out)("The", max_new_tokens=5, do_sample=False)
    cli.main(["generate", f"--model_folder={out}", f"--tokenizer_file={tokenizer_file}", "--n=2",
              "--max_length=12", "--destination_path=generated.txt"])
    plain = logits(AutoModelForCausalLM.from_pretrained(out))
    results[out] = {
        "auto": same(plain, logits(ours)) if adapter is None or not prompt_learning
        else "base" if torch.equal(plain, logits(ours.get_base_model())) else "other",
        "peft": None if adapter is None else same(logits(peft), logits(ours)),
        "aitextgen(adapter folder)": None if adapter is None else same(logits(from_adapter_folder), logits(ours)),
        "AutoPeftModel": None if adapter is None or prompt_learning
        else same(logits(AutoPeftModelForCausalLM.from_pretrained(adapter)), logits(ours)),
        "trained": same(logits(ours), untrained) == "other",
        "pipeline": isinstance(texts[0]["generated_text"], str),
        "cli": open("generated.txt", encoding="utf-8").read().count("=" * 20)}
print(json.dumps(results))
"""

# What each loader gives, by kind of run (the README's table of outputs): "equal" the model aitextgen loads,
# "close" the same model unmerged (the adapter on the base it names: float rounding apart), "base" the base.
EXPECTED = {
    "full": {"auto": "equal", "peft": None, "aitextgen(adapter folder)": None, "AutoPeftModel": None},
    "fsdp": {"auto": "equal", "peft": None, "aitextgen(adapter folder)": None, "AutoPeftModel": None},
    "lora": {"auto": "equal", "peft": "close", "aitextgen(adapter folder)": "close",
                     "AutoPeftModel": "close"},
    "ia3": {"auto": "equal", "peft": "close", "aitextgen(adapter folder)": "close",
                     "AutoPeftModel": "close"},
    "resumed lora": {"auto": "equal", "peft": "close", "aitextgen(adapter folder)": "close",
                     "AutoPeftModel": "close"},
    "prefix": {"auto": "base", "peft": "equal", "aitextgen(adapter folder)": "equal", "AutoPeftModel": None},
}


@pytest.mark.edges
def test_every_kind_of_output_dir_loads_in_every_loader_in_a_new_process(text, realistic_base64, tokenizer_file):
    """For a full, sharded, LoRA, IA3, resumed LoRA and prefix-tuned run: AutoModelForCausalLM and pipeline
    read output_dir (the trained model; for prefix tuning, which changes no weight, the base: no
    adapter_config.json at the top for transformers to trip on), peft's documented call puts the adapter on
    the base it was trained on and gives the model aitextgen(model_folder=out) loads (unmerged, for
    methods saved merged), so does aitextgen(model_folder=<the adapter folder>), and the CLI generates."""
    from lowmem_aitextgen import hardware

    kinds = {"full": {}, "fsdp": {"strategy": "fsdp", "n_gpu": 0}, "lora": {"lora": True},
             "ia3": {"peft_config": IA3Config()}, "prefix": {"adapter": "prefix"}}
    # trained as on a CPU without native bf16, so the runs save fp32 models on every CPU kind and "equal" and
    # "close" mean the same everywhere (what a bf16 merge rounds: test_the_merge_equals_the_adapter_model_...)
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):
        for name, kwargs in kinds.items():
            aitextgen(model_folder=realistic_base64, tokenizer_file=tokenizer_file).train(
                text, output_dir=name, num_steps=2, save_every=0, generate_every=0, learning_rate=1e-2, seed=1,
                **kwargs)
        for callbacks, resume in (([CtrlC(at_step=1)], False), ([], True)):
            aitextgen(model_folder=realistic_base64, tokenizer_file=tokenizer_file).train(
                text, output_dir="resumed lora", num_steps=3, save_every=0, generate_every=0, learning_rate=1e-2,
                seed=1, lora=True, callbacks=callbacks, resume=resume)
    result = subprocess.run([sys.executable, "-c", LOADERS, tokenizer_file, realistic_base64, *EXPECTED],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        name: {**expected, "trained": True, "pipeline": True, "cli": 2} for name, expected in EXPECTED.items()}


def trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """The adapter's parameters moved away from their initialisation (LoRA's B starts at zero, IA3's scales at
    one: merging either at init changes nothing)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.uniform_(0.5, 1.5) if "ia3_l" in name else parameter.normal_(0.0, 0.1)
    return model


# Every method peft can merge that attaches to GPT-2's Conv1D projections (LoHa, LoKr, BOFT and OFT refuse them).
MERGEABLE = {
    "lora": lambda: LoraConfig(target_modules=["c_attn", "c_proj", "c_fc"]),
    "lora with bias": lambda: LoraConfig(target_modules=["c_attn", "c_fc"], lora_bias=True),
    "ia3 attention": lambda: IA3Config(target_modules=["c_attn"], feedforward_modules=[]),
    "ia3 feed-forward": lambda: IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"]),
    "adalora": lambda: AdaLoraConfig(target_modules=["c_attn"], total_step=10),
    "vera": lambda: VeraConfig(target_modules=["c_attn"]),
    "fourierft": lambda: FourierFTConfig(target_modules=["c_attn"]),
}


@pytest.mark.edges
@pytest.mark.parametrize("base", ["fp32", "bf16", "4-bit"])
@pytest.mark.parametrize("method", MERGEABLE)
def test_the_merge_equals_the_adapter_model_on_a_realistic_base(method, base):
    """For every mergeable method, on a base held as training holds it (fp32, bf16, NF4): the merged model
    gives the adapter model's logits (fp32 math, within float rounding), the 16-bit merge is the fp32 one
    rounded once, and the model merge_in_place leaves in the object holds what the save writes."""
    from lowmem_aitextgen.training import adapters, four_bit
    from lowmem_aitextgen.training.adapter_settings import AdapterSettings

    torch.manual_seed(0)
    model = realistic(GPT2LMHeadModel(tiny_gpt2_config())).requires_grad_(False)
    if base != "fp32":
        model.to(torch.bfloat16)
    if base == "4-bit":
        four_bit.hold_base_in_four_bits(model)
    trained = trained_like(adapters.add_adapter(model, AdapterSettings.of(MERGEABLE[method]())))
    ids = torch.randint(1000, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad(), four_bit.dense_while(m, torch.float32):
            return m.eval().float()(input_ids=ids).logits

    expected = logits(trained)
    merged = {dtype: {w.name: w.make() for w in adapters.merged_weights(trained, dtype)}
              for dtype in (torch.float32, torch.bfloat16)}
    assert all(torch.equal(merged[torch.bfloat16][name], value.to(torch.bfloat16))
               for name, value in merged[torch.float32].items())
    saved = GPT2LMHeadModel(tiny_gpt2_config())
    saved.load_state_dict(merged[torch.float32], strict=False)
    saved.tie_weights()
    assert (logits(saved) - expected).abs().max() <= 1e-4 * expected.abs().max()  # fp32 sums in another order
    saved_dtype = torch.float32 if base == "fp32" else torch.bfloat16
    in_memory = adapters.merge_in_place(trained, saved_dtype)
    with four_bit.dense_while(in_memory, saved_dtype):
        assert all(torch.equal(value, merged[saved_dtype][name]) for name, value in in_memory.state_dict().items()
                   if name in merged[saved_dtype])
