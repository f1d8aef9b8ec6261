"""plan: the decisions a plan makes from train()'s arguments."""

import pytest

from lowmem_aitextgen import plan


@pytest.mark.parametrize("fp16, precision, accelerator, bf16_fast, expected", [
    (True, None, "gpu", True, "bf16-mixed"),
    (True, None, "gpu", False, "16-mixed"),  # pre-Ampere GPU: fp16 with dynamic loss scaling
    (True, None, "cpu", False, "bf16-mixed"),
    (None, None, "cpu", True, "bf16-mixed"),  # default: bf16 where the device computes it natively
    (None, None, "cpu", False, "32-true"),
    (False, None, "gpu", True, "32-true"),  # an explicit fp16=False wins
    (True, "32", "gpu", True, "32-true"),  # precision= wins over fp16
    (None, "bf16", "cpu", False, "bf16-mixed"),
])
def test_precision_selection(monkeypatch, fp16, precision, accelerator, bf16_fast, expected):
    monkeypatch.setattr(plan, "bf16_is_fast", lambda device: bf16_fast)
    monkeypatch.setattr(plan, "mixed_precision_usable", lambda device: True)  # unusable: test_bad_input.py
    assert plan.resolve_precision(fp16, precision, accelerator) == expected


def plan_for(model, **kwargs):
    """The plan of a train() call with these arguments (the others at train()'s defaults)."""
    import inspect

    from lowmem_aitextgen.aitextgen import aitextgen as subclass
    from lowmem_aitextgen.arguments import Arguments
    from lowmem_aitextgen.plan import build_plan

    defaults = {name: p.default for name, p in inspect.signature(subclass.train).parameters.items()
                if name not in ("self", "kwargs")}
    args = Arguments({**defaults, "train_data": "x", **kwargs}, defaults)
    return build_plan(model, args, constructor_checkpointing=None, freeze_by_default=False,
                      model_has_adapter=False, resume_from=None, resumed=None)


def test_each_decision_is_made_from_the_arguments_in_one_place():
    from transformers import GPT2LMHeadModel

    from conftest import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config())
    plan = plan_for(model, n_gpu=0, lora=True, lora_r=4, batch_size=2, gradient_accumulation_steps=3, seed=5)
    assert (plan.accelerator, plan.lora.r, plan.effective_batch_size, plan.data_seed) == ("cpu", 4, 6, 5)
    assert plan.cpu_speedups and not plan.hold_freed_heap and plan.loss_chunk_tokens == 128  # budget.py may hold it
    assert plan.fixed == frozenset()  # nothing a budget may change was set
    fixed = plan_for(model, n_gpu=0, optimizer="adafactor", gradient_checkpointing=False).fixed
    assert fixed == {"optimizer", "gradient_checkpointing"}
    assert not plan_for(model, n_gpu=0).gradient_checkpointing  # 0.2M parameters: below 300M
