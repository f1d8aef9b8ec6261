"""Updates inside backward (in_backward.py): the same step as an ordinary optimizer's without clipping,
clipping per tensor as documented, chosen by the planner exactly where the tiers above stop fitting, never
for a user who pinned the optimizer or an accumulation, and resumed bit-equal."""

import copy
import dataclasses
import functools
import json
import types

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import CtrlC, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import budget, in_backward
from lowmem_aitextgen.training.budget import budgeted_bytes, fit_plan, stepping_in_backward
from lowmem_aitextgen.training.estimate import estimate_plan
from lowmem_aitextgen.training.in_backward import StepInBackward, adafactor_in_rows, round_stochastically
from lowmem_aitextgen.training.optimizers import optimizer_over, parameter_groups
from lowmem_aitextgen.training.plan import PlannerInputs, TrainPlan
from lowmem_aitextgen.training.report import RunRecorder

# wide enough that the blocks' gradients, not the embedding's alone, are what updating inside backward saves
CONFIG = tiny_gpt2_config(n_layer=4, n_positions=64, n_embd=256)
BLOCK = 64


def batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1000, (2, 32), generator=generator) for _ in range(n)]


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.step(closure=loss.backward) if isinstance(optimizer, StepInBackward) else loss.backward()
        if not isinstance(optimizer, StepInBackward):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_without_clipping_three_steps_inside_backward_equal_the_ordinary_adamw_steps():
    torch.manual_seed(0)
    ordinary = GPT2LMHeadModel(CONFIG)
    inside = copy.deepcopy(ordinary)
    adamw = torch.optim.AdamW(parameter_groups(ordinary, 0.01), lr=1e-3, fused=True)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)
    stepper = StepInBackward(parameter_groups(inside, 0.01), make, learning_rate=1e-3)
    train_steps(ordinary, adamw, batches(3))
    train_steps(inside, stepper, batches(3))
    for (name, a), b in zip(ordinary.named_parameters(), inside.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
        assert b.grad is None, name  # freed as soon as it was used
    assert not torch.equal(ordinary.transformer.h[0].mlp.c_fc.weight, GPT2LMHeadModel(CONFIG).transformer.h[0].mlp.c_fc.weight)


def test_each_tensor_is_clipped_alone_to_max_grad_norm():
    """With SGD the update is the clipped gradient: each tensor's is scaled to at most max_grad_norm by its
    own norm (torch's clip_grads_with_norm_ rule), not by the norm of all of them."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    reference = copy.deepcopy(model)
    ids = batches(1)[0]
    reference(input_ids=ids, labels=ids).loss.backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    stepper = StepInBackward([{"params": list(model.parameters())}], functools.partial(torch.optim.SGD, lr=1.0),
                             learning_rate=1.0, max_grad_norm=0.05)
    stepper.step(closure=model(input_ids=ids, labels=ids).loss.backward)
    clipped = 0
    for (name, p), g in zip(model.named_parameters(), (q.grad for q in reference.parameters())):
        expected = g * min(1.0, 0.05 / (g.norm().item() + 1e-6))
        torch.testing.assert_close(before[name] - p.detach(), expected, rtol=1e-4, atol=1e-7, msg=name)
        clipped += g.norm().item() > 0.05
    assert 0 < clipped < len(before)  # some tensors were clipped, others kept their gradient


def test_the_state_dict_is_an_ordinary_optimizers_and_round_trips():
    """Per tensor inside, one ordinary state dict outside: an AdamW checkpoint loads into it (out-of-memory
    recovery steps into this tier with the state it has) and back."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    adamw = torch.optim.AdamW(parameter_groups(model, 0.01), lr=1e-3)
    train_steps(model, adamw, batches(1))
    stepper = StepInBackward(parameter_groups(model, 0.01), functools.partial(torch.optim.AdamW, lr=1e-3), 1e-3)
    stepper.load_state_dict(adamw.state_dict())
    for a, b in zip(adamw.state_dict()["state"].values(), stepper.state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    adamw.load_state_dict(stepper.state_dict())


def in_backward_user_plan(**fields) -> TrainPlan:
    return TrainPlan(n_layer=CONFIG.n_layer, micro_batch_size=1, accumulation=2, loss_chunk_tokens=None, **fields)


def fastest_needs(plans, block: int = BLOCK) -> int:
    return min(budgeted_bytes(p, estimate_plan(CONFIG, p, block)) for p in plans)


def test_the_planner_steps_inside_backward_exactly_where_the_16_bit_tier_stops_fitting():
    plan = in_backward_user_plan()
    sixteen = dataclasses.replace(plan, optimizer="adamw8bit")
    above = fastest_needs(budget.sixteen_bit_weights(sixteen, CONFIG, PlannerInputs()))
    inside = fastest_needs(budget.sixteen_bit_weights(stepping_in_backward(sixteen, "adamw8bit"), CONFIG, PlannerInputs()))
    assert inside < above
    chosen, estimate = fit_plan(CONFIG, plan, BLOCK, above)
    assert not chosen.step_in_backward and chosen.optimizer == "adamw8bit"
    chosen, estimate = fit_plan(CONFIG, plan, BLOCK, above - 1)
    assert chosen.step_in_backward and (chosen.micro_batch_size, chosen.accumulation) == (2, 1)
    assert "inside backward" in chosen.chosen_because and "no accumulation" in chosen.describe(1, 1, 0)
    assert estimate.gradients < estimate.weights / 2  # one tensor's gradient at a time, not all of them
    adafactor = fastest_needs(budget.sixteen_bit_weights(
        stepping_in_backward(sixteen, "adafactor"), CONFIG, PlannerInputs()))
    assert adafactor < inside
    chosen, _ = fit_plan(CONFIG, plan, BLOCK, inside)
    assert chosen.step_in_backward and chosen.optimizer == "adamw8bit"
    chosen, _ = fit_plan(CONFIG, plan, BLOCK, inside - 1)
    assert chosen.step_in_backward and chosen.optimizer == "adafactor" and "Adafactor" in chosen.chosen_because
    with pytest.raises(MemoryError):
        fit_plan(CONFIG, plan, BLOCK, adafactor - 1)


def test_rounding_to_bf16_is_stochastic_and_unbiased():
    """Between two neighbouring bf16 values, each fp32 value rounds to one of them, on average to itself:
    an update below half a bf16 step moves a bf16 weight (to nearest it would be lost)."""
    low = torch.tensor(1.0, dtype=torch.bfloat16)
    high = torch.nextafter(low, torch.tensor(2.0, dtype=torch.bfloat16))
    value = low.float() + 0.1 * (high.float() - low.float())
    torch.manual_seed(0)
    rounded = round_stochastically(value.expand(100_000).clone(), torch.bfloat16)
    assert set(rounded.unique().tolist()) == {low.item(), high.item()}
    assert abs(rounded.float().mean().item() - value.item()) < 0.01 * (high - low).item()
    assert value.to(torch.bfloat16) == low  # to nearest: the update is gone
    negative = round_stochastically(-value.expand(100_000).clone(), torch.bfloat16)
    assert abs(negative.float().mean().item() + value.item()) < 0.01 * (high - low).item()


@pytest.mark.parametrize("sliced", [False, True])
def test_a_16_bit_weight_stepped_through_fp32_takes_the_fp32_step_rounded(sliced, monkeypatch):
    """Adafactor inside backward on bf16 weights: the step is the fp32 one on the same values (its state in
    fp32), and the weight lands on a bf16 neighbour of the fp32 result (where the gradient, made in bf16,
    lets it); also for a matrix over SLICE_VALUES, stepped in slices of rows."""
    if sliced:
        monkeypatch.setattr(in_backward, "SLICE_VALUES", 256)
    torch.manual_seed(0)
    value = torch.randn(64, 32)
    fp32 = torch.nn.Parameter(value.bfloat16().float())
    half = torch.nn.Parameter(value.bfloat16())
    make = functools.partial(optimizer_over, learning_rate=1e-2, adam_epsilon=1e-8, optimizer="adafactor")
    fp32_stepper = StepInBackward([{"params": [fp32]}], make, 1e-2)
    half_stepper = StepInBackward([{"params": [half]}], make, 1e-2, through_fp32=True)
    assert in_backward.steps_in_rows(half_stepper.inner[0], half) == sliced
    x = torch.randn(8, 64)
    fp32_stepper.step(lambda: (x @ fp32).square().sum().backward())
    half_stepper.step(lambda: (x @ half.float()).square().sum().backward())
    step = (fp32.detach() - value.bfloat16().float()).abs()
    assert step.max() > 0
    ulp = torch.nextafter(half.detach(), torch.full_like(half, float("inf"))).float() - half.detach().float()
    # a bf16 neighbour of the fp32 result, give or take the bf16 gradient's own rounding (0.4% of the step)
    assert ((half.detach().float() - fp32.detach()).abs() <= 2 * ulp + 0.01 * step).all() and half.grad is None
    state = half_stepper.state_dict()["state"][0]
    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step" and torch.is_tensor(v))
    assert state["exp_avg_sq_row"].shape == (64,) and state["exp_avg_sq_col"].shape == (32,)


@pytest.mark.parametrize("pinned, fix", [
    ({"fixed": frozenset({"optimizer"})}, "optimizer="),
    ({}, "gradient_accumulation_steps="),
])
def test_a_pinned_optimizer_or_accumulation_is_never_stepped_inside_backward_and_the_error_names_it(pinned, fix):
    plan = in_backward_user_plan(**pinned)
    asked = PlannerInputs(accumulation_pinned=not pinned)
    inside = fastest_needs(budget.sixteen_bit_weights(stepping_in_backward(
        dataclasses.replace(plan, fixed=frozenset()), "adamw8bit"), CONFIG, PlannerInputs()))
    with pytest.raises(MemoryError, match=f"Without {fix}.*leave {fix} out"):
        fit_plan(CONFIG, plan, BLOCK, inside, asked)


@pytest.mark.edges
@pytest.mark.parametrize("optimizer", ["adamw8bit", "adafactor"])
def test_a_run_inside_backward_trains_records_it_and_resumes_bit_equal(optimizer, small_data, tokenizer_file,
                                                                        tmp_path):
    """train() with a max_memory only that tier fits (the one above it needs a byte more): the loss falls,
    the summary says what changed from the call, and Ctrl-C then resume=True ends with the uninterrupted
    weights."""
    base_folder = str(tmp_path / "wide")
    GPT2LMHeadModel(CONFIG).save_pretrained(base_folder)
    args = dict(num_steps=6, batch_size=2, learning_rate=1e-3, warmup_steps=1, save_every=0, generate_every=0,
                seed=1, block_size=32)
    plan = TrainPlan(n_layer=CONFIG.n_layer, micro_batch_size=2, loss_chunk_tokens=128, optimizer="adamw8bit")
    if optimizer == "adafactor":  # the tier above it: 8-bit AdamW inside backward
        plan = stepping_in_backward(plan, "adamw8bit")
    above = fastest_needs(budget.sixteen_bit_weights(plan, CONFIG, PlannerInputs()), block=32)

    def run(output_dir, **kwargs):
        ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
        ai.train(small_data, output_dir=output_dir, max_memory=above - 1, **args, **kwargs)
        return ai

    uninterrupted = run("uninterrupted").model.state_dict()
    with open("uninterrupted/training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["plan"]["step_in_backward"] and summary["plan"]["gradient_accumulation_steps"] == 1
    assert summary["plan"]["optimizer"].lower().startswith(optimizer[:5])  # the class each tensor steps with
    assert summary["final_loss"] < summary["final_avg_loss"] - 0.3  # well below the running average: it falls
    assert summary["plan"]["clipping"] == "per tensor" and summary["plan"]["skipped_tensor_updates"] == 0
    run("interrupted", callbacks=[CtrlC(at_step=2)])
    resumed = run("interrupted", resume=True).model.state_dict()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_a_gradient_that_is_not_finite_skips_its_own_tensor_warns_once_and_is_counted_in_the_summary(caplog,
                                                                                                       tmp_path):
    torch.manual_seed(0)
    kept, stepped = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    before_kept, before_stepped = kept.detach().clone(), stepped.detach().clone()
    make = functools.partial(torch.optim.AdamW, lr=1e-2)
    stepper = StepInBackward([{"params": [kept, stepped]}], make, 1e-2, max_grad_norm=0.5)
    poison = torch.full((4, 4), float("nan"))
    with caplog.at_level("WARNING", logger="lowmem_aitextgen"):
        for _ in range(2):
            stepper.step(lambda: ((kept * poison).sum() + stepped.square().sum()).backward())
    assert torch.equal(kept.detach(), before_kept) and kept.grad is None
    assert not torch.equal(stepped.detach(), before_stepped)
    assert stepper.skipped_tensors == 2
    assert sum("was not finite" in record.getMessage() for record in caplog.records) == 1
    recorder = RunRecorder(stepping_in_backward(TrainPlan(n_layer=CONFIG.n_layer), "adamw8bit"), 0.01, 0.5)
    module = types.SimpleNamespace(model=torch.nn.Linear(2, 2))
    recorder.on_before_optimizer_step(None, module, stepper)
    recorder.on_optimizer_step(types.SimpleNamespace(global_step=1, loggers=[]), module, 1.0)
    assert recorder.summary(module.model, str(tmp_path))["plan"]["skipped_tensor_updates"] == 2


@pytest.mark.edges
def test_adafactor_in_slices_of_rows_is_transformers_step():
    """A large matrix's Adafactor step, computed a slice of rows at a time (no whole fp32 copy): three steps
    equal transformers' Adafactor on the same fp32 weight within float rounding, clipping and weight decay
    included, and so does the state it keeps."""
    torch.manual_seed(0)
    value = torch.randn(50, 24)
    whole, sliced = torch.nn.Parameter(value.clone()), torch.nn.Parameter(value.clone())
    reference = optimizer_over([{"params": [whole], "weight_decay": 0.1}], 1e-2, 1e-8, "adafactor")
    placeholder = torch.nn.Parameter(torch.empty(0))
    ours = optimizer_over([{"params": [placeholder], "weight_decay": 0.1}], 1e-2, 1e-8, "adafactor")
    for step in range(3):
        grad = torch.randn(50, 24) * torch.linspace(0.1, 5, 24)  # uneven columns: the factored statistics matter
        grad[step] *= 50  # an outlying row: the update's RMS exceeds 1 and is clipped
        whole.grad = grad.clone()
        reference.step()
        adafactor_in_rows(ours, placeholder, sliced.data, grad.clone(), slice_values=7 * 24)  # 8 slices, the last short
    assert not torch.equal(whole, value)
    torch.testing.assert_close(sliced.data, whole.data, rtol=1e-6, atol=1e-7)
    expected, got = reference.state[whole], ours.state[placeholder]
    assert got.keys() == expected.keys() and got["step"] == expected["step"] == 3
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "RMS"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=0, msg=key)


def test_a_resume_that_fits_nothing_says_what_the_checkpoint_fixes_apart_from_the_call(small_data, tokenizer_file,
                                                                                        tmp_path):
    """A run that stepped Adafactor inside backward, resumed within a budget nothing fits: the refusal names no
    argument of the user's as fixed, says the checkpoint holds the optimizer and the updates inside backward, and
    offers no other optimizer (the checkpoint holds Adafactor's state), only a start over without it."""
    base_folder = str(tmp_path / "wide")
    GPT2LMHeadModel(CONFIG).save_pretrained(base_folder)
    args = dict(num_steps=6, batch_size=2, learning_rate=1e-3, save_every=0, generate_every=0, seed=1, block_size=32)
    plan = stepping_in_backward(TrainPlan(n_layer=CONFIG.n_layer, micro_batch_size=2, loss_chunk_tokens=128,
                                          optimizer="adamw8bit"), "adamw8bit")
    above = fastest_needs(budget.sixteen_bit_weights(plan, CONFIG, PlannerInputs()), block=32)
    aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).train(
        small_data, output_dir="out", max_memory=above - 1, callbacks=[CtrlC(at_step=2)], **args)
    with pytest.raises(MemoryError) as refused:
        aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).train(
            small_data, output_dir="out", max_memory="1MB", resume=True, **args)
    first, *_, last = str(refused.value).splitlines()
    assert "arguments you fixed: none; the checkpoint to resume fixes the optimizer (Adafactor" in first
    assert "updates inside backward" in first and "8-bit" not in str(refused.value)
    assert "resume=False" in last
    # sharding, which updates inside backward cannot run under, refused at the argument (not TrainPlan's invariant)
    before = snapshot("out")
    with pytest.raises(ValueError, match=r"^strategy='fsdp': the checkpoint to resume updated each weight inside "
                                         r"backward, which needs one unsharded model.*resume=False"):
        aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).train(
            small_data, output_dir="out", resume=True, strategy="fsdp", n_gpu=0, devices=2, **args)
    assert snapshot("out") == before
