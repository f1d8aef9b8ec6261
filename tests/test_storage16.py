"""storage16: LoRA's frozen base held in bf16 and computed in fp32 trains exactly as an fp32 base of the
same (rounded) weights, keeps no fp32 copy of a weight for backward, and is chosen only where the memory
needs it and the layers allow it."""

import copy
import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.pytorch_utils import Conv1D

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.training import budget, storage16
from lowmem_aitextgen.training.adapter_settings import AdapterSettings
from lowmem_aitextgen.training.budget import budgeted_bytes, fit_plan
from lowmem_aitextgen.training.chunked_loss import causal_lm_loss
from lowmem_aitextgen.training.estimate import estimate_plan, memory_plan
from lowmem_aitextgen.training.plan import PlannerInputs, TrainPlan
from lowmem_aitextgen.training.techniques import apply_memory_plan

pytestmark = pytest.mark.edges  # forwards of transformers' Conv1D, Linear, LayerNorm and Embedding

CONFIG = tiny_gpt2_config(vocab_size=300, n_positions=64)


def rounded_model(config=CONFIG):
    """A random fp32 model whose weights are exactly representable in bf16."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def trained_step(model, plan, adapters=None):
    """(loss, adapter gradients, adapters) of one step of `plan`; `adapters` given: those values."""
    model, _ = apply_memory_plan(copy.deepcopy(model), plan)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                if adapters is None:  # lora_B starts at zero: give the adapters a gradient path both ways
                    param.normal_(generator=torch.Generator().manual_seed(len(name)))
                else:
                    param.copy_(adapters[name])
    ids = torch.randint(CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = causal_lm_loss(model, ids, plan.loss_chunk_tokens)
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return loss, {n: p.grad for n, p in trainable.items()}, {n: p.detach().clone() for n, p in trainable.items()}, model


@pytest.mark.parametrize("checkpointed", [0, "all"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_a_bf16_base_computed_in_fp32_trains_as_the_fp32_base_of_the_same_weights(checkpointed, chunk):
    base = rounded_model()
    fp32 = TrainPlan(adapter=AdapterSettings.lora(dropout=0.0), n_layer=CONFIG.n_layer,
                     checkpointed_blocks=CONFIG.n_layer if checkpointed == "all" else checkpointed, loss_chunk_tokens=chunk)
    loss, grads, adapters, _ = trained_step(base, fp32)
    loss16, grads16, _, model16 = trained_step(base, dataclasses.replace(fp32, upcast_bf16_weights=True), adapters)
    frozen = {p.dtype for p in model16.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16} and {p.dtype for p in grads16.values()} == {torch.float32}
    assert loss16.dtype == torch.float32 and torch.equal(loss16, loss)
    assert grads16.keys() == grads.keys() and all(torch.equal(grads16[k], grads[k]) for k in grads)


def test_no_fp32_copy_of_a_weight_is_kept_for_backward():
    """Autograd would keep each layer's upcast weight until backward: the fp32 base again."""
    plan = TrainPlan(adapter=AdapterSettings.lora(dropout=0.0), upcast_bf16_weights=True, loss_chunk_tokens=16)
    model, _ = apply_memory_plan(rounded_model(), plan)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    kept = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights and tuple(tensor.shape) in shapes:
            kept.append((tuple(tensor.shape), tensor.dtype))
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_loss(model, torch.randint(CONFIG.vocab_size, (1, 32)), 16)
    assert kept == []


@pytest.mark.parametrize("layer", [Conv1D(48, 32), torch.nn.Linear(32, 48)])
def test_a_16_bit_weight_that_trains_gets_its_gradient_in_its_own_dtype(layer):
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.copy_(reference.weight.bfloat16().float())
    layer.to(torch.bfloat16)
    storage16.compute_in_fp32(layer)
    x = torch.randn(3, 5, 32)
    out, expected = layer(x), reference(x)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-2)  # the bias was rounded
    out.square().sum().backward()
    expected_x = x.clone().requires_grad_()
    reference(expected_x).square().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.allclose(layer.weight.grad.float(), reference.weight.grad, rtol=2e-2, atol=1e-2)


def test_the_forwards_are_the_layers_own_for_fp32_weights_and_after_the_undo():
    model = rounded_model()
    ids = torch.randint(CONFIG.vocab_size, (1, 16))
    expected = model(ids).logits
    storage16.compute_in_fp32(model)
    assert torch.equal(model(ids).logits, expected)  # fp32 weights: nothing upcast, the same math
    storage16.restore_forwards(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_only_models_whose_layers_it_computes_for_are_offered_it():
    llama = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4)
    assert storage16.supported_config(CONFIG) and not storage16.supported_config(llama)
    lora = memory_plan("32-true", True, AdapterSettings.lora(), 1, "adamw", True, n_layer=1)
    assert any(p.upcast_bf16_weights for p in budget.open_choices(lora, CONFIG))
    assert not any(p.upcast_bf16_weights for p in budget.open_choices(lora, llama))
    assert not any(p.upcast_bf16_weights for p in budget.open_choices(lora))  # no model to check
    fixed = dataclasses.replace(lora, fixed=frozenset({"precision"}))  # fp32 asked for: weights not rounded
    assert not any(p.upcast_bf16_weights for p in budget.open_choices(fixed, CONFIG))
    full = dataclasses.replace(lora, adapter=None)
    assert not any(p.upcast_bf16_weights for p in budget.open_choices(full, CONFIG))


WIDE = tiny_gpt2_config(n_positions=64, n_layer=4, n_embd=256)  # the tokenizer fixture's 1,000 tokens


def lora_plan(**fields):
    plan = memory_plan("32-true", True, AdapterSettings.lora(), 1, "adamw", True, n_layer=4)
    return dataclasses.replace(plan, **fields)


def needs(plan):
    return budgeted_bytes(plan, estimate_plan(WIDE, plan, 64))


@pytest.fixture
def bf16_emulated():
    """This test's machine, as a CPU without native bf16 (where the choice matters): bf16 autocast
    weighed at its emulated speed whatever this CPU has."""
    with hardware.presenting(hardware.Hardware(hardware.CPUS["no native bf16"])):
        yield


def test_the_planner_stores_the_base_in_bf16_only_where_an_fp32_base_does_not_fit(bf16_emulated):
    fp32, upcast = needs(lora_plan()), needs(lora_plan(upcast_bf16_weights=True))
    assert upcast < fp32
    roomy, _ = fit_plan(WIDE, lora_plan(), 64, 2**40)
    assert not roomy.upcast_bf16_weights  # the upcasts cost time
    tight, estimate = fit_plan(WIDE, lora_plan(), 64, (fp32 + upcast) // 2)
    assert tight.bf16_weights_computed_in_fp32 and tight.precision == "32-true"  # faster than emulated bf16 autocast
    assert budgeted_bytes(tight, estimate) <= (fp32 + upcast) // 2
    assert "base stored in bf16" in tight.describe(1, 2, 3)


@pytest.mark.parametrize("fp16, stored", [(True, True), (False, False)])
def test_fp16_true_where_16_bit_math_is_emulated_may_still_store_the_base_in_bf16(bf16_emulated, fp16, stored):
    """fp16=True asks for 16 bits: on this CPU it computes in fp32 (plan.precision_note) and the planner may
    still hold LoRA's base in bf16 to fit; fp16=False asks for fp32 weights, which are kept."""
    fp32, upcast = needs(lora_plan()), needs(lora_plan(upcast_bf16_weights=True))
    asked = lora_plan(fixed=frozenset({"fp16"}))
    try:
        chosen, _ = fit_plan(WIDE, asked, 64, (fp32 + upcast) // 2, PlannerInputs(fp32_asked=not fp16))
    except MemoryError:  # fp32 weights asked for, and no other choice fits
        chosen = None
    assert (chosen is not None and chosen.bf16_weights_computed_in_fp32) == stored
    assert chosen is None or chosen.precision == "32-true"


def test_train_with_max_memory_stores_the_base_in_bf16_and_saves_a_loadable_model(
        bf16_emulated, tokenizer_file, corpus_file, tmp_path):
    fp32, upcast = needs(lora_plan()), needs(lora_plan(upcast_bf16_weights=True))
    ai = aitextgen(tokenizer_file=tokenizer_file, config=WIDE)
    out = tmp_path / "out"
    ai.train(corpus_file, output_dir=str(out), num_steps=3, save_every=0, generate_every=0, lora=True,
             gradient_checkpointing=True, max_memory=(fp32 + upcast) // 2, block_size=64, learning_rate=1e-3)
    with open(out / "training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["plan"]["upcast_bf16_weights"] and summary["plan"]["precision"] == "32-true"
    # the object holds what output_dir holds, in the dtype it was constructed (and saved) in: the bf16 base
    # upcast exactly, the merge made in fp32 as the save makes it
    assert {p.dtype for p in ai.model.parameters()} == {torch.float32}
    reloaded = aitextgen(model_folder=str(out), tokenizer_file=tokenizer_file)
    saved, held = reloaded.model.state_dict(), ai.model.state_dict()
    assert saved.keys() == held.keys() and all(torch.equal(saved[k], held[k]) for k in held)
    assert ai.generate_one(max_length=8, seed=1) == reloaded.generate_one(max_length=8, seed=1)


@pytest.mark.parametrize("checkpointed, chunk", [(0, None), ("all", 16)])
def test_every_weight_in_bf16_computed_in_fp32_gets_the_fp32_gradient_rounded(checkpointed, chunk):
    """A full fine-tune held in bf16 (storage16 for 8-bit AdamW): the fp32 model's loss of the same weights,
    and each gradient that fp32 model's, rounded to bf16 once; the tied embedding sums two rounded gradients."""
    base = rounded_model()
    ids = torch.randint(CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for upcast in (False, True):
        plan = TrainPlan(n_layer=CONFIG.n_layer, checkpointed_blocks=CONFIG.n_layer if checkpointed == "all" else 0,
                         loss_chunk_tokens=chunk, optimizer="adamw8bit",
                         upcast_bf16_weights=upcast)
        model, _ = apply_memory_plan(copy.deepcopy(base), plan)
        loss = causal_lm_loss(model, ids, chunk)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}, model))
    (loss, grads, _), (loss16, grads16, model16) = results
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16} == {g.dtype for g in grads16.values()}
    assert loss16.dtype == torch.float32 and torch.equal(loss16, loss)
    tied = "transformer.wte.weight"
    assert all(torch.equal(grads16[k], grads[k].bfloat16()) for k in grads if k != tied)
    assert torch.allclose(grads16[tied].float(), grads[tied], rtol=2**-6, atol=2**-7 * grads[tied].abs().max())


def full_plan(**fields):
    plan = memory_plan("32-true", True, None, 1, "adamw", True, n_layer=4)
    return dataclasses.replace(plan, **fields)


def test_a_full_fine_tune_is_held_in_bf16_only_where_8_bit_adamw_in_fp32_does_not_fit(bf16_emulated):
    eight_bit = needs(full_plan(optimizer="adamw8bit"))
    upcast = needs(full_plan(optimizer="adamw8bit", upcast_bf16_weights=True))
    assert upcast < eight_bit
    roomy, _ = fit_plan(WIDE, full_plan(), 64, eight_bit)
    assert not roomy.upcast_bf16_weights
    tight, estimate = fit_plan(WIDE, full_plan(), 64, (eight_bit + upcast) // 2)
    assert (tight.bf16_weights_computed_in_fp32, tight.precision, tight.optimizer) == (True, "32-true", "adamw8bit")
    assert "16-bit weights with 8-bit AdamW" in tight.chosen_because and "with bf16 weights" in tight.chosen_because
    assert budgeted_bytes(tight, estimate) <= (eight_bit + upcast) // 2
    assert "weights stored in bf16" in tight.describe(1, 2, 3)
    resumed = full_plan(optimizer="adamw8bit", fixed=frozenset({"optimizer"}))  # a resumed run's optimizer
    again, _ = fit_plan(WIDE, resumed, 64, (eight_bit + upcast) // 2)
    assert again.bf16_weights_computed_in_fp32 and again.checkpointed_blocks == tight.checkpointed_blocks  # resumable
    fixed = dataclasses.replace(full_plan(), fixed=frozenset({"precision"}))  # fp32 asked for
    with pytest.raises(Exception, match="max_memory"):
        fit_plan(WIDE, fixed, 64, (eight_bit + upcast) // 2)


def test_a_full_fine_tune_in_bf16_computed_in_fp32_follows_fp32_adamw_within_seed_noise(
        bf16_emulated, corpus_file, tokenizer_file):
    """The plan max_memory= picks where 8-bit AdamW in fp32 does not fit learns as fp32 AdamW does: the last
    steps' mean loss is as close to fp32's as two fp32 seeds are."""
    from test_optimizers import losses_of, tail_mean

    config = tiny_gpt2_config(n_embd=128, dropout=0.1)
    plan = dataclasses.replace(full_plan(optimizer="adamw8bit", checkpointed_blocks=0), n_layer=2,
                               micro_batch_size=4)
    fp32_8bit = budgeted_bytes(plan, estimate_plan(config, plan, 32))
    upcast = budgeted_bytes(plan, estimate_plan(config, dataclasses.replace(plan, upcast_bf16_weights=True), 32))
    fp32 = [tail_mean(losses_of(corpus_file, tokenizer_file, seed, "32-true", "adamw", 3e-3)[0]) for seed in (1, 2)]
    losses, ai = losses_of(corpus_file, tokenizer_file, 1, None, None, 3e-3, max_memory=(fp32_8bit + upcast) // 2)
    with open("run_1_None/training_summary.json", encoding="utf-8") as f:
        chosen = json.load(f)["plan"]
    assert chosen["upcast_bf16_weights"] and chosen["precision"] == "32-true" and "8bit" in chosen["optimizer"]
    assert {p.dtype for p in ai.model.parameters()} == {torch.bfloat16}  # held in bf16 throughout
    assert tail_mean(losses) < losses[0] - 0.5
    assert abs(tail_mean(losses) - fp32[0]) <= 2 * abs(fp32[0] - fp32[1]) + 0.02, (tail_mean(losses), fp32)
